"""Helpers for the alert tests: reports and a recording HTTP sink (free ports,
polling and the real Alertmanager come from ``tests.support``, re-exported here)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support import ALERTMANAGER, free_port, running_alertmanager, wait_until
from trainvitals.wire import Event, Report, Sample

__all__ = ["ALERTMANAGER", "Received", "RecordingServer", "free_port", "report", "running_alertmanager",
           "wait_until"]


def report(step: int, samples: Iterable[tuple[str, dict[str, str], float]] = (), *,
           run: str = "r1", rank: int = 0, events: Iterable[str | tuple[str, str]] = (),
           time_: float | None = None) -> Report:
    """A wire Report from (name, labels, value) triples and event kinds."""
    evs = [Event(kind=e) if isinstance(e, str) else Event(kind=e[0], detail=e[1]) for e in events]
    return Report(run=run, step=step, time=time_ if time_ is not None else 1000.0 + step, rank=rank,
                  samples=[Sample(name=n, labels=dict(lb), value=v) for n, lb, v in samples],
                  events=evs)


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class RecordingServer:
    """A local HTTP server on port 0 that records requests and answers from a script.

    ``responses``: statuses (or (status, body, headers) tuples) answered in
    order, then ``default``. ``hang=True``: accept and never answer until closed.
    """

    responses: list[Any] = field(default_factory=list)
    default: int = 200
    default_body: bytes = b"ok"
    hang: bool = False
    requests: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with outer._lock:
                    outer.requests.append(Received("POST", self.path, dict(self.headers.items()), body))
                    planned = outer.responses.pop(0) if outer.responses else outer.default
                if outer.hang:
                    outer._release.wait(30)
                    self.close_connection = True
                    return
                status, payload, headers = (planned if isinstance(planned, tuple)
                                            else (planned, outer.default_body, {}))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def bodies(self) -> list[Any]:
        with self._lock:
            return [r.json() for r in self.requests]

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def __enter__(self) -> RecordingServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
