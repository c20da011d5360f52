"""Issue items 4-5: idempotent ingest, a slow collector, and a SIGKILL + restart of
``trainvitals serve`` with its SQLite state (a recording webhook sees the sequence)."""

from __future__ import annotations

import os
import signal
import sqlite3
import time

import httpx
import pytest
import torch

from tests.monitor.helpers import AnswerLate, Recorder, body, report, serve_process
from tests.support import free_port, wait_until
from trainvitals.hooks.pack import pack
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.sinks import HttpSink
from trainvitals.hooks.step import StepContext
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings, SettingsError

JSON = {"Content-Type": "application/json"}

RULES = """\
- alert: LossHigh
  metric: modality_loss
  above: 10
  clear: 5
  severity: page
  summary: "loss {value:.0f} on {modality} in {run}"
"""


def test_a_retried_body_is_applied_once_and_the_answer_names_the_duplicates():
    event = {"kind": "optimizer_state_reset", "detail": "test"}
    one = report("idem", 5, events=[event], sender="s1", seq=7)
    with serve_in_thread(create_app(Settings(state_path=None))) as url, httpx.Client(base_url=url) as c:
        first = c.post("/v1/reports", content=body(one), headers=JSON).json()
        again = c.post("/v1/reports", content=body(one, {**one, "seq": 8}), headers=JSON).json()
        [alert] = [a for a in c.get("/v1/alerts").json() if a["alertname"] == "OptimizerStateReset"]
        text = c.get("/metrics").text
    assert first == {"accepted": 1, "duplicates": []}
    assert again == {"accepted": 1, "duplicates": [0]}
    assert alert["value"] == 2  # seq 7 once, seq 8 once: not three events
    assert 'trainvitals_collector_reports_total{outcome="duplicate"} 1.0' in text


def test_a_collector_answering_at_the_clients_timeout_still_receives_every_report_once():
    """A collector that answers only after the client's timeout (5 s by default; 0.5 s
    here, the answer as late, with the default ratio to the largest timeout): the client
    used to time out for ever, resending growing batches."""
    app = create_app(Settings(state_path=None))
    with serve_in_thread(AnswerLate(app, 0.5), settings=app.state.settings) as url:
        sender = Sender(HttpSink(url, timeout=0.5, max_timeout=12.0), backoff=(0.05, 0.5))
        for step in range(1, 41):
            sender.put(pack(StepContext(step=step, device=torch.device("cpu")), run="slow", rank=0))
            time.sleep(0.05)
        assert sender.flush(90), "not everything delivered within 90 s"
        sender.close(1)
        counts = app.state.reports.values()
    assert sender.dropped == 0 and sender.sent == 40
    assert counts["accepted"] == 40  # each report applied once, retries recognised
    assert app.state.store.runs()[0].step == 40


