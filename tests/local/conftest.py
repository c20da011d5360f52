"""Fixtures of the local-diagnosis tests: recorded report files of the incident jobs."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread: the tiny jobs gain nothing from more, and the machine is shared."""
