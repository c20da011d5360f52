"""Fixtures shared by the end-to-end alert tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _quiet_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No developer TRAINVITALS_* settings; one torch thread (the tiny jobs gain
    nothing from more, and the machine is shared)."""
    for key in list(os.environ):
        if key.startswith("TRAINVITALS_"):
            monkeypatch.delenv(key)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
