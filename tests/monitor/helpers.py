"""Helpers of the collector's tests: bodies, a recording webhook, promtool, a collector
in a process of its own, a collector that answers late."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from tests.support import require_tool, wait_until


def body(*reports: dict[str, Any]) -> bytes:
    return json.dumps({"schema": 1, "reports": list(reports)}).encode()


def report(run: str = "r1", step: int = 1, samples: list | None = None, **extra: Any) -> dict[str, Any]:
    if samples is None:
        samples = [{"name": "loss", "labels": {"modality": "text"}, "value": 2.5}]
    return {"run": run, "step": step, "time": 1_764_400_000.0, "samples": samples, **extra}


def promtool_clean(text: bytes) -> None:
    """Fail unless ``promtool check metrics`` takes the exposition without a word; skip
    the test (after its other checks) where promtool is not installed."""
    proc = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, b""), (proc.stdout + proc.stderr).decode()


class AnswerLate:
    """ASGI middleware in front of a real collector: every ingest is applied at once and
    answered only after ``delay`` seconds (a slow link, or a client timeout shorter than
    the collector's answer)."""

    def __init__(self, app: Any, delay: float) -> None:
        self.app, self.delay = app, delay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/reports":
            return await self.app(scope, receive, send)
        held = []

        async def later(message: Any) -> None:
            held.append(message)

        await self.app(scope, receive, later)
        await asyncio.sleep(self.delay)
        for m in held:
            await send(m)


class Recorder:
    """A local webhook receiver: keeps every JSON body POSTed to it (PagerDuty/Slack stand-in)."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with rec.lock:
                    rec.bodies.append(json.loads(raw))
                    rec.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self) -> list[tuple[str, str, dict]]:
        """(status, alertname, labels) of every alert received, in order; the periodic re-sends
        of a firing alert (``repeat``: keeping it alive at a receiver that honours endsAt) left out."""
        with self.lock:
            return [
                (a["status"], a["labels"]["alertname"], a["labels"])
                for b in self.bodies
                for a in b["alerts"]
                if not a.get("repeat")
            ]


def serve_process(config: Any, port: int, log: Any) -> subprocess.Popen:
    """``trainvitals serve --config CONFIG --port PORT`` in a process of its own, once ready
    (output to ``log``)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from trainvitals.monitor.cli import main; main()",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, "the collector exited"
        try:
            return httpx.get(url + "/readyz").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 60, "collector ready")
    return proc
