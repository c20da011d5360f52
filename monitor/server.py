"""Running the collector app with uvicorn: the settings that bound connections, and a
background-thread server for callers that own their main thread.

:func:`uvicorn_config` is what ``trainvitals serve`` runs: one worker; at most
``max_connections`` served at once (beyond: 503); a connection that has not sent
a request's headers within ``header_timeout_seconds`` (the first request's and
every later one's on a keep-alive connection) or its body within
``body_timeout_seconds`` is closed (uvicorn itself waits for ever, so 1,000
half-open connections used to exhaust the process's files and its connection
slots); idle keep-alive closed after ``keepalive_seconds``; TCP_NODELAY on every
served connection; no access log unless
``access_log``; HTTPS with ``tls_certfile``/``tls_keyfile``.

:func:`serve_in_thread` serves in a thread of this process (``trainvitals demo``
and tests that need a real collector on a loopback port).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from trainvitals.monitor.settings import Settings
from trainvitals.wire.errors import TrainvitalsError

__all__ = ["PortInUse", "base_url", "bind", "serve_in_thread", "uvicorn_config"]

log = logging.getLogger(__name__)

_POLL_S = 0.005  # seconds between checks that uvicorn is listening


class PortInUse(TrainvitalsError, OSError):
    """The port is taken (another collector, ``trainvitals serve &``, or any other process)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; :class:`PortInUse` (naming both) when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        shown = f"[{host}]" if ":" in host else host
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(
                exc.errno,
                f"{shown}:{port} is already in use (another collector, or "
                "`trainvitals serve &` still running?); stop it or pick another port "
                "(--port, 0 for any free one)",
            ) from None
        raise OSError(exc.errno, f"cannot listen on {shown}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def base_url(host: str, port: int, *, tls: bool = False) -> str:
    """The URL the collector is reached at on ``host:port``: a wildcard address (0.0.0.0,
    ::) is this machine's name, since links built from it must open elsewhere."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn() or socket.gethostname()
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def _protocol(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    class GuardedH11Protocol(H11Protocol):
        """h11 with deadlines on every request of a connection: its headers must arrive
        within ``header_timeout`` seconds of its first byte (of the connection, for the
        first request), its body within ``body_timeout`` of its headers (a route that reads
        the body answers 408 first; one that does not is closed on); TCP_NODELAY on the
        served socket (small answers are not held back by Nagle's algorithm)."""

        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: str = ""  # "headers" or "body": what the deadline is for

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            self._arm("headers")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._rearm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._rearm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _rearm(self) -> None:
            if self.transport.is_closing():
                self._disarm()
                return
            state = self.conn.their_state
            if state is h11.IDLE:
                # Bytes of a next request's head arrived (uvicorn stopped its keep-alive
                # timer for them), or nothing yet (its keep-alive timer runs).
                if self.timeout_keep_alive_task is None:
                    self._arm("headers", keep=True)
                else:
                    self._disarm()
            elif state is h11.SEND_BODY:
                self._arm("body", keep=True)
            else:
                self._disarm()

        def _arm(self, what: str, *, keep: bool = False) -> None:
            if keep and self._deadline is not None and self._waiting_for == what:
                return
            self._disarm()
            self._waiting_for = what
            timeout = header_timeout if what == "headers" else body_timeout + 1.0
            self._deadline = self.loop.call_later(timeout, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if (self._waiting_for == "headers" and state is h11.IDLE) or (
                self._waiting_for == "body" and state is h11.SEND_BODY
            ):
                log.warning(
                    "closed a connection from %s whose request %s did not arrive in time",
                    self.client[0] if self.client else "?",
                    self._waiting_for,
                )
                cycle = self.cycle
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True  # the app's receive() answers http.disconnect
                    cycle.message_event.set()
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration for ``settings`` (connection limits, timeouts, TLS, logs)."""
    options: dict[str, Any] = dict(
        host=settings.host,
        port=settings.port,
        workers=1,
        lifespan="on",
        http=_protocol(settings.header_timeout_seconds, settings.body_timeout_seconds),
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keepalive_seconds,
        h11_max_incomplete_event_size=64 * 1024,  # request line + headers, bytes
        access_log=settings.access_log,
        log_level=settings.log_level,
    )
    if settings.tls_certfile is not None:
        options.update(ssl_certfile=str(settings.tls_certfile), ssl_keyfile=str(settings.tls_keyfile))
    options.update(overrides)
    return uvicorn.Config(app, **options)


@contextmanager
def serve_in_thread(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 10.0,
    settings: Settings | None = None,
) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread (``port`` 0: a free one); yield its base URL.

    Binds first (:class:`PortInUse` when the port is taken), then waits up to
    ``timeout`` seconds for the server to start (RuntimeError otherwise). The
    server stops, running the app's lifespan shutdown, and the thread is joined
    when the block exits. ``settings`` (default: the app's) set the connection limits.
    """
    if settings is None:
        settings = getattr(getattr(app, "state", None), "settings", None) or Settings()
    sock = bind(host, port)
    config = uvicorn_config(app, settings, host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="trainvitals-collector", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the collector failed to start (see the log above)")
            if time.monotonic() > deadline:
                server.should_exit = True
                thread.join(timeout)
                raise RuntimeError(f"the collector did not start within {timeout} s")
            time.sleep(_POLL_S)
        url = base_url(host, sock.getsockname()[1], tls=settings.tls_certfile is not None)
        alerts = getattr(getattr(app, "state", None), "alerts", None)
        if alerts is not None:
            alerts.serving_at(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
