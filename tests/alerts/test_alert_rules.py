"""Rule files: loading, validation errors that name file/rule/field, templates."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

from trainvitals.alerts.engine import Engine
from trainvitals.alerts.loading import (
    RuleError,
    load_rule_file,
    load_rules,
    parse_rules,
    resolve_rules,
)
from trainvitals.alerts.local import LocalEvaluator
from trainvitals.alerts.model import (
    KNOWN_LABELS,
    METRIC_LABELS,
    EventRule,
    SilenceRule,
    ThresholdRule,
    parse_duration,
)
from trainvitals.alerts.service import AlertService
from trainvitals.alerts.templates import render_template
from trainvitals.wire import METRICS, Sample, series_labels

REQUIRED = {
    "GradientDilution",
    "LossNotAccumNormalized",
    "MeanOfMeansLoss",
    "ParamDrift",
    "OptimizerStateReset",
    "AdamEpsilonDominated",
    "SoftmaxSaturation",
    "NonFiniteLoss",
    "GradNormSpike",
    "RunSilent",
}


def _write(tmp_path: Path, text: str, name: str = "x.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_default_rules_cover_every_incident_name():
    rules = load_rules("default")
    names = {r.alert for r in rules}
    assert REQUIRED <= names
    by = {r.alert: r for r in rules}
    assert by["GradientDilution"].metric == "modality_excess_dilution_ratio"
    assert by["LossNotAccumNormalized"].metric == "loss_weight_mass"
    assert by["MeanOfMeansLoss"].metric == "token_weight_spread_ratio"
    assert {c.metric for c in by["ParamDrift"].and_} == {
        "param_drift_consistency_ratio",
        "param_weight_decay",
        "param_grad_relative_rms",
    }
    assert isinstance(by["OptimizerStateReset"], EventRule)
    assert isinstance(by["RunSilent"], SilenceRule)
    assert by["NonFiniteLoss"].transform == "increase"
    assert by["GradNormSpike"].transform == "ratio_to_median"


def test_every_default_rule_has_summary_runbook_and_anchor():
    text = resources.files("trainvitals.alerts").joinpath("RUNBOOKS.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
        for h in re.findall(r"^## (.+)$", text, flags=re.M)
    }
    for rule in load_rules("default"):
        assert rule.summary and rule.description, rule.alert
        assert rule.runbook.startswith("RUNBOOKS.md#"), rule.alert
        assert rule.runbook.split("#", 1)[1] in anchors, rule.alert


def test_default_rule_thresholds_are_commented():
    """Every default rule carries a YAML comment above it (the justification)."""
    for path in resources.files("trainvitals.alerts").joinpath("rules").iterdir():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("- alert:"):
                assert lines[i - 1].startswith("#"), f"{path.name}: {line} has no comment above"


def test_error_names_file_rule_and_field(tmp_path):
    p = _write(tmp_path, "- alert: GradientDilution\n  metric: modality_dilution_ratio\n  above: lots\n  summary: s\n")
    with pytest.raises(RuleError) as info:
        load_rule_file(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: rule 'GradientDilution' (#1): field 'above': Input should be a valid number")
    assert info.value.rule == "GradientDilution" and info.value.field == "above" and info.value.index == 1


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        ("metric: loss\n  above: 1\n  bogus: 1", "bogus", "unknown field"),
        ("metric: loss\n  above: 1\n  below: 0", None, "exactly one of 'above' or 'below'"),
        ("metric: loss\n  above: 5\n  clear: 6", "clear", "must not be above"),
        ("metric: loss\n  below: 5\n  clear: 4", "clear", "must not be below"),
        ("metric: trainvitals_loss\n  above: 1", "metric", "without the 'trainvitals_' prefix"),
        ("metric: loss\n  above: 1\n  for: 5x", "for", "invalid duration"),
        ("metric: loss\n  above: 1\n  for_steps: -1", "for_steps", "greater than or equal to 0"),
        ("metric: loss\n  above: 1\n  severity: urgent", "severity", "Input should be"),
        ("metric: loss\n  above: 1\n  labels: {modality: '=~('}", "labels", "invalid regular expression"),
        ("metric: loss\n  above: 1\n  window: 5", "window", "only to 'transform: ratio_to_median'"),
        ("metric: loss\n  above: 1\n  and: [{metric: param_weight_decay}]", "and[0]", "exactly one"),
        (
            "metric: loss_weight_mass\n  above: 1\n  summary: '{modality}'",
            "summary",
            "unknown template field {modality}",
        ),
        ("metric: loss\n  above: 1\n  summary: '{run:.1f}'", "summary", "does not render"),
        ("metric: loss\n  above: 1\n  summary: '{0}'", "summary", "named fields only"),
        ("metric: loss\n  above: 1\n  summary: '{run.__class__}'", "summary", "attribute"),
        ("event: optimizer_state_reset\n  hold: soon", "hold", "invalid duration"),
        ("silent_for: 0", "silent_for", "greater than 0"),
    ],
)
def test_invalid_rules_name_the_field(tmp_path, body, field, fragment):
    text = f"- alert: Broken\n  {body}\n"
    if "summary" not in body:
        text += "  summary: s\n"
    with pytest.raises(RuleError) as info:
        load_rule_file(_write(tmp_path, text))
    assert info.value.field == field
    assert fragment in str(info.value)
    assert "rule 'Broken' (#1)" in str(info.value)


def test_kind_is_required_and_unique(tmp_path):
    with pytest.raises(RuleError, match="exactly one of 'metric', 'event' or 'silent_for'"):
        parse_rules([{"alert": "X", "summary": "s"}], "f.yaml")
    with pytest.raises(RuleError, match=r"\(found metric, event\)"):
        parse_rules([{"alert": "X", "metric": "loss", "event": "e", "summary": "s"}], "f.yaml")


def test_duplicate_names_across_files(tmp_path):
    a = _write(tmp_path, "- alert: A\n  silent_for: 5m\n  summary: s\n", "a.yaml")
    b = _write(tmp_path, "- alert: A\n  silent_for: 6m\n  summary: s\n", "b.yaml")
    with pytest.raises(RuleError, match=r"b.yaml: rule 'A' \(#1\): field 'alert': duplicate"):
        load_rules([a, b])


def test_yaml_syntax_error_names_line(tmp_path):
    p = _write(tmp_path, "- alert: A\n  metric: [unclosed\n")
    with pytest.raises(RuleError, match=r"x.yaml: line \d+: invalid YAML"):
        load_rule_file(p)


def test_yaml_is_loaded_safely(tmp_path):
    p = _write(tmp_path, "- !!python/object/apply:os.system ['true']\n")
    with pytest.raises(RuleError):
        load_rule_file(p)


def test_mapping_with_rules_key_and_folder(tmp_path):
    _write(tmp_path, "rules:\n- alert: A\n  silent_for: 5m\n  summary: s\n")
    assert [r.alert for r in load_rules(tmp_path)] == ["A"]
    assert load_rules(None) == [] and load_rules([]) == []


def test_matchers_and_numbers_as_label_values():
    (rule,) = parse_rules(
        yaml.safe_load("""