def _delivered(path) -> int:
    """Deliveries the collector's state file records (read beside the running collector)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT count(*) FROM notified WHERE status = 'firing'").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0
    finally:
        db.close()


def test_sigkill_and_restart_resolve_a_cleared_alert_once_and_do_not_repage(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    with Recorder() as hook:
        config = tmp_path / "collector.yaml"
        config.write_text(
            f"state_path: {tmp_path / 'state.sqlite3'}\nrules: [{rules}]\n"
            f"notifiers: [{{type: webhook, url: '{hook.url}'}}]\n"
            "alerts: {tick_interval: 0.2}\n"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"

        def send(step: int, image: float, text: float) -> None:
            samples = [
                {"name": "modality_loss", "labels": {"modality": "image"}, "value": image},
                {"name": "modality_loss", "labels": {"modality": "text"}, "value": text},
            ]
            r = httpx.post(url + "/v1/reports", content=body(report("job", step, samples)), headers=JSON)
            assert r.status_code == 202, r.text

        with open(tmp_path / "serve.log", "wb") as log:
            proc = serve_process(config, port, log)
            send(1, 50.0, 40.0)
            wait_until(lambda: len(hook.alerts()) == 2, 60, "two pages")
            # ... and their delivery recorded (a kill between the two pages it again: at least once).
            wait_until(lambda: _delivered(tmp_path / "state.sqlite3") == 2, 60, "the deliveries recorded")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            proc = serve_process(config, port, log)
            try:
                send(2, 1.0, 45.0)  # image cleared, text still high
                wait_until(lambda: len(hook.alerts()) == 3, 60, "the resolve")
                time.sleep(2)  # ten ticks: anything else owed would have gone out
                alerts = httpx.get(url + "/v1/alerts").json()
            finally:
                proc.terminate()
                proc.wait(10)
    got = [(status, labels["modality"]) for status, _, labels in hook.alerts()]
    assert sorted(got[:2]) == [("firing", "image"), ("firing", "text")]
    assert got[2:] == [("resolved", "image")]
    [resolved] = [a for b in hook.bodies for a in b["alerts"] if a["status"] == "resolved"]
    summary = resolved["annotations"]["summary"]
    assert summary.startswith("Resolved: LossHigh in run job (modality=image) at step 2: modality_loss is back to 1")
    assert summary.endswith("it fired at 50")  # the value it fired with
    assert resolved["annotations"]["description"] == "While it fired: loss 50 on image in job"
    assert {(a["labels"]["modality"], a["state"]) for a in alerts} == {("image", "resolved"), ("text", "firing")}


def test_a_run_silent_across_a_restart_gets_run_silent(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- alert: RunSilent\n  silent_for: 1s\n  severity: warning\n  summary: '{run}'\n")
    settings = Settings(state_path=tmp_path / "s.sqlite3", rules=[str(rules)], alerts={"tick_interval": 0.1})
    app = create_app(settings)
    with serve_in_thread(app) as url:
        httpx.post(url + "/v1/reports", content=body(report("died", 9)), headers=JSON)
        ended = report("done", 9, events=[{"kind": "run_end"}])
        httpx.post(url + "/v1/reports", content=body(ended), headers=JSON)
    app = create_app(settings)
    with serve_in_thread(app) as url:
        runs = {r["run"]: r for r in httpx.get(url + "/v1/runs").json()}
        firing = wait_until(
            lambda: [a for a in httpx.get(url + "/v1/alerts").json() if a["state"] == "firing"], 60, "RunSilent"
        )
    assert runs["died"]["step"] == 9 and runs["done"]["ended"] is True
    assert [(a["alertname"], a["labels"]["run"]) for a in firing] == [("RunSilent", "died")]


def test_a_retry_straddling_a_restart_is_applied_once(tmp_path):
    """The answer to seq 41 is lost, the collector is killed and restarted, the client
    retries: the kept duplicate memory recognises it. In memory only it is applied twice."""
    event = {"kind": "optimizer_state_reset", "detail": "retried"}
    one = report("straddle", 5, events=[event], sender="s1", seq=41)
    answers = {}
    for state in ("file", "memory"):
        config = tmp_path / f"{state}.yaml"
        config.write_text(f"state_path: {tmp_path / 'state.sqlite3' if state == 'file' else 'memory'}\n")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(tmp_path / f"{state}.log", "wb") as log:
            proc = serve_process(config, port, log)
            first = httpx.post(url + "/v1/reports", content=body(one), headers=JSON).json()
            assert first == {"accepted": 1, "duplicates": []}
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            proc = serve_process(config, port, log)
            try:
                again = httpx.post(url + "/v1/reports", content=body(one, {**one, "seq": 42}), headers=JSON)
                text = httpx.get(url + "/metrics").text
            finally:
                proc.terminate()
                proc.wait(10)
        answers[state] = (again.json(), 'trainvitals_collector_reports_total{outcome="duplicate"} 1.0' in text)
    assert answers["file"] == ({"accepted": 1, "duplicates": [0]}, True)
    assert answers["memory"] == ({"accepted": 2, "duplicates": []}, False)


def test_two_collectors_cannot_share_a_state_file(tmp_path):
    settings = Settings(state_path=tmp_path / "state.sqlite3")
    first = create_app(settings)
    with pytest.raises(SettingsError) as refused:
        create_app(settings)
    assert (
        f"state_path '{tmp_path / 'state.sqlite3'}' is in use by another running collector (pid "
        f"{os.getpid()})" in str(refused.value)
    )
    first.state.state_db.close()
    create_app(settings).state.state_db.close()  # free again once the first one closed it
