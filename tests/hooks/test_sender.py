"""The sender and the HTTP sink against local servers: retry, refusal, a dead collector,\nthe byte bound."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

import pytest
import torch
from torch import nn

from tests.http_recorder import RecordingServer
from tests.support import dead_url
from trainvitals.hooks import attach
from trainvitals.hooks.pack import PendingReport, pack
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.sinks import HttpSink
from trainvitals.hooks.step import StepContext


def collector_stub(*statuses: int) -> RecordingServer:
    """A stand-in collector: answers ``statuses`` in order, the last one from then on,
    each with a JSON detail as the collector's refusals carry."""
    *first, last = statuses
    return RecordingServer(
        first, default=last, body=b'{"detail": "scripted"}', headers={"Content-Type": "application/json"}
    )


def accepted_bodies(rec: RecordingServer) -> list[dict]:
    """The bodies the stub answered with a 2xx."""
    return [r.json() for r in rec.received() if r.answered is not None and r.answered < 300]


def accepted_reports(rec: RecordingServer) -> list[dict]:
    return [r for b in accepted_bodies(rec) for r in b["reports"]]


def packed(step: int, pad: int = 0) -> PendingReport:
    """A packed report of ``step`` (an event's detail pads it by ``pad`` bytes)."""
    ctx = StepContext(step=step, device=torch.device("cpu"))
    if pad:
        ctx.event("weight_decay_audit", "x" * pad)
    return pack(ctx, run="r", rank=0)


def test_retries_transient_failures_and_delivers_once():
    with collector_stub(503, 429, 202) as rec:
        sender = Sender(HttpSink(rec.url), backoff=(0.01, 0.05))
        sender.put(packed(1))
        assert sender.flush(60)
        sender.close(1)
    assert [r["step"] for r in accepted_reports(rec)] == [1]
    assert rec.count() == 3 and sender.dropped == 0


def test_a_refused_batch_is_dropped_counted_and_logged(caplog):
    with collector_stub(422, 202) as rec:
        sender = Sender(HttpSink(rec.url), backoff=(0.01, 0.05))
        sender.put(packed(1))
        assert sender.flush(60)
        sender.put(packed(2))
        assert sender.flush(60)
        sender.close(1)
    assert [r["step"] for r in accepted_reports(rec)] == [2]
    assert sender.dropped == 1
    assert accepted_reports(rec)[0]["samples"][-1] == {
        "name": "client_dropped_reports_total",
        "labels": {},
        "value": 1.0,
    }
    assert any("refused" in r.getMessage() and "422" in r.getMessage() for r in caplog.records)


def test_batches_are_gzipped_and_carry_the_token():
    with collector_stub(202) as rec:
        sender = Sender(HttpSink(rec.url, token="s3cret", gzip_min_bytes=10))
        for i in range(5):
            sender.put(packed(i))
        assert sender.flush(60)
        sender.close(1)
    assert sorted(r["step"] for r in accepted_reports(rec)) == list(range(5))
    assert all(
        r.headers["Content-Encoding"] == "gzip" and r.headers["Authorization"] == "Bearer s3cret"
        for r in rec.received()
    )
    assert all(b["schema"] == 1 for b in accepted_bodies(rec))


def test_queue_is_bounded_in_bytes_and_drops_the_oldest():
    # A backoff of a minute: a close() that waited for the next retry would take 30 s or
    # more, a close() that keeps its 0.5 s deadline well under the bound of 20 s, so a
    # loaded machine cannot blur the two.
    sender = Sender(HttpSink(dead_url()), max_queue_bytes=10_000, backoff=(60, 60))
    for i in range(50):
        sender.put(packed(i, pad=900))
    assert not sender.flush(1.0)
    assert sender._outbox_bytes <= 10_000
    assert sender.dropped >= 40
    t0 = time.monotonic()
    sender.close(0.5)
    assert time.monotonic() - t0 < 20
    assert sender.dropped == 50  # every report not delivered is counted, at close too


def test_training_survives_a_dead_collector(caplog, capsys):
    caplog.set_level(logging.INFO, logger="trainvitals")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = attach(model, opt, run="down", collector=dead_url(), every=1, flush_timeout=0.5)
    for _ in range(5):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert mon.step == 5
    assert mon.value("grad_norm") > 0
    t0 = time.monotonic()
    mon.close()
    # flush_timeout 0.5 s, never the retries' backoff (up to 30 s): the bound is that
    # semantics, with room for a loaded machine.
    assert time.monotonic() - t0 < 15
    assert mon.dropped_reports >= 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # Once when the collector is found unreachable; at close, where the reports it never
    # took are kept, and how many were not delivered and where they were going.
    assert len(warnings) == 3 and "unreachable" in warnings[0]
    assert "never took are in trainvitals-down.jsonl" in warnings[1], warnings[1]
    url = mon._sender.sink.url
    assert f"{mon.dropped_reports} not delivered" in warnings[2] and url in warnings[2], warnings[2]
    assert "unreachable" in warnings[2]
    assert all(r.exc_info is None for r in caplog.records)


@pytest.mark.parametrize("statuses", [[202], [500, 202]], ids=["ok", "retry"])
def test_monitor_streams_to_http(statuses):
    with collector_stub(*statuses) as rec:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with attach(model, opt, run="http", collector=rec.url, every=2) as mon:
            mon._sender.backoff = (0.01, 0.05)
            for _ in range(4):
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        assert [r["step"] for r in accepted_reports(rec)] == [1, 2, 4, 4]
        assert accepted_reports(rec)[-1]["events"][0]["kind"] == "run_end"
        names = {s["name"] for s in accepted_reports(rec)[-2]["samples"]}
        assert {"grad_norm", "client_dropped_reports_total"} <= names


def test_attach_queue_bytes_bounds_the_http_queue():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, opt, run="q", collector=dead_url(), queue_bytes=12345, flush_timeout=0.1) as mon:
        assert mon._sender.max_queue_bytes == 12345


class _BlockedSink:
    """A sink whose delivery blocks until released (a collector that never answers)."""

    max_batch_bytes = 1 << 62

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def deliver(self, batch: list[bytes]) -> str:
        self.entered.set()
        self.release.wait(30)
        return "sent"

    def close(self) -> None:
        self.release.set()


def test_no_packed_report_is_held_while_a_delivery_blocks():
    # A delivery can block past the interpreter's exit (a hung collector, close gave up):
    # a torch tensor the daemon thread still held would then be freed while the
    # interpreter is finalizing, which aborts the process. Encoded reports are bytes.
    sink = _BlockedSink()
    sender = Sender(sink)
    try:
        report = packed(1)
        host = weakref.ref(report.host)
        sender.put(report)
        del report
        assert sink.entered.wait(10)
        gc.collect()
        assert host() is None
    finally:
        sink.release.set()
        sender.close(5)
    assert sender.sent == 1 and sender.dropped == 0
