"""Fixtures for the collector tests: a real uvicorn server on 127.0.0.1, port 0."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import httpx
import pytest
from fastapi import FastAPI

from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings
from trainvitals.monitor.store import SeriesStore

RunningCollector = Callable[..., AbstractContextManager[tuple[str, FastAPI]]]


@pytest.fixture(autouse=True)
def _no_trainvitals_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep a developer's TRAINVITALS_* variables out of these tests."""
    for key in list(os.environ):
        if key.startswith("TRAINVITALS_"):
            monkeypatch.delenv(key)


@contextmanager
def _running_collector(
    settings: Settings | None = None, *, store: SeriesStore | None = None
) -> Iterator[tuple[str, FastAPI]]:
    app = create_app(settings if settings is not None else Settings(), store=store)
    with serve_in_thread(app) as base_url:
        yield base_url, app


@pytest.fixture
def running_collector() -> RunningCollector:
    """``with running_collector(settings) as (base_url, app): ...``"""
    return _running_collector


@pytest.fixture
def collector() -> Iterator[tuple[str, FastAPI]]:
    """A collector with default settings: (base_url, app)."""
    with _running_collector() as running:
        yield running


@pytest.fixture
def client(collector: tuple[str, FastAPI]) -> Iterator[httpx.Client]:
    """An httpx client bound to the default collector."""
    with httpx.Client(base_url=collector[0], timeout=10) as c:
        yield c
