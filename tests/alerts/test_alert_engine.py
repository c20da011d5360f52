"""The engine's state machines, fed wire Reports directly."""

from __future__ import annotations

import logging
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reports import wire_report
from trainvitals.alerts.engine import Engine
from trainvitals.alerts.loading import load_rules, parse_rules
from trainvitals.alerts.local import LocalEvaluator
from trainvitals.alerts.state import AlertState

F, P, R, IN = AlertState.FIRING, AlertState.PENDING, AlertState.RESOLVED, AlertState.INACTIVE

DILUTION = """
- alert: GradientDilution
  metric: modality_dilution_ratio
  labels: {modality: "!=text"}
  above: 5
  clear: 3
  for_steps: 20
  severity: page
  summary: "{modality} {value:.1f}x in {run}"
"""


def engine(text: str) -> Engine:
    return Engine(parse_rules(yaml.safe_load(text)))


def dil(step: int, value: float, modality: str = "image", **kw):
    return wire_report(step, [("modality_dilution_ratio", {"modality": modality}, value)], **kw)


def feed(eng: Engine, values, *, every: int = 10, modality: str = "image", start: int = 0, **kw):
    """Feed values at steps start, start+every, ...; return [(step, old, new)]."""
    out = []
    for i, v in enumerate(values):
        step = start + i * every
        for t in eng.observe(dil(step, v, modality, **kw), now=1000.0 + step):
            out.append((step, t.old, t.state))
    return out


def test_pending_then_firing_after_for_steps():
    eng = engine(DILUTION)
    assert feed(eng, [17, 17, 17]) == [(0, IN, P), (20, P, F)]
    (alert,) = eng.firing()
    assert alert.labels == {"run": "r1", "modality": "image"}
    assert alert.alert_labels == {"alertname": "GradientDilution", "severity": "page", "run": "r1", "modality": "image"}
    assert alert.summary == "image 17.0x in r1"
    assert alert.since == 1020.0 and alert.value == 17


def test_pending_resets_when_value_drops_back():
    eng = engine(DILUTION)
    assert feed(eng, [17, 17, 4, 17, 17]) == [(0, IN, P), (20, P, IN), (30, IN, P)]
    assert eng.alerts() and eng.alerts()[0].state is P


def test_no_flapping_inside_the_band_then_resolve_and_refire():
    eng = engine(DILUTION)
    trans = feed(eng, [17, 17, 17, 4.9, 3.1, 4.5, 5.0, 3.01, 3.0, 2, 17, 17, 17])
    assert trans == [(0, IN, P), (20, P, F), (80, F, R), (100, R, P), (120, P, F)]


def test_matchers_exclude_series():
    eng = engine(DILUTION)
    assert feed(eng, [17, 17, 17], modality="text") == []


def test_series_are_independent():
    eng = engine(DILUTION)
    out = []
    for i, (img, aud) in enumerate([(17, 1), (17, 17), (17, 17), (1, 17), (1, 17)]):
        step = i * 10
        r = wire_report(
            step,
            [
                ("modality_dilution_ratio", {"modality": "image"}, img),
                ("modality_dilution_ratio", {"modality": "audio"}, aud),
            ],
        )
        out += [(step, t.labels["modality"], t.state) for t in eng.observe(r, now=step)]
    assert out == [(0, "image", P), (10, "audio", P), (20, "image", F), (30, "image", R), (30, "audio", F)]


def test_runs_and_ranks_are_independent():
    eng = engine(DILUTION)
    feed(eng, [17, 17, 17], run="a")
    feed(eng, [17, 17, 17], run="a", rank=2)
    feed(eng, [17], run="b")
    firing = sorted((a.labels["run"], a.labels.get("rank", "")) for a in eng.firing())
    assert firing == [("a", ""), ("a", "2")]
    assert [a.labels["run"] for a in eng.alerts([P])] == ["b"]


def test_for_duration_in_seconds():
    eng = engine(DILUTION.replace("for_steps: 20", "for: 5m"))
    r = dil(0, 17)
    assert [t.state for t in eng.observe(r, now=0)] == [P]
    assert eng.observe(dil(10, 17), now=299) == []
    assert [t.state for t in eng.observe(dil(20, 17), now=300)] == [F]


