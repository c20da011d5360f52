"""Debian's headless chromium, driven over the DevTools protocol through a pipe
(``--remote-debugging-pipe``: NUL-terminated JSON messages on file descriptors 3 and
4; no websocket, no driver to install).

:class:`Browser` opens a page in a fresh tab and records every request that page
makes (``Network.requestWillBeSent`` of its own session: chromium's own background
traffic, which has no page, is not in it), answers HTTP Basic challenges with the
credentials it was given (``Fetch.authRequired``), evaluates JavaScript in the page
and takes screenshots. Tests that need it are marked ``needs_tools("chromium")``
(``tests.support``): they skip where it is not installed.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import require_tool

_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


class Browser:
    """One chromium process; :meth:`open` a page, then read it."""

    def __init__(self, proc: subprocess.Popen[bytes], to_browser: int, from_browser: int) -> None:
        self._proc = proc
        self._out = os.fdopen(to_browser, "wb", buffering=0)
        self._in = os.fdopen(from_browser, "rb", buffering=0)
        self._buf = b""
        self._id = 0
        self._events: list[dict[str, Any]] = []
        self.session: str | None = None
        self.requests: list[str] = []
        self.credentials: tuple[str, str] | None = None
        self.console: list[str] = []

    # -- protocol ------------------------------------------------------------------------
    def _read(self, timeout: float) -> dict[str, Any]:
        import select

        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = self._in.read(1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its pipe")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True, timeout: float = 30):
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        self._out.write(json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._event(reply)

    def _event(self, msg: dict[str, Any]) -> None:
        method = msg.get("method")
        if method is None or msg.get("sessionId") != self.session:
            return
        params = msg.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Fetch.requestPaused":
            self._queue(("Fetch.continueRequest", {"requestId": params["requestId"]}))
        elif method == "Fetch.authRequired":
            user, password = self.credentials or ("", "")
            response = {"response": "ProvideCredentials", "username": user, "password": password}
            if self.credentials is None:
                response = {"response": "CancelAuth"}
            self._queue(
                ("Fetch.continueWithAuth", {"requestId": params["requestId"], "authChallengeResponse": response})
            )
        elif method == "Runtime.consoleAPICalled":
            self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            self.console.append("exception: " + json.dumps(params["exceptionDetails"])[:500])
        self._events.append(msg)

    def _queue(self, call: tuple[str, dict[str, Any]]) -> None:
        # Answered at once (the page waits on it); replies are read by the next send.
        self._id += 1
        msg = {"id": self._id, "method": call[0], "params": call[1], "sessionId": self.session}
        self._out.write(json.dumps(msg).encode() + b"\0")

    def pump(self, seconds: float) -> None:
        """Handle events for ``seconds`` (the page runs its timers meanwhile)."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                msg = self._read(left)
            except TimeoutError:
                return
            self._event(msg)

    # -- pages ---------------------------------------------------------------------------
    def open(self, url: str, *, width: int = 1280, height: int = 1400, settle: float = 1.0) -> None:
        """Open ``url`` in a new tab and wait for its load event (then ``settle`` seconds)."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)[
            "sessionId"
        ]
        self.requests = []
        self._events = []  # the load event of this tab, not of one opened before
        self.send("Network.enable")
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Fetch.enable", {"handleAuthRequests": True, "patterns": [{"urlPattern": "*"}]})
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + 30
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load")
            self._event(self._read(deadline - time.monotonic()))
        self.pump(settle)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        height = self.evaluate("document.documentElement.scrollHeight")
        shot = self.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": 1280, "height": height, "scale": 1},
            },
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=5)
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._out.close()
        self._in.close()


@contextmanager
def browser() -> Iterator[Browser]:
    """A headless chromium with a throw-away profile (skips the test where chromium is
    not installed)."""
    chromium = require_tool("chromium")
    profile = tempfile.mkdtemp(prefix="tv-chromium-")
    to_r, to_w = os.pipe()  # we write, chromium reads on fd 3
    from_r, from_w = os.pipe()  # chromium writes on fd 4, we read

    def fds() -> None:  # in the child: our pipe ends as fds 3 and 4, whatever numbers they had
        high_r, high_w = os.dup(to_r), os.dup(from_w)
        os.dup2(high_r, 3)
        os.dup2(high_w, 4)

    proc = subprocess.Popen(
        [chromium, *_FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=fds,
        pass_fds=(3, 4),  # kept open past the preexec_fn
    )
    os.close(to_r)
    os.close(from_w)
    b = Browser(proc, to_w, from_r)
    try:
        yield b
    finally:
        b.close()
        shutil.rmtree(profile, ignore_errors=True)
