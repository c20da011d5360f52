"""The client against a hung, refusing or slow collector (real ones, with a fault layer in
front where the fault is the collector's answer), and a notifier URL with a token in its
path: close is bounded by flush_timeout once, the drops counted at close reach the
collector, reports the collector applied are not counted as dropped, and the token never
reaches a log line."""

from __future__ import annotations

import gzip
import logging
import socket
import threading
import time

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.monitor.helpers import AnswerLate, Recorder, body, report
from tests.support import wait_until
from trainvitals.hooks.pack import pack
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.sinks import HttpSink
from trainvitals.hooks.step import StepContext
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings

JSON = {"Content-Type": "application/json"}


def _packed(step: int, run: str):
    ctx = StepContext(step=step, device=torch.device("cpu"))
    ctx.emit("loss", torch.tensor(2.0))
    return pack(ctx, run=run, rank=0)


def _dropped_at_collector(url: str, run: str) -> float | None:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "trainvitals_client_dropped_reports_total" and s.labels.get("run") == run:
                return s.value
    return None


def test_close_against_a_hung_collector_waits_flush_timeout_once():
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # accepts, never answers
    try:
        sink = HttpSink(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout=30.0)
        sender = Sender(sink, backoff=(0.05, 0.5))
        for step in range(1, 6):
            sender.put(_packed(step, "hung"))
        wait_until(lambda: sender._in_flight, 60, "a delivery in flight")
        started = time.monotonic()
        sender.close(6.0)
        took = time.monotonic() - started
        # What close() counted, read before the socket closes: closing it resets the
        # request still in flight, and the sender thread then settles it as not delivered.
        dropped, unconfirmed = sender.dropped, sender.unconfirmed
    finally:
        hung.close()
    # Once: not a flush of 6 s and then a join of 6 s more (the request's own timeout is 30 s).
    # The bound is the semantics (one deadline, not two: 12 s), with 4 s left for a loaded machine.
    assert took < 10.0, took
    assert dropped + unconfirmed == 5 and unconfirmed >= 1


class _RefuseSteps:
    """In front of a real collector: every body with a step report gets 503 (the collector
    is full); a body carrying only the drop count passes."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/reports":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        if b'"loss"' in text:
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        replayed = False

        async def again():
            nonlocal replayed
            if replayed:
                return {"type": "http.disconnect"}
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, again, send)


def test_drops_counted_at_close_reach_the_collector():
    app = create_app(Settings(state_path=None))
    with serve_in_thread(_RefuseSteps(app), settings=app.state.settings) as url:
        assert httpx.post(url + "/v1/reports", content=body(report("full")), headers=JSON).status_code == 503
        sender = Sender(HttpSink(url), backoff=(0.05, 0.2))
        for step in range(1, 11):
            sender.put(_packed(step, "full"))
        left = sender.close(1.5)
        at_collector = wait_until(lambda: _dropped_at_collector(url, "full"), 60, "the drop count")
    assert left == 10 and sender.dropped == 10
    assert at_collector == 10


def test_reports_the_collector_applied_are_not_counted_as_dropped():
    app = create_app(Settings(state_path=None))
    with serve_in_thread(AnswerLate(app, 2.0), settings=app.state.settings) as url:
        sender = Sender(HttpSink(url, timeout=0.3, max_timeout=0.3), backoff=(0.05, 0.1))
        for step in range(1, 21):
            sender.put(_packed(step, "late"))
            time.sleep(0.02)
        sender.close(1.0)
        time.sleep(2.5)  # the late answers land; nothing more is applied
        applied = app.state.reports.values()["accepted"]
    assert applied >= 1
    assert sender.dropped + applied <= 20, (sender.dropped, applied)  # none counted twice
    assert sender.dropped + sender.unconfirmed + applied >= 20  # every report accounted for


def test_a_token_in_a_notifier_urls_path_never_reaches_the_log(caplog):
    caplog.set_level(logging.DEBUG)
    token = "T0KEN-in-the-path-9f8e7d"
    with Recorder() as hook:
        notifier = {"type": "webhook", "url": f"{hook.url}/hooks/{token}"}
        settings = Settings(state_path=None, notifiers=[notifier], alerts={"tick_interval": 0.1})
        with serve_in_thread(create_app(settings)) as url, httpx.Client(base_url=url) as c:
            event = {"kind": "optimizer_state_reset", "detail": "page me"}
            assert c.post("/v1/reports", content=body(report("secret", 1, events=[event])), headers=JSON).is_success
            wait_until(lambda: hook.alerts(), 60, "the page")
    assert hook.paths == [f"/hooks/{token}"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("HTTP Request: POST" in line for line in lines), lines
    assert not [line for line in lines if token in line]


def test_close_of_a_healthy_sender_is_quick_and_counts_nothing():
    app = create_app(Settings(state_path=None))
    with serve_in_thread(app) as url:
        sender = Sender(HttpSink(url))
        for step in range(1, 6):
            sender.put(_packed(step, "fine"))
        done = threading.Event()
        threading.Thread(target=lambda: (sender.close(5.0), done.set()), daemon=True).start()
        assert done.wait(10)
    assert (sender.dropped, sender.unconfirmed, sender.sent) == (0, 0, 5)