def test_for_steps_zero_fires_at_once_and_steps_going_back_restart_pending():
    eng = engine(DILUTION.replace("for_steps: 20", "for_steps: 0"))
    assert [(t.old, t.state) for t in eng.observe(dil(5, 9), now=0)] == [(IN, F)]
    eng = engine(DILUTION)
    feed(eng, [17, 17], start=100)  # pending since step 100
    assert eng.observe(dil(50, 17), now=2000) == []  # restarted from a checkpoint: counts from 50
    assert eng.observe(dil(60, 17), now=2001) == []
    assert [t.state for t in eng.observe(dil(70, 17), now=2002)] == [F]


def test_nan_is_no_evidence():
    eng = engine(DILUTION)
    nan = math.nan
    # NaN neither starts, advances to firing on its own, nor resets a pending alert.
    assert feed(eng, [nan, 17, nan, 17]) == [(10, IN, P), (30, P, F)]
    # ... nor resolves a firing one.
    assert feed(eng, [nan, nan], start=40) == []
    assert eng.firing()
    assert feed(eng, [math.inf], start=60) == []  # +Inf is above: still firing
    assert feed(eng, [1.0], start=70) == [(70, F, R)]


def test_missing_series_holds_state():
    eng = engine(DILUTION)
    feed(eng, [17, 17, 17])
    for step in (30, 40, 50):
        assert eng.observe(wire_report(step, [("loss", {}, 1.0)]), now=step) == []
    assert eng.firing()


def test_below_rule_and_hold_steps():
    eng = engine("""
- alert: Low
  metric: loss_weight_mass
  below: 0.5
  clear: 0.8
  hold_steps: 30
  summary: s
""")
    trans = []
    for step, v in enumerate([0.25, 0.7, 0.9, 0.9, 0.6, 0.9, 0.9, 0.9, 0.9]):
        trans += [
            (step * 10, t.state) for t in eng.observe(wire_report(step * 10, [("loss_weight_mass", {}, v)]), now=step)
        ]
    # 0.6 at step 40 is inside the band: the clear streak restarts at 50.
    assert trans == [(0, F), (80, R)]


PARAM_DRIFT = """
- alert: ParamDrift
  metric: param_drift_log2
  above: 1
  clear: 0.5
  and:
    - {metric: param_drift_consistency_ratio, above: 0.6}
    - {metric: param_weight_decay, below: 1.0e-12}
  severity: page
  summary: "{param} {value:.1f}"
"""


def drift_report(step, drift, consistency=0.9, decay=0.0, param="norm.weight", extra=()):
    lb = {"param": param}
    samples = [("param_drift_log2", lb, drift)]
    if consistency is not None:
        samples.append(("param_drift_consistency_ratio", lb, consistency))
    if decay is not None:
        samples.append(("param_weight_decay", lb, decay))
    return wire_report(step, [*samples, *extra])


def test_and_conditions_match_series_by_labels():
    eng = engine(PARAM_DRIFT)
    # Another parameter's consistency must not satisfy this one's condition.
    r = wire_report(
        0,
        [
            ("param_drift_log2", {"param": "a"}, 3.0),
            ("param_drift_consistency_ratio", {"param": "a"}, 0.1),
            ("param_drift_consistency_ratio", {"param": "b"}, 0.9),
            ("param_weight_decay", {"param": "a"}, 0.0),
        ],
    )
    assert eng.observe(r, now=0) == []
    # Conditions are looked up across the whole report, in any order.
    r = wire_report(
        10,
        [
            ("param_weight_decay", {"param": "a"}, 0.0),
            ("param_drift_consistency_ratio", {"param": "a"}, 0.9),
            ("param_drift_log2", {"param": "a"}, 3.0),
        ],
    )
    (t,) = eng.observe(r, now=1)
    assert t.state is F and t.labels == {"run": "r1", "param": "a"}


def test_and_condition_false_resolves_even_while_primary_is_high():
    eng = engine(PARAM_DRIFT)
    assert [t.state for t in eng.observe(drift_report(0, 3.0), now=0)] == [F]
    assert eng.observe(drift_report(10, 3.2, decay=None), now=1) == []  # latest decay still 0
    # The fix: weight decay on. Drift is still 3 bits, but the rule no longer holds.
    assert [t.state for t in eng.observe(drift_report(20, 3.0, decay=0.1), now=2)] == [R]


def test_and_condition_never_seen_is_no_evidence():
    eng = engine(PARAM_DRIFT)
    assert eng.observe(drift_report(0, 3.0, consistency=None, decay=None), now=0) == []
    assert eng.observe(drift_report(10, 3.0, decay=None), now=0) == []
    assert eng.alerts() == []


