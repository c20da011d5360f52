"""Notification floods, on a real collector with a recording webhook: one rule on an
event's free label is bounded per run (counted and said once), and a run that floods
the shared notification queue cannot drop another run's page."""

from __future__ import annotations

import logging
import threading

import httpx

from tests.monitor.helpers import Recorder, body, report
from tests.support import wait_until
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings

JSON = {"Content-Type": "application/json"}


# An event rule keyed on the event's free label (its value comes from the job).
RULES = """\
- alert: UnlabelledModality
  event: modality_without_label_tokens
  hold_steps: 1000
  severity: warning
  summary: "{modality} has no label tokens in run {run}"
"""


def _events(n: int, start: int = 0) -> list[dict]:
    return [{"kind": "modality_without_label_tokens", "labels": {"modality": f"m{i}"}} for i in range(start, start + n)]


def _rules(tmp_path) -> list[str]:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return [str(path), "default"]


def test_one_rule_on_a_free_label_opens_a_bounded_number_of_alerts_per_run(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainvitals.alerts")
    with Recorder() as hook:
        settings = Settings(
            state_path=None,
            rules=_rules(tmp_path),
            notifiers=[{"type": "webhook", "url": hook.url}],
            alerts={"max_alerts_per_rule": 5, "tick_interval": 0.1},
        )
        with serve_in_thread(create_app(settings)) as url, httpx.Client(base_url=url) as c:
            for step in range(1, 41):  # 2,000 label values in one run (64 events at most per report)
                noisy = report("noisy", step, events=_events(50, step * 50), sender="n", seq=step)
                assert c.post("/v1/reports", content=body(noisy), headers=JSON).status_code == 202
            other = report("other", 1, events=_events(3), sender="o", seq=1)
            assert c.post("/v1/reports", content=body(other), headers=JSON).status_code == 202
            wait_until(lambda: len(hook.alerts()) >= 8, 60, "the bounded pages")
            alerts = c.get("/v1/alerts").json()
            metrics = c.get("/metrics").text
    per_run = {}
    for a in alerts:
        per_run[a["labels"]["run"]] = per_run.get(a["labels"]["run"], 0) + 1
    assert per_run == {"noisy": 5, "other": 3}
    pages = [labels["run"] for status, _, labels in hook.alerts() if status == "firing"]
    assert sorted(pages) == ["noisy"] * 5 + ["other"] * 3
    assert 'trainvitals_alerts_suppressed_total{alertname="UnlabelledModality"} 1995.0' in metrics
    said = [r.getMessage() for r in caplog.records if "max_alerts_per_rule" in r.getMessage()]
    assert len(said) == 1 and "'noisy'" in said[0], said
    firing_lines = [r for r in caplog.records if r.getMessage().startswith("alert UnlabelledModality firing")]
    assert len(firing_lines) == 8  # not one INFO line per label value


class _GatedRecorder(Recorder):
    """A webhook receiver that holds each request until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.waiting = threading.Event()
        handler = self.server.RequestHandlerClass
        gate, waiting = self.gate, self.waiting
        plain = handler.do_POST

        def do_post(h) -> None:
            waiting.set()
            gate.wait(30)
            plain(h)

        handler.do_POST = do_post  # type: ignore[method-assign]


def test_a_run_flooding_the_queue_cannot_drop_another_runs_page(tmp_path):
    with _GatedRecorder() as hook:
        options = {"queue_size": 4, "max_alerts_per_rule": 100}
        settings = Settings(
            state_path=None, rules=_rules(tmp_path), notifiers=[{"type": "webhook", "url": hook.url}], alerts=options
        )
        with serve_in_thread(create_app(settings)) as url, httpx.Client(base_url=url) as c:
            first = report("noisy", 1, events=_events(1), sender="n", seq=1)
            assert c.post("/v1/reports", content=body(first), headers=JSON).status_code == 202
            assert hook.waiting.wait(60)  # that page is in flight, held: the queue fills behind it
            flood = report("noisy", 2, events=_events(30, 1), sender="n", seq=2)
            assert c.post("/v1/reports", content=body(flood), headers=JSON).status_code == 202
            quiet = report("quiet", 1, events=[{"kind": "optimizer_state_reset", "detail": "once"}])
            assert c.post("/v1/reports", content=body(quiet), headers=JSON).status_code == 202
            hook.gate.set()
            wait_until(lambda: any(labels["run"] == "quiet" for _, _, labels in hook.alerts()), 60, "quiet's page")
            metrics = c.get("/metrics").text
    runs = [labels["run"] for _, _, labels in hook.alerts()]
    assert runs.count("quiet") == 1
    assert runs.count("noisy") == 1 + 4 - 1  # in flight, then the queue less the one quiet evicted
    dropped = 30 - 4 + 1  # the flood past the queue, and the one quiet's page evicted
    assert f'trainvitals_notifications_total{{notifier="webhook",outcome="dropped"}} {dropped}.0' in metrics
