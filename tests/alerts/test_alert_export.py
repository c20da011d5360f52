"""`trainvitals rules export/check` and the Prometheus rule file (checked by promtool)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tests.support import needs_tools, require_tool
from trainvitals.alerts.cli import rules as rules_cli
from trainvitals.alerts.export import RUN_ENDED, export_prometheus, promql_template
from trainvitals.alerts.loading import load_rules, parse_rules
from trainvitals.alerts.model import METRIC_LABELS
from trainvitals.wire import METRICS

PROMTOOL_TESTS = Path(__file__).parent / "promtool"


def _exported(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "default_rules.yml"
    result = CliRunner().invoke(rules_cli, ["export", "--format", "prometheus", "-o", str(out), *args])
    assert result.exit_code == 0, result.output
    return out


def test_export_structure_matches_the_rules(tmp_path):
    doc = yaml.safe_load(_exported(tmp_path).read_text())
    (group,) = doc["groups"]
    by = {r["alert"]: r for r in group["rules"]}
    assert set(by) == {r.alert for r in load_rules("default")}
    gd = by["GradientDilution"]
    assert gd["expr"].startswith(
        "(trainvitals_modality_excess_dilution_ratio > 5 or (trainvitals_modality_excess_dilution_ratio > 3 and "
    )
    assert 'ALERTS{alertname="GradientDilution", alertstate="firing"}' in gd["expr"]
    assert gd["for"] == "20s" and gd["labels"] == {"severity": "page"}
    assert gd["annotations"]["runbook_url"] == "RUNBOOKS.md#gradientdilution"
    assert "and on(run, rank, param) trainvitals_param_weight_decay < 1e-12" in by["ParamDrift"]["expr"]
    assert by["NonFiniteLoss"]["expr"] == 'increase(trainvitals_nonfinite_total{what="loss"}[5m]) > 0'
    assert by["NonFiniteLoss"]["keep_firing_for"] == "1m40s"
    assert by["OptimizerStateReset"]["expr"] == "increase(trainvitals_optimizer_state_resets_total[5m]) > 0"
    assert by["RunSilent"]["expr"] == (
        "time() - trainvitals_last_report_timestamp_seconds > 600 unless on(run) trainvitals_run_ended == 1"
    )
    assert "quantile_over_time(0.5, trainvitals_grad_norm_max[3m20s])" in by["GradNormSpike"]["expr"]


def test_run_silent_export_names_the_collectors_run_ended_gauge():
    """The gauge the export reads is the one the collector exports, per run."""
    spec = METRICS[RUN_ENDED]
    assert (spec.owner, spec.type, spec.labels) == ("collector", "gauge", ())
    assert RUN_ENDED in METRIC_LABELS  # a per-run series: it carries `run`
    text = export_prometheus(load_rules("default"))
    assert (
        "# RunSilent:\n  #   a run whose last report carried run_end (trainvitals_run_ended == 1)"
        " stays quiet, as in the collector"
    ) in text
    assert "still fires" not in text


def test_export_options_scale_durations(tmp_path):
    doc = yaml.safe_load(
        _exported(
            tmp_path, "--step-seconds", "3", "--report-every", "1", "--runbook-base-url", "https://x.org/rb/"
        ).read_text()
    )
    by = {r["alert"]: r for r in doc["groups"][0]["rules"]}
    assert by["GradientDilution"]["for"] == "1m"  # 20 steps x 3 s
    assert "[1m]" in by["GradNormSpike"]["expr"]  # 20 reports x 1 step x 3 s
    assert by["GradientDilution"]["annotations"]["runbook_url"] == "https://x.org/rb/RUNBOOKS.md#gradientdilution"


def test_export_says_what_it_cannot_express():
    rules = parse_rules(
        yaml.safe_load("""
- alert: AuditFinding
  event: mixed_modality_sample
  summary: "{detail}"
- alert: Mass
  metric: loss_weight_mass
  above: 2
  summary: "{value:.0%} {step} {above}"
""")
    )
    text = export_prometheus(rules)
    assert "# AuditFinding:\n  #   event 'mixed_modality_sample' has no counter metric: not exported" in text
    assert "- alert: AuditFinding" not in text
    assert "NaN" in text and "ALERTS series" in text  # the header names the differences
    doc = yaml.safe_load(text)
    (mass,) = doc["groups"][0]["rules"]
    assert mass["annotations"]["summary"].startswith("{{ $value | humanizePercentage }} {{ with query")
    assert mass["annotations"]["summary"].endswith(" 2.0")  # as the engine renders it


def test_template_conversion():
    (rule,) = parse_rules(yaml.safe_load("- {alert: A, metric: modality_dilution_ratio, above: 5, summary: s}"))
    assert promql_template("{modality} {value:.1f} {value} {run}x", rule) == (
        '{{ $labels.modality }} {{ printf "%.1f" $value }} {{ $value }} {{ $labels.run }}x'
    )


def test_cli_check_lists_rules_and_fails_with_the_field(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(rules_cli, ["check"])
    assert ok.exit_code == 0
    assert (
        "GradientDilution" in ok.output and "modality_excess_dilution_ratio > 5 (clear at 3) for 20 steps" in ok.output
    )
    assert ok.output.rstrip().endswith("rules OK in the default rules")
    bad = tmp_path / "x.yaml"
    bad.write_text("- alert: GradientDilution\n  metric: modality_dilution_ratio\n  above: lots\n  summary: s\n")
    result = runner.invoke(rules_cli, ["check", str(bad)])
    assert result.exit_code == 1
    assert f"error: {bad}: rule 'GradientDilution' (#1): field 'above': Input should be a valid number" in result.stderr
    good = tmp_path / "y.yaml"
    good.write_text("- {alert: A, silent_for: 5m, summary: s}\n")
    result = runner.invoke(rules_cli, ["check", str(good)])
    assert result.exit_code == 0 and "A  warning   no report for 5m" in result.output


def test_cli_export_to_stdout_and_bad_rules(tmp_path):
    result = CliRunner().invoke(rules_cli, ["export"])
    assert result.exit_code == 0 and result.output.startswith("# Prometheus alerting rules")
    bad = tmp_path / "x.yaml"
    bad.write_text("- {alert: A, metric: loss, above: 1, summary: '{nope}'}\n")
    result = CliRunner().invoke(rules_cli, ["export", "--rules", str(bad)])
    assert result.exit_code == 1 and "field 'summary': unknown template field {nope}" in result.stderr


@needs_tools("promtool")
def test_promtool_checks_the_exported_default_rules(tmp_path):
    out = _exported(tmp_path)
    promtool = require_tool("promtool")
    proc = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(load_rules('default'))} rules found" in proc.stdout


@needs_tools("promtool")
@pytest.mark.parametrize("test_file", sorted(PROMTOOL_TESTS.glob("*.yaml")), ids=lambda p: p.stem)
def test_promtool_unit_tests_pass_on_the_export(tmp_path, test_file):
    _exported(tmp_path)
    shutil.copy(test_file, tmp_path / test_file.name)
    promtool = require_tool("promtool")
    proc = subprocess.run(
        [promtool, "test", "rules", test_file.name], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