def test_and_condition_with_fewer_labels_matches_by_restriction():
    eng = engine("""
- alert: Diluted
  metric: modality_grad_norm
  above: 1
  and: [{metric: grad_norm, above: 1.5}]
  summary: "{modality} {scope}"
""")
    r = wire_report(0, [("modality_grad_norm", {"modality": "image", "scope": "output"}, 3.0), ("grad_norm", {}, 4.0)])
    (t,) = eng.observe(r, now=0)
    assert t.state is F and t.summary == "image output"


EVENT = """
- alert: OptimizerStateReset
  event: optimizer_state_reset
  hold_steps: 100
  severity: info
  summary: "reset at {step}: {detail}"
"""


def test_event_rule_fires_on_the_report_and_resolves_after_hold():
    eng = engine(EVENT)
    (t,) = eng.observe(wire_report(60, events=[("optimizer_state_reset", "rebuilt")]), now=0)
    assert (t.old, t.state, t.summary) == (IN, F, "reset at 60: rebuilt")
    for step in range(70, 160, 10):
        assert eng.observe(wire_report(step), now=step) == []
    # A second reset while firing extends the hold without a new notification.
    assert eng.observe(wire_report(150, events=["optimizer_state_reset"]), now=0) == []
    assert eng.firing()[0].value == 2
    assert eng.observe(wire_report(240), now=0) == []
    assert [t.state for t in eng.observe(wire_report(250), now=0)] == [R]
    # Another run's reports do not resolve it; a new event fires it again.
    (t,) = eng.observe(wire_report(300, events=["optimizer_state_reset"]), now=0)
    assert (t.old, t.state) == (R, F)


def test_event_hold_by_time_resolves_on_tick():
    eng = engine(EVENT.replace("hold_steps: 100", "hold: 5m"))
    eng.observe(wire_report(10, events=["optimizer_state_reset"]), now=1000)
    assert eng.tick(1299) == []
    assert [t.state for t in eng.tick(1300)] == [R]


SILENT = """
- alert: RunSilent
  silent_for: 10m
  summary: "{run} silent {value:.0f} s"
"""


def test_run_silent_timer():
    eng = engine(SILENT)
    eng.observe(wire_report(10, run="a"), now=1000)
    eng.observe(wire_report(10, run="b"), now=1300)
    assert eng.tick(1599) == []
    (t,) = eng.tick(1600)
    assert (t.state, t.labels, t.summary) == (F, {"run": "a"}, "a silent 600 s")
    assert eng.tick(1700) == []  # fires once
    (t,) = eng.observe(wire_report(20, run="a"), now=1800)
    assert (t.old, t.state) == (F, R)
    assert [t.labels["run"] for t in eng.tick(1900)] == ["b"]


def test_run_end_event_silences_run_silent_and_old_runs_are_forgotten():
    eng = Engine(parse_rules(yaml.safe_load(SILENT + DILUTION)), run_ttl=3600)
    eng.observe(wire_report(10, run="a", events=["run_end"]), now=0)
    assert eng.tick(700) == []
    feed(eng, [17, 17, 17], run="b")  # firing GradientDilution, now=1000..1020
    assert {a.alertname for a in eng.firing()} == {"GradientDilution"}
    trans = eng.tick(1020 + 3600)
    assert {(t.alertname, t.state, t.reason) for t in trans} == {
        ("GradientDilution", R, "run b sent nothing for 3600 s and was forgotten")
    }
    assert eng.alerts() == []


def test_resolved_alerts_are_kept_for_a_while():
    eng = Engine(parse_rules(yaml.safe_load(DILUTION)), resolved_retention=60)
    feed(eng, [17, 17, 17, 1])  # resolved at now=1030
    assert [a.state for a in eng.alerts()] == [R]
    eng.tick(1089)
    assert [a.state for a in eng.alerts()] == [R]
    eng.tick(1100)
    assert eng.alerts() == []


