"""A local HTTP server that records what it is sent and answers from a script: the
stand-in for every receiver the tests cannot run here (a webhook, PagerDuty, Slack,
the collector as the hooks' sender sees it) and for Alertmanager's webhook target."""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Received", "RecordingServer", "Reply"]

# An answer: a status alone (with the server's ``body`` and ``headers``), or
# (status, body, headers).
Reply = int | tuple[int, bytes, dict[str, str]]

HANG_S = 30  # longest a hanging request is held open before the handler gives up, seconds


@dataclass
class Received:
    """One request as the server got it."""

    method: str
    path: str
    headers: dict[str, str]  # as sent (names in the sender's case)
    body: bytes  # gunzipped when sent with Content-Encoding: gzip
    answered: int | None  # the status sent back; None: never answered (``hang``)

    def json(self) -> Any:
        return json.loads(self.body)


class RecordingServer:
    """A ThreadingHTTPServer on 127.0.0.1, port 0, that records every POST/PUT.

    ``responses``: the answers to the first requests, in order; then ``default``
    for every later one. A plain status is sent with ``body`` and ``headers``.
    ``hang=True``: record the request and never answer it (until :meth:`close`, at
    most ``HANG_S``), as a receiver that accepts connections and stalls.
    Use as a context manager, or call :meth:`close` (idempotent).
    """

    def __init__(
        self,
        responses: list[Reply] | tuple[Reply, ...] = (),
        *,
        default: Reply = 200,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        hang: bool = False,
    ):
        self._script = list(responses)
        self._default = default
        self._body = body
        self._headers = dict(headers or {})
        self._hang = hang
        self._requests: list[Received] = []
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._closed = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _record_and_answer(self) -> None:
                payload = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    payload = gzip.decompress(payload)
                status, body, headers = outer._record(self.command, self.path, dict(self.headers.items()), payload)
                if status is None:
                    outer._release.wait(HANG_S)
                    self.close_connection = True
                    return
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_PUT = _record_and_answer

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="recording-server", daemon=True)
        self._thread.start()

    def _record(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int | None, bytes, dict[str, str]]:
        """Take the next scripted reply and record the request with it, at once (so the
        order of the record is the order of the script); return (status, body, headers),
        status None to hang."""
        with self._lock:
            planned = self._script.pop(0) if self._script else self._default
            if self._hang:
                reply: tuple[int | None, bytes, dict[str, str]] = (None, b"", {})
            elif isinstance(planned, tuple):
                reply = planned
            else:
                reply = (planned, self._body, self._headers)
            self._requests.append(Received(method, path, headers, body, reply[0]))
        return reply

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def received(self) -> list[Received]:
        """Every request so far, oldest first."""
        with self._lock:
            return list(self._requests)

    def bodies(self) -> list[Any]:
        """The JSON body of every request so far."""
        return [r.json() for r in self.received()]

    def count(self) -> int:
        with self._lock:
            return len(self._requests)

    def close(self) -> None:
        """Release hanging requests and stop (idempotent)."""
        self._release.set()
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> RecordingServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
