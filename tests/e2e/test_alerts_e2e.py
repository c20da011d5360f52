"""The default alert rules end to end: real tiny training jobs on the CPU stream
through ``attach(..., every=1)`` to a real collector (uvicorn on port 0), which
evaluates the rules as reports arrive; ``GET /v1/alerts`` shows what fired.

- Every default rule fires on its incident's reproduction with the right labels,
  and nothing fires on the healthy twin (the same job with the fix).
- A healthy run with every signal on fires nothing, ever.
- A real Alertmanager gets the collector's alert and its resolution and delivers
  both to a webhook receiver.
- Notifiers: a failing receiver gets the alert once after a retry; a hanging one
  does not slow ingestion, and the failure is counted in /metrics.

The jobs are in ``_jobs.py`` (what each makes the signals read); the collector,
Alertmanager and the recording receiver come from ``tests.support`` and
``tests.http_recorder``.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e._jobs import (
    AccumulationJob,
    BlindLossJob,
    ClippedSpikeJob,
    DeclaredSampleJob,
    DeclaredTokenJob,
    DilutionJob,
    DistillationMixtureJob,
    DistillJob,
    DoubleDivisionJob,
    DriftJob,
    HealthyJob,
    Job,
    MeanOfMeansJob,
    NonFiniteLossJob,
    PackedLeakJob,
    SpikeJob,
    SqrtDilutionJob,
    StateResetJob,
    run_job,
)
from tests.http_recorder import RecordingServer
from tests.reports import make_body, make_report
from tests.support import (
    Collector,
    metric_series,
    metric_value,
    needs_tools,
    running_alertmanager,
    running_collector,
    wait_until,
)
from trainvitals.alerts.dispatch import RetryPolicy
from trainvitals.alerts.loading import default_rule_paths, load_rules

DEFAULT_RULES = {r.alert: r for r in reversed(load_rules("default"))}  # a name's first variant
# An alert split into variants by severity (LossNotAccumNormalized: page for SGD-like
# optimizers, warning for Adam-like ones) has one severity per variant.
SEVERITIES: dict[str, set[str]] = {}
for _rule in load_rules("default"):
    SEVERITIES.setdefault(_rule.alert, set()).add(_rule.severity)


# -- 1. every default rule: its incident fires it, the fix does not -------------------------
@dataclass(frozen=True)
class Case:
    """One default rule and the job that reproduces its incident."""

    id: str
    alert: str
    job: Callable[..., Job]  # job(fixed=...) -> the bug, or its healthy twin
    steps: int  # optimizer steps: enough to fire (reported every step) with a margin
    labels: dict[str, str]  # the alert's labels besides `run`
    value: float | None = None  # the alert's value at the end, when it is fixed by the job
    truth: Callable[[Any], float | None] | None = None  # or measured by the bug's job, after it ran
    also: frozenset[str] = field(default_factory=frozenset)  # other alerts the incident fires
    quiet: tuple[dict[str, str], ...] = ()  # other series of the rule's metric, reported, not firing

    def __post_init__(self) -> None:
        assert self.alert in DEFAULT_RULES, f"{self.alert} is not a default rule"


DRIFT_BY_WEIGHT_DECAY = functools.partial(DriftJob, fix="weight-decay")

# Steps: the jobs are seeded, so the step an alert fires at is fixed; each job runs a
# few steps more. for_steps 20 with a report every step: pending at step 1, firing at
# 21; for_steps 50: firing at 51. ParamDrift first needs 1 bit of drift (step 16).
# The I4 model's norm weight and head bias get no weight decay either, but have a real
# gradient: they must stay quiet.
DRIFT_QUIET = ({"param": "head.bias"}, {"param": "norm.weight"})
CASES = [
    Case("I1-GradientDilution", "GradientDilution", DilutionJob, 24, {"modality": "image"}, value=0.16 / (8 / 848)),
    Case(
        "I1-declared-sample-GradientDilution",
        "GradientDilution",
        DeclaredSampleJob,
        24,
        {"modality": "image"},
        value=0.16 / (8 / 848),
    ),
    Case(
        "I1-sqrt-deliberate-LossNormalizationDilutes",
        "LossNormalizationDilutes",
        SqrtDilutionJob,
        24,
        {"modality": "image"},
        value=0.16 / SqrtDilutionJob.SHARE,
    ),
    Case(
        "I1-declared-token-LossNormalizationDilutes",
        "LossNormalizationDilutes",
        DeclaredTokenJob,
        24,
        {"modality": "image"},
        value=0.16 / (8 / 848),
    ),
    Case("I2-LossNotAccumNormalized", "LossNotAccumNormalized", AccumulationJob, 24, {"objective": "main"}, value=4.0),
    Case(
        "I2-mixture-LossNotAccumNormalized",
        "LossNotAccumNormalized",
        DistillationMixtureJob,
        24,
        {"objective": "kd"},
        value=4.0,
    ),
    Case("I2-LossWeightMassLow", "LossWeightMassLow", DoubleDivisionJob, 54, {"objective": "main"}, value=0.25),
    Case("I3-MeanOfMeansLoss", "MeanOfMeansLoss", MeanOfMeansJob, 54, {"objective": "main"}, value=3.0),
    Case(
        "I4-ParamDrift-fix-zero-grad",
        "ParamDrift",
        DriftJob,
        56,
        {"param": "scale"},
        also=frozenset({"AdamEpsilonDominated"}),
        quiet=DRIFT_QUIET,
    ),
    Case(
        "I4-ParamDrift-fix-weight-decay",
        "ParamDrift",
        DRIFT_BY_WEIGHT_DECAY,
        56,
        {"param": "scale"},
        also=frozenset({"AdamEpsilonDominated"}),
        quiet=DRIFT_QUIET,
    ),
    Case(
        "I4-AdamEpsilonDominated-fix-zero-grad",
        "AdamEpsilonDominated",
        DriftJob,
        56,
        {"param": "scale"},
        value=1.0,
        also=frozenset({"ParamDrift"}),
        quiet=DRIFT_QUIET,
    ),
    Case(
        "I4-AdamEpsilonDominated-fix-weight-decay",
        "AdamEpsilonDominated",
        DRIFT_BY_WEIGHT_DECAY,
        56,
        {"param": "scale"},
        value=1.0,
        also=frozenset({"ParamDrift"}),
        quiet=DRIFT_QUIET,
    ),
    Case("I4-OptimizerStateReset", "OptimizerStateReset", StateResetJob, 12, {}, value=1.0),
    Case(
        "I5-SoftmaxSaturation",
        "SoftmaxSaturation",
        DistillJob,
        54,
        {"task": "ie", "role": "teacher", "threshold": "0.99"},
    ),
    Case("NonFiniteLoss", "NonFiniteLoss", NonFiniteLossJob, 10, {"what": "loss"}),
    # SignalInactive: for_steps 20, the loss figures withheld from the first report on.
    Case("SignalInactive", "SignalInactive", BlindLossJob, 26, {"signal": "loss", "reason": "not_cross_entropy"}),
    Case("GradNormSpike", "GradNormSpike", SpikeJob, 30, {}),
    Case("GradNormSpike-clipped-between-reports", "GradNormSpike", ClippedSpikeJob, 30, {}),
    # No for_steps: the probe's first report step (step 1) fires it.
    Case(
        "PackedSamplesLeak",
        "PackedSamplesLeak",
        PackedLeakJob,
        3,
        {"cause": "mask_beside_positions"},
        truth=lambda job: job.leak,
    ),
]


def test_every_default_rule_has_a_case():
    # RunSilent has a test of its own below.
    assert set(DEFAULT_RULES) - {c.alert for c in CASES} == {"RunSilent"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_default_rule_fires_on_its_incident_and_not_on_the_fix(case: Case):
    bug, fix = f"{case.id}-bug".lower(), f"{case.id}-fix".lower()
    with running_collector() as collector:
        job = case.job(fixed=False)
        last = run_job(job, collector.url, bug, case.steps)
        # run_job closes the monitor: the run's end resolves what fired, saying so.
        alert = collector.wait_for(case.alert, bug, state="resolved")
        assert alert["resolved_reason"] == f"run {bug} ended at step {case.steps}"
        assert alert["labels"] == {"run": bug, **case.labels}
        assert alert["severity"] in SEVERITIES[case.alert]
        assert alert["fired_at"] is not None and alert["summary"].startswith(f"Resolved: {case.alert} in run {bug}")
        if case.value is not None:
            assert alert["value"] == pytest.approx(case.value, rel=1e-3)
        if case.truth is not None:
            truth = case.truth(job)
            assert truth is not None and alert["value"] == pytest.approx(truth, rel=1e-3)
        fired = [a for a in collector.alerts(bug) if a["fired_at"] is not None]
        assert {a["alertname"] for a in fired} == {case.alert, *case.also}, fired
        assert [a["labels"] for a in fired if a["alertname"] == case.alert] == [alert["labels"]]
        for labels in case.quiet:  # reported, so evaluated, and not firing (above)
            metric = DEFAULT_RULES[case.alert].metric
            assert any(s["name"] == metric and s["labels"] == labels for s in last), (metric, labels)

        run_job(case.job(fixed=True), collector.url, fix, case.steps)
        # run_job delivered every report, and the collector evaluates a report before it
        # answers 202: what the fix could fire has fired by now.
        (run,) = [r for r in collector.client.get("/v1/runs").json() if r["run"] == fix]
        assert run["step"] == case.steps
        assert [a for a in collector.alerts(fix) if a["alertname"] == case.alert] == []
        assert collector.firing(fix) == []


def _short_silence_rules(folder: Path, silent_for: str = "2s") -> Path:
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


def test_run_silent_fires_for_a_run_that_stops_reporting_not_for_one_that_closed(tmp_path):
    rules = _short_silence_rules(tmp_path / "rules", "2s")
    with running_collector(rules=str(rules), alerts={"tick_interval": 0.2}) as collector:
        # Closes its monitor (a run_end report): finished on purpose.
        run_job(SpikeJob(fixed=True), collector.url, "closed", 5)
        # Stops reporting without close(): hung, or killed.
        job = SpikeJob(fixed=True)
        mon = job.attach(collector.url, "hung")
        try:
            job.train(mon, 5)
            assert mon.flush(30)
            alert = collector.wait_for("RunSilent", "hung", timeout=60)
            assert alert["labels"] == {"run": "hung"}
            assert alert["value"] >= 2.0 and alert["step"] == 5
            # "closed" went quiet before "hung": had it been going to fire, it would have.
            assert [a for a in collector.alerts("closed") if a["alertname"] == "RunSilent"] == []
            # Reporting again resolves it.
            job.train(mon, 1)
            assert mon.flush(30)
            collector.wait_for("RunSilent", "hung", state="resolved", timeout=60)
        finally:
            mon.close()


# -- 2. a healthy run fires nothing ------------------------------------------------------------
def test_a_healthy_run_with_every_signal_fires_nothing():
    job = HealthyJob()
    with running_collector() as collector:
        with job.attach(collector.url, "healthy") as mon:
            for _ in range(6):
                job.train(mon, 25)
                assert mon.flush(30)
                # Resolved alerts are kept for 15 minutes: one that fired between two
                # looks would still show.
                fired = [a for a in collector.alerts() if a["state"] in ("firing", "resolved")]
                assert fired == [], f"after step {job.steps}: {fired}"
            names = {s["name"] for s in mon.latest()}
            # Every signal a rule watches was there to be watched.
            assert {
                "modality_dilution_ratio",
                "loss_weight_mass",
                "param_drift_log2",
                "param_drift_consistency_ratio",
                "param_weight_decay",
                "param_grad_relative_rms",
                "adam_eps_dominated_ratio",
                "adam_normalized_update_rms",
                "softmax_saturated_ratio",
                "grad_norm",
                "nonfinite_total",
            } <= names
            assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0)
            assert mon.value("modality_dilution_ratio", modality="image") == pytest.approx(1.0)
            assert mon.value("microbatches") == 2
            assert mon.value("loss_norm_exponent") == pytest.approx(0.0, abs=1e-6)  # per-sample
            assert mon.value("param_weight_decay", param="norm.weight") > 0
            assert mon.value("softmax_saturated_ratio", task="lm", role="student", threshold="0.99") < 0.5
        assert job.steps == 150
        assert collector.firing() == []
        firing = metric_series(collector.metrics(), "trainvitals_alerts_firing")
        assert {dict(k)["alertname"] for k in firing} == set(DEFAULT_RULES)
        assert set(firing.values()) == {0.0}


# -- 3. a real Alertmanager ------------------------------------------------------------------
def _webhook_alerts(receiver: RecordingServer, alertname: str, status: str) -> list[dict]:
    """Alerts named ``alertname`` in ``status`` among the bodies Alertmanager delivered."""
    return [
        a
        for r in receiver.received()
        for a in r.json().get("alerts", [])
        if a["labels"].get("alertname") == alertname and a["status"] == status
    ]


@pytest.mark.integration
@needs_tools("prometheus-alertmanager")
def test_alertmanager_delivers_the_collectors_alert_and_its_resolution(tmp_path):
    run = "mm-pt1"
    with (
        RecordingServer() as webhook,
        running_alertmanager(tmp_path / "alertmanager", webhook.url) as am_url,
        running_collector(
            notifiers=[{"type": "alertmanager", "url": am_url, "timeout": 5}], alerts={"resend_interval": 5}
        ) as collector,
    ):
        job = DilutionJob()  # the I1 bug: per-token normalization
        with job.attach(collector.url, run) as mon:
            job.train(mon, 24)
            assert mon.flush(30)
            collector.wait_for("GradientDilution", run)
            (alert, *_) = wait_until(
                lambda: _webhook_alerts(webhook, "GradientDilution", "firing"),
                60,
                "the firing alert at the webhook receiver",
            )
            assert alert["labels"] == {
                "alertname": "GradientDilution",
                "severity": "page",
                "run": run,
                "modality": "image",
            }
            summary = alert["annotations"]["summary"]
            assert summary.startswith(f"Run {run}, step ")
            assert "image samples get 17.0x less gradient than the job's intended loss normalization" in summary
            assert alert["annotations"]["runbook_url"] == f"{collector.url}/runbooks/gradientdilution"
            assert alert["generatorURL"] == f"{collector.url}/runs/{run}"
            assert _webhook_alerts(webhook, "GradientDilution", "resolved") == []

            job.fixed = True  # per-sample normalization: dilution 1.0, below clear (3)
            job.train(mon, 3)
            assert mon.flush(30)
            collector.wait_for("GradientDilution", run, state="resolved", timeout=60)
            (resolved, *_) = wait_until(
                lambda: _webhook_alerts(webhook, "GradientDilution", "resolved"),
                60,
                "the resolved alert at the webhook receiver",
            )
            assert resolved["labels"] == alert["labels"]
        metrics = collector.metrics()
        assert metric_value(metrics, "trainvitals_notifications_total", notifier="alertmanager", outcome="sent") >= 2
        assert metric_value(metrics, "trainvitals_notifications_total", notifier="alertmanager", outcome="failed") == 0


# -- 4. notifier retries, through the collector ---------------------------------------------------
def _notifications(collector: Collector, outcome: str, notifier: str = "webhook") -> float:
    value = metric_value(collector.metrics(), "trainvitals_notifications_total", notifier=notifier, outcome=outcome)
    return 0.0 if value is None else value


def test_a_webhook_that_fails_once_gets_the_alert_once():
    with (
        RecordingServer([500]) as webhook,
        running_collector(notifiers=[{"type": "webhook", "url": f"{webhook.url}/hook"}]) as collector,
    ):
        run_job(NonFiniteLossJob(), collector.url, "nan", 10)
        collector.wait_for("NonFiniteLoss", "nan", state="resolved")  # the run's end resolves it
        wait_until(lambda: _notifications(collector, "sent") == 2, 60, "the page and its resolve sent")
        received = webhook.received()
        assert [r.answered for r in received] == [500, 200, 200]
        assert received[0].body == received[1].body  # the same notification, retried
        body = received[1].json()
        (alert,) = body["alerts"]
        assert body["status"] == alert["status"] == "firing"
        (resolved,) = received[2].json()["alerts"]
        assert resolved["status"] == "resolved" and "run nan ended at step 10" in resolved["annotations"]["summary"]
        assert alert["labels"] == {"alertname": "NonFiniteLoss", "severity": "page", "run": "nan", "what": "loss"}
        assert _notifications(collector, "failed") == 0
        retries = metric_series(collector.metrics(), "trainvitals_notification_retries_total")
        assert retries == {frozenset({("notifier", "webhook")}): 1.0}


POSTS = 100
POST_BOUND_S = 5.0  # generous: a POST waits for rule evaluation, never for a notifier


@pytest.mark.parametrize("receiver", ["answers", "hangs"])
def test_a_hanging_webhook_does_not_slow_ingestion(receiver: str):
    hang = receiver == "hangs"
    webhook = RecordingServer(hang=hang)
    try:
        with running_collector(
            notifiers=[{"type": "webhook", "url": f"{webhook.url}/hook", "timeout": 2}],
            alerts={"retry": RetryPolicy(attempts=2, initial=0.1, maximum=0.2)},
        ) as collector:

            def post(i: int) -> httpx.Response:
                report = make_report(
                    run=f"reset-{i}",
                    step=1,
                    time=time.time(),
                    events=[{"kind": "optimizer_state_reset", "detail": "state cleared"}],
                )
                started = time.monotonic()
                response = collector.client.post("/v1/reports", json=make_body(report))
                elapsed = time.monotonic() - started
                assert response.status_code == 202, response.text
                assert elapsed < POST_BOUND_S, f"POST {i} took {elapsed:.1f} s"
                return response

            # The first alert goes out; with a hanging receiver the notifier is now stuck.
            post(0)
            wait_until(lambda: webhook.received(), 60, "the first notification at the receiver")
            accepted = sum(post(i).json()["accepted"] for i in range(1, POSTS + 1))
            assert accepted == POSTS
            reports = metric_value(collector.metrics(), "trainvitals_collector_reports_total", outcome="accepted")
            assert reports == POSTS + 1
            assert len(collector.firing()) == POSTS + 1
            if hang:
                assert webhook.received()[0].answered is None
                wait_until(lambda: _notifications(collector, "failed") >= 1, 60, "a failed notification in /metrics")
                assert _notifications(collector, "sent") == 0
            else:
                wait_until(lambda: _notifications(collector, "sent") == POSTS + 1, 60, "every notification sent")
                assert _notifications(collector, "failed") == 0
            # Release the receiver before the collector stops, so its notifier fails fast.
            webhook.close()
    finally:
        webhook.close()