def test_a_resolved_alert_keeps_the_step_and_value_it_resolved_at():
    """Later healthy reports (a value in the band too) leave the resolved alert as its
    transition said it: the step and the value of the report that cleared it."""
    eng = engine(DILUTION)
    assert feed(eng, [17, 17, 17, 1.5, 4, 2, 1]) == [(0, IN, P), (20, P, F), (30, F, R)]
    (alert,) = eng.alerts()
    assert (alert.state, alert.step, alert.value) == (R, 30, 1.5)
    assert " at step 30: modality_dilution_ratio is back to 1.5 " in alert.resolved_summary()
    # It fires again from a new pending step, with that report's step and value.
    assert feed(eng, [9, 9, 9], start=70) == [(70, R, P), (90, P, F)]
    (alert,) = eng.alerts()
    assert (alert.state, alert.step, alert.value) == (F, 90, 9)


def test_counter_increase_transform():
    eng = engine("""
- alert: NonFiniteLoss
  metric: nonfinite_total
  labels: {what: loss}
  transform: increase
  above: 0
  hold_steps: 20
  summary: "{value:.0f}"
""")

    def nf(step, v, what="loss"):
        return [
            (t.state, t.summary)
            for t in eng.observe(wire_report(step, [("nonfinite_total", {"what": what}, v)]), now=step)
        ]

    assert nf(0, 3) == []  # the first report is the baseline
    assert nf(10, 3) == []
    assert nf(20, 5) == [(F, "2")]
    assert nf(30, 5) == [] and nf(40, 5) == []
    assert nf(50, 5) == [(R, "2")]  # a resolve is rendered with the value it fired with
    assert nf(60, 1) == [(F, "1")]  # counter reset (restart): the new value is the increase
    assert nf(70, 100, what="grad") == []


def test_ratio_to_median_transform():
    eng = engine("""
- alert: GradNormSpike
  metric: grad_norm
  transform: ratio_to_median
  window: 5
  above: 10
  clear: 3
  summary: "{value:.0f}x"
""")
    out = []
    values = [100, 50, 20, 30, 25, 24, 26, 400, 150, 70, 26, 25]
    for i, v in enumerate(values):
        out += [(i, t.state, t.summary) for t in eng.observe(wire_report(i, [("grad_norm", {}, v)]), now=i)]
    # No verdict for the first 5 reports (warm-up norms fall); then 400 / median(20,30,25,24,26)
    # = 16x; 150 is 5.8x (inside the band: still firing); 70 is 2.7x: back under clear.
    assert out == [(7, F, "16x"), (9, R, "16x")]  # a resolve renders the value it fired with


