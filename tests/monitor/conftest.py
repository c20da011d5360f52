"""Fixtures for the collector tests: a real collector (``tests.support.running_collector``,
uvicorn on 127.0.0.1, port 0) with default settings."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support import Collector, running_collector


@pytest.fixture
def collector() -> Iterator[Collector]:
    """A collector with default settings."""
    with running_collector() as running:
        yield running


@pytest.fixture
def client(collector: Collector) -> httpx.Client:
    """An httpx client bound to the default collector."""
    return collector.client
