"""Serve the collector app with uvicorn on a background thread of this process.

For callers that own their main thread: the ``trainvitals demo`` command (which
trains a model while the collector runs) and tests that need a real collector
on a loopback port. ``trainvitals serve`` runs uvicorn in the foreground instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

__all__ = ["serve_in_thread"]

_POLL_S = 0.005  # seconds between checks that uvicorn is listening


@contextmanager
def serve_in_thread(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, timeout: float = 10.0
) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread (``port`` 0: a free one); yield its base URL.

    Waits up to ``timeout`` seconds for the server to listen (RuntimeError
    otherwise). The server stops, running the app's lifespan shutdown, and the
    thread is joined when the block exits.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="trainvitals-collector", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the collector failed to start (see the log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout)
            raise RuntimeError(f"the collector did not start within {timeout} s")
        time.sleep(_POLL_S)
    try:
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout)