def test_default_rules_fire_on_incident_values_and_not_on_healthy_twins():
    """The shipped rules against the incidents' values (docs/incidents.md, I1-I5) and healthy values."""

    def run_values(samples_at, steps=range(0, 300, 10), events_at=None):
        eng = Engine(load_rules("default"))
        fired = set()
        for step in steps:
            ev = events_at(step) if events_at else ()
            for t in eng.observe(wire_report(step, samples_at(step), events=ev), now=1000.0 + step):
                if t.state is F:
                    fired.add(t.alertname)
        return fired

    p = {"param": "final_norm.weight"}
    obj = {"objective": "main"}
    incident = {
        "GradientDilution": lambda s: [
            ("modality_dilution_ratio", {"modality": "image"}, 17.0),
            ("modality_dilution_ratio", {"modality": "text"}, 0.85),
            ("modality_excess_dilution_ratio", {"modality": "image"}, 17.0),
            ("modality_excess_dilution_ratio", {"modality": "text"}, 0.85),
        ],
        # sqrt normalization with 2-8 token answers: 12x, as intended.
        "LossNormalizationDilutes": lambda s: [
            ("modality_dilution_ratio", {"modality": "image"}, 12.0),
            ("modality_excess_dilution_ratio", {"modality": "image"}, 1.02),
        ],
        "LossNotAccumNormalized": lambda s: [
            ("loss_weight_mass", obj, 4.0),
            ("loss_accumulation_exponent", obj, 1.0),
            ("optimizer_scale_invariant", {}, 0.0),
        ],
        "LossWeightMassLow": lambda s: [("loss_weight_mass", obj, 0.25), ("loss_accumulation_exponent", obj, -1.0)],
        "MeanOfMeansLoss": lambda s: [("token_weight_spread_ratio", obj, 1.8 + 0.3 * math.sin(s))],
        "ParamDrift": lambda s: [
            ("param_drift_log2", p, min(5.8, s / 40)),
            ("param_drift_consistency_ratio", p, 0.9),
            ("param_weight_decay", p, 0.0),
            ("param_grad_relative_rms", p, 1e-4),
        ],
        "AdamEpsilonDominated": lambda s: [
            ("adam_eps_dominated_ratio", p, 1.0),
            ("adam_normalized_update_rms", p, 0.95),
            ("param_weight_decay", p, 0.0),
        ],
        "SoftmaxSaturation": lambda s: [
            ("softmax_saturated_ratio", {"task": "ie", "role": "teacher", "threshold": "0.99"}, 0.97)
        ],
        "NonFiniteLoss": lambda s: [("nonfinite_total", {"what": "loss"}, float(s >= 150))],
        "GradNormSpike": lambda s: [("grad_norm_max", {}, 500.0 if s == 250 else 1.0 + 0.3 * math.sin(s))],
        # The probe's measurement once (every packing_probe_every steps): 0.04 on a tiny Llama.
        "PackedSamplesLeak": lambda s: (
            [("packing_leak_logit_change", {"cause": "varlen_ignored"}, 0.04)] if s == 0 else []
        ),
    }
    healthy = {
        "GradientDilution": lambda s: [
            ("modality_dilution_ratio", {"modality": "image"}, 1.0),
            ("modality_dilution_ratio", {"modality": "text"}, 1.0),
        ],
        "LossNotAccumNormalized": lambda s: [
            ("loss_weight_mass", obj, 1.0 + 1e-6),
            ("loss_accumulation_exponent", obj, 0.0),
        ],
        # An undeclared coefficient: a hard-label term weighted 2 in one micro-batch (no
        # exponent), a KD loss scaled by tau^2 = 16 over 4 micro-batches (exponent 2).
        "LossNotAccumNormalized-weighted": lambda s: [("loss_weight_mass", obj, 2.0)],
        "LossNotAccumNormalized-kd": lambda s: [
            ("loss_weight_mass", obj, 16.0),
            ("loss_accumulation_exponent", obj, 2.0),
        ],
        # A deliberate alpha = 0.1 over 2 micro-batches: log 0.1 / log 2 = -3.3.
        "LossWeightMassLow-alpha": lambda s: [
            ("loss_weight_mass", obj, 0.1),
            ("loss_accumulation_exponent", obj, -3.32),
        ],
        "MeanOfMeansLoss": lambda s: [("token_weight_spread_ratio", obj, 1.0)],
        # Per-sample weighting declared (GRPO's per-sequence mean): the same spread is the intent.
        "MeanOfMeansLoss-per-sample": lambda s: [
            ("token_weight_spread_ratio", {**obj, "normalization": "sample"}, 1.8 + 0.3 * math.sin(s))
        ],
        # A norm gain that grows with its gradient and is decayed: not Adam drift.
        "ParamDrift": lambda s: [
            ("param_drift_log2", p, 1.5),
            ("param_drift_consistency_ratio", p, 0.9),
            ("param_weight_decay", p, 0.0),
            ("param_grad_relative_rms", p, 0.8),
        ],
        # A parameter with an exactly zero gradient: eps-dominated but it does not move.
        "AdamEpsilonDominated": lambda s: [
            ("adam_eps_dominated_ratio", p, 1.0),
            ("adam_normalized_update_rms", p, 0.0),
            ("param_weight_decay", p, 0.0),
        ],
        "SoftmaxSaturation": lambda s: [
            ("softmax_saturated_ratio", {"task": "ie", "role": "teacher", "threshold": "0.99"}, 0.35)
        ],
        "NonFiniteLoss": lambda s: [
            ("nonfinite_total", {"what": "loss"}, 0.0),
            ("nonfinite_total", {"what": "grad"}, float(s)),
        ],
        "GradNormSpike": lambda s: [("grad_norm_max", {}, 1.0 + 0.5 * math.sin(s))],
        # A proper block-diagonal mask: the later samples' logits do not move at all.
        "PackedSamplesLeak": lambda s: [("packing_leak_logit_change", {"cause": "unknown"}, 0.0)] if s == 0 else [],
    }
    # SignalInactive reads coverage, not samples: tests/hooks/test_coverage.py.
    assert set(incident) | {"OptimizerStateReset", "RunSilent", "SignalInactive"} == {
        r.alert for r in load_rules("default")
    }
    for name, fn in incident.items():
        assert run_values(fn) == {name}, name
    for name, fn in healthy.items():
        assert run_values(fn) == set(), name
    reset = run_values(lambda s: [], events_at=lambda s: ["optimizer_state_reset"] if s == 100 else [])
    assert reset == {"OptimizerStateReset"}
    # A spike early in the run: judged from the 5th report on (min_history), not the 20th.
    early = run_values(lambda s: [("grad_norm_max", {}, 300.0 if s == 60 else 1.0 + 0.3 * math.sin(s))])
    assert early == {"GradNormSpike"}
    too_early = run_values(lambda s: [("grad_norm_max", {}, 300.0 if s == 30 else 1.0)], steps=range(0, 50, 10))
    assert too_early == set()