- alert: S
  metric: softmax_saturated_ratio
  labels: {threshold: 0.99, role: "!=student", task: "=~ie|ner"}
  above: 0.9
  summary: "{task} {role} {threshold}"
""")
    )
    assert isinstance(rule, ThresholdRule)
    ops = {m.name: (m.op, m.value) for m in rule.labels}
    assert ops == {"threshold": ("=", "0.99"), "role": ("!=", "student"), "task": ("=~", "ie|ner")}
    preds = {m.name: m.compile() for m in rule.labels}
    assert preds["task"]("ie") and not preds["task"]("ie2")  # anchored like PromQL
    assert preds["role"](None) and not preds["role"]("student")


@pytest.mark.parametrize(
    ("text", "seconds"), [(90, 90.0), ("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("500ms", 0.5), ("2.5", 2.5)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_render_never_raises():
    assert render_template("{modality} {value:.1f}", {"value": 2.0}) == "? 2.0"
    assert render_template("{modality:.1f} x", {}) == "? x"
    assert render_template("{value:.1f}", {"value": float("nan")}) == "nan"


# ------------------------------------------------------------ resolve_rules


def test_resolve_takes_every_spec_in_the_order_given(tmp_path):
    folder = tmp_path / "more"
    folder.mkdir()
    _write(folder, "- {alert: B, silent_for: 5m, summary: s}\n", "b.yml")
    _write(folder, "- {alert: A, silent_for: 5m, summary: s}\n", "a.yaml")
    _write(folder, "not a rule file", "notes.txt")
    single = _write(tmp_path, "- {alert: C, metric: loss, above: 1, summary: s}\n")
    (obj,) = parse_rules([{"alert": "D", "event": "run_end", "summary": "s"}])
    defaults = [r.alert for r in resolve_rules("default")]
    assert defaults == [r.alert for r in resolve_rules(Path("default"))] == [r.alert for r in load_rules()]
    mixed = resolve_rules([obj, str(single), folder, "default"])
    assert [r.alert for r in mixed] == ["D", "C", "A", "B", *defaults]
    assert mixed[0] is obj
    assert resolve_rules(obj) == [obj] and resolve_rules(iter([obj])) == [obj]
    assert resolve_rules(None) == [] and resolve_rules(()) == []


def test_every_caller_resolves_the_same_way(tmp_path):
    path = _write(
        tmp_path, "- {alert: C, metric: loss, above: 1, summary: s}\n- {alert: Quiet, silent_for: 5m, summary: s}\n"
    )
    (obj,) = parse_rules([{"alert": "D", "event": "run_end", "summary": "s"}])
    spec = [obj, path]
    service = AlertService.from_config(rules=spec)
    assert [r.alert for r in service.engine.rules] == ["D", "C", "Quiet"]
    local = LocalEvaluator(spec)  # no RunSilent-style rules in-process
    assert [r.alert for r in local.engine.rules] == ["D", "C"]


def test_resolve_checks_names_across_objects_and_files(tmp_path):
    path = _write(tmp_path, "- {alert: A, silent_for: 5m, summary: s}\n")
    (obj,) = parse_rules([{"alert": "A", "event": "run_end", "summary": "s"}])
    with pytest.raises(
        RuleError,
        match=r"x.yaml: rule 'A' \(#1\): field 'alert': duplicate alert name "
        r"\(also <rule objects> #1\)",
    ):
        resolve_rules([obj, path])
    with pytest.raises(RuleError, match=r"<rule objects>: rule 'A' \(#2\): field 'alert': duplicate"):
        resolve_rules([obj, obj])


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (5, "rules: int 5 names no rules"),
        ({"rules": []}, "rules: dict {'rules': []} names no rules"),
        (["default", 3.5], "rules: item #2: float 3.5 names no rules"),
        ([{"alert": "A"}], "rules: item #1: dict"),
    ],
)
def test_resolve_rejects_what_names_no_rules(spec, fragment):
    with pytest.raises(RuleError) as info:
        resolve_rules(spec)
    assert str(info.value).startswith(fragment)
    assert "give 'default', a rule file or folder, rule objects" in str(info.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(RuleError, match=r"nope.yaml: cannot read: No such file"):
        resolve_rules(["default", tmp_path / "nope.yaml"])


@pytest.mark.parametrize("spec", ["default", Path("rules.yaml"), None, ["default"], [object()]])
def test_engine_takes_rule_objects_only(spec):
    with pytest.raises(TypeError, match="resolve_rules"):
        Engine(spec)


# --------------------------------------------- labels come from the wire's table

RUN_METRICS = sorted(METRIC_LABELS)


@pytest.mark.parametrize("metric", RUN_METRICS)
def test_a_rule_offers_exactly_its_metrics_labels(metric):
    spec = METRICS[metric]
    # The series the collector stores for a sample of this metric, on rank 1.
    sample = Sample(name=metric, labels={k: "v" for k in spec.labels}, value=1.0)
    stored = series_labels("r", 1, sample.labels)
    fields = " ".join(f"{{{k}}}" for k in stored)
    (rule,) = parse_rules([{"alert": "A", "metric": metric, "above": 1, "summary": fields}])
    assert rule.template_fields() - {"alertname", "severity", "value", "step", "above", "below", "clear"} == set(stored)
    unknown = sorted(KNOWN_LABELS - set(stored))
    if unknown:
        with pytest.raises(RuleError, match=f"unknown template field {{{unknown[0]}}}"):
            parse_rules([{"alert": "A", "metric": metric, "above": 1, "summary": f"{{{unknown[0]}}}"}])


def test_known_labels_are_every_label_of_a_run_series():
    run_specs = [s for s in METRICS.values() if s.name in METRIC_LABELS]
    assert {"loss", "step", "last_report_timestamp_seconds"} <= set(METRIC_LABELS)
    # The collector's own metrics belong to no run: their labels are not series labels.
    assert "alerts_firing" not in METRIC_LABELS and "notifier" not in KNOWN_LABELS
    assert KNOWN_LABELS == {label for s in run_specs for label in series_labels("r", 1, dict.fromkeys(s.labels, "v"))}
    # An event may come from any series of a run: its template offers every label.
    (rule,) = parse_rules([{"alert": "E", "event": "x", "summary": "{modality} {param} {rank}"}])
    assert KNOWN_LABELS <= rule.template_fields()


IMPOSSIBLE = {
    "label matcher": (
        "- alert: ImageGradNorm\n  metric: grad_norm\n  labels: {modality: image}\n  above: 10\n  summary: x\n",
        "rule 'ImageGradNorm' (#1): field 'labels': grad_norm has no label 'modality' "
        "(its labels: none besides run, rank), so modality='image' matches no series",
    ),
    "and join": (
        "- alert: JoinNever\n  metric: grad_norm\n  above: 10\n  and:\n    - {metric: modality_loss, above: 1}\n"
        "  summary: x\n",
        "rule 'JoinNever' (#1): field 'and[0]': no series of modality_loss (labels: modality besides run, rank) "
        "can join a series of grad_norm (labels: none besides run, rank)",
    ),
    "condition matcher": (
        "- alert: JoinLabel\n  metric: modality_loss\n  above: 10\n  and:\n"
        "    - {metric: modality_grad_share_ratio, labels: {objective: main}, above: 0.1}\n  summary: x\n",
        "field 'and[0].labels': modality_grad_share_ratio has no label 'objective' (its labels: modality besides",
    ),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_rules_check_and_loading_refuse_rules_no_series_can_satisfy(tmp_path, case):
    from click.testing import CliRunner

    from trainvitals.monitor.cli import main

    text, message = IMPOSSIBLE[case]
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["rules", "check", str(path)])
    assert result.exit_code == 1 and message in result.output, result.output
    with pytest.raises(RuleError, match=re.escape(message)):
        load_rules(path)  # the collector refuses it at start-up the same way


def test_matchers_that_accept_an_absent_label_and_joins_that_can_meet_still_load():
    rules = parse_rules(
        yaml.safe_load(
            """
- alert: NotImage
  metric: grad_norm
  labels: {modality: "!=image"}
  above: 10
  summary: x
- alert: AdamJoin
  metric: param_drift_log2
  above: 1
  and:
    - {metric: adam_eps_dominated_ratio, above: 0.5}
    - {metric: grad_norm, above: 0}
  summary: x
"""
        )
    )
    assert [r.alert for r in rules] == ["NotImage", "AdamJoin"]
