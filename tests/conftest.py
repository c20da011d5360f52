"""Fixtures for every suite. Helpers to import are in ``tests.support``,
``tests.http_recorder`` and ``tests.reports``."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import one_torch_thread as _one_torch_thread


@pytest.fixture(scope="session", autouse=True)
def _no_trainvitals_environment() -> Iterator[None]:
    """Keep a developer's TRAINVITALS_* variables out of the whole session: the
    collector's Settings and the hooks' default sink read them. Session-wide, so
    module-scoped fixtures (a collector started once per module) run without them too;
    a test that sets one with ``monkeypatch`` gets it back removed afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("TRAINVITALS_")]:
            mp.delenv(key)
        yield


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test (see ``tests.support.one_torch_thread``)."""
    with _one_torch_thread():
        yield