def test_local_evaluator_logs_fire_and_resolve(caplog):
    ev = LocalEvaluator(parse_rules(yaml.safe_load(DILUTION + SILENT)))
    assert [r.alert for r in ev.engine.rules] == ["GradientDilution"]  # no RunSilent in-process
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        for i, v in enumerate([17, 17, 17, 1]):
            ev(dil(i * 10, v))
    recs = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "trainvitals"]
    assert recs == [
        (
            "WARNING",
            "trainvitals alert GradientDilution firing at step 20 (value 17): "
            "image 17.0x in r1 {run=r1, modality=image}",
        ),
        (
            "INFO",
            "trainvitals alert Resolved: GradientDilution in run r1 (modality=image) at step 30: "
            "modality_dilution_ratio is back to 1 (clears at <= 3) after firing for 0 s; it fired at 17",
        ),
    ]
    assert LocalEvaluator("default").engine.rules


def test_local_evaluator_takes_the_report_as_data(caplog):
    """The hooks can pass Monitor.latest()-style dicts as well as wire Reports."""
    ev = LocalEvaluator(parse_rules(yaml.safe_load(DILUTION.replace("for_steps: 20", "for_steps: 0"))))
    data = dil(0, 17).model_dump()
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        (t,) = ev(data)
    assert t.state is F and "GradientDilution firing" in caplog.text
    assert [a.alertname for a in ev.firing()] == ["GradientDilution"]


def test_local_evaluator_never_raises(caplog):
    ev = LocalEvaluator([])

    def boom(*a, **k):
        raise RuntimeError("x")

    ev.engine.observe = boom  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="trainvitals"):
        assert ev(dil(0, 1)) == []
    assert "rule evaluation failed" in caplog.text


# ------------------------------------------------------------------ properties

band_values = st.floats(min_value=-1e6, max_value=5.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(band_values, st.just(math.nan)), max_size=60))
def test_never_fires_without_crossing_above(values):
    eng = engine(DILUTION.replace("for_steps: 20", "for_steps: 0"))
    assert all(new is not F for _, _, new in feed(eng, values))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=40, allow_nan=False), max_size=80))
def test_transitions_follow_the_state_machine(values):
    """Valid edges only; a firing alert resolves only at a value <= clear."""
    eng = engine(DILUTION)
    allowed = {(IN, P), (P, IN), (P, F), (F, R), (R, P), (IN, F), (R, F)}
    state = IN
    for i, v in enumerate(values):
        for t in eng.observe(dil(i * 10, v), now=i):
            assert (t.old, t.state) in allowed
            assert t.old is state
            if t.state is R:
                assert v <= 3
            if t.state is F:
                assert v > 5
            state = t.state if t.state is not IN else IN


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=3.0001, max_value=40, allow_nan=False), min_size=3, max_size=40))
def test_firing_never_resolves_inside_the_band(values):
    eng = engine(DILUTION.replace("for_steps: 20", "for_steps: 0"))
    assert feed(eng, [17.0])[-1][2] is F
    assert feed(eng, values, start=10) in ([], [(10, IN, P)])  # never R
    assert all(new is not R for _, _, new in feed(eng, values, start=10 + 10 * len(values)))


@pytest.mark.parametrize("n_series", [1, 50])
def test_independent_series_equal_single_series(n_series):
    """Interleaving many series gives each the transitions it would get alone."""
    values = [17, 17, 17, 4, 2, 6, 17, 17, 1]
    alone = [(s, o, n) for s, o, n in feed(engine(DILUTION), values)]
    eng = engine(DILUTION)
    per: dict[str, list] = {}
    for i, v in enumerate(values):
        step = i * 10
        r = wire_report(step, [("modality_dilution_ratio", {"modality": f"m{k}"}, v) for k in range(n_series)])
        for t in eng.observe(r, now=1000.0 + step):
            per.setdefault(t.labels["modality"], []).append((step, t.old, t.state))
    assert all(v == alone for v in per.values()) and len(per) == n_series
