"""Helpers for tests that need a real collector: uvicorn on 127.0.0.1, port 0."""

from __future__ import annotations

import threading
import time as _time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

__all__ = ["make_body", "make_report", "serve_in_thread"]


@contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0, timeout: float = 10.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread (``port`` 0: a free one); yield its base URL.

    The server stops (and the thread is joined) when the block exits.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="trainvitals-test-collector", daemon=True)
    thread.start()
    deadline = _time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test collector failed to start (see the log above)")
        if _time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout)
            raise RuntimeError(f"the test collector did not start within {timeout} s")
        _time.sleep(0.005)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


def make_report(
    run: str = "r1",
    step: int = 1,
    samples: list[dict[str, Any]] | None = None,
    *,
    rank: int = 0,
    events: list[dict[str, Any]] | None = None,
    time: float = 1_764_400_000.0,
) -> dict[str, Any]:
    """One wire report as a dict; by default a single ``loss{modality="text"}`` sample."""
    if samples is None:
        samples = [{"name": "loss", "labels": {"modality": "text"}, "value": 2.5}]
    return {
        "run": run,
        "step": step,
        "time": time,
        "rank": rank,
        "samples": samples,
        "events": events or [],
    }


def make_body(*reports: dict[str, Any]) -> dict[str, Any]:
    """A wire body (``{"schema": 1, "reports": [...]}``) around ``reports``."""
    return {"schema": 1, "reports": list(reports) if reports else [make_report()]}
