"""Real servers for the end-to-end alert tests: the collector and a recording webhook
receiver; Debian's Alertmanager and bounded polling come from ``tests.support``."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.support import ALERTMANAGER, running_alertmanager, wait_until
from trainvitals.alerts.loading import default_rule_paths
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings

__all__ = ["ALERTMANAGER", "Collector", "Receiver", "Request", "metric_values", "running_alertmanager",
           "running_collector", "short_silence_rules", "wait_until"]


# -- the collector -------------------------------------------------------------------
@dataclass
class Collector:
    url: str
    client: httpx.Client

    def alerts(self, run: str | None = None) -> list[dict[str, Any]]:
        """GET /v1/alerts, optionally only the alerts of one run."""
        response = self.client.get("/v1/alerts")
        response.raise_for_status()
        return [a for a in response.json() if run is None or a["labels"].get("run") == run]

    def firing(self, run: str | None = None) -> list[dict[str, Any]]:
        return [a for a in self.alerts(run) if a["state"] == "firing"]

    def wait_for(self, alertname: str, run: str, state: str = "firing", timeout: float = 15.0) -> dict[str, Any]:
        """The alert ``alertname`` of ``run`` once it is in ``state`` (bounded poll)."""

        def found() -> dict[str, Any] | None:
            for a in self.alerts(run):
                if a["alertname"] == alertname and a["state"] == state:
                    return a
            return None

        try:
            return wait_until(found, timeout, f"{alertname} {state} for run {run}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; alerts of the run: {self.alerts(run)}") from None

    def metrics(self) -> str:
        response = self.client.get("/metrics")
        response.raise_for_status()
        return response.text


@contextmanager
def running_collector(**settings: Any) -> Iterator[Collector]:
    """A real collector (uvicorn on 127.0.0.1, port 0) with ``Settings(**settings)``."""
    settings.setdefault("log_level", "warning")
    app = create_app(Settings(**settings))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield Collector(url, client)


def metric_values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of metric ``name`` in a Prometheus text exposition, by sorted labels."""
    out = {}
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")))
            out[labels] = float(match.group(2))
    return out


def short_silence_rules(folder: Path, silent_for: str = "2s") -> Path:
    """Copies of the default rule files with RunSilent's ``silent_for`` shortened."""
    folder.mkdir(parents=True, exist_ok=True)
    replaced = 0
    for path in default_rule_paths():
        text, n = re.subn(r"(?m)^(\s*silent_for:\s*)\S+", rf"\g<1>{silent_for}", path.read_text())
        replaced += n
        (folder / path.name).write_text(text)
    if replaced != 1:
        raise AssertionError(f"expected one silent_for in the default rules, found {replaced}")
    return folder


# -- a webhook receiver --------------------------------------------------------------------
@dataclass
class Request:
    path: str
    body: bytes
    answered: int | None  # the status sent back; None: never answered

    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """A local HTTP server on port 0 that records what is POSTed to it.

    ``statuses``: answers to the first requests, in order, then 200. ``hang``: read
    the request and never answer (until the receiver is closed, at most 30 s).
    """

    def __init__(self, statuses: list[int] | tuple[int, ...] = (), *, hang: bool = False):
        self.statuses = list(statuses)
        self.hang = hang
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._closed = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer._lock:
                    status = None if outer.hang else (outer.statuses.pop(0) if outer.statuses else 200)
                    outer.requests.append(Request(self.path, body, status))
                if status is None:
                    outer._release.wait(30)
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="e2e-receiver", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def received(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def close(self) -> None:
        """Release hanging requests and stop (idempotent)."""
        self._release.set()
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
