"""Fixtures shared by the end-to-end alert tests (the environment is cleaned for the
whole session in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread: the tiny jobs gain nothing from more, and the machine is shared."""
