"""The committed Grafana dashboards: current with their generator, and built the way
the product promises (stable uids, a Prometheus datasource variable, run/modality/
param/task variables, a unit on every panel, catalogue metric names only)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.prometheus._stack import DASHBOARDS, load_dashboards, panels
from trainvitals.wire import METRICS, PREFIX


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trainvitals_dashboards_generate", DASHBOARDS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GENERATE = _generator()
UIDS = {
    "trainvitals-overview.json": "trainvitals-overview",
    "trainvitals-loss.json": "trainvitals-loss",
    "trainvitals-params.json": "trainvitals-params",
    "trainvitals-softmax.json": "trainvitals-softmax",
}
TAG = "trainvitals"
_METRIC_NAME = re.compile(rf"\b{PREFIX}\w+")


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def test_committed_json_is_what_the_generator_writes() -> None:
    rendered = GENERATE.render()
    committed = {p.name: p.read_text(encoding="utf-8") for p in DASHBOARDS.glob("*.json")}
    assert set(committed) == set(rendered), "dashboards/*.json and generate.DASHBOARDS differ"
    stale = [name for name, text in rendered.items() if committed[name] != text]
    assert not stale, f"stale: {stale}; run `python dashboards/generate.py` and commit the JSON"


def test_check_mode_reports_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert GENERATE.main(["--out", str(tmp_path)]) == 0
    assert GENERATE.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "trainvitals-loss.json").write_text("{}\n")
    assert GENERATE.main(["--check", "--out", str(tmp_path)]) == 1
    assert "trainvitals-loss.json" in capsys.readouterr().err


def test_stable_uids_and_current_schema() -> None:
    dashboards = load_dashboards()
    assert {name: d["uid"] for name, d in dashboards.items()} == UIDS
    for name, d in dashboards.items():
        assert len(d["uid"]) <= 40, f"{name}: Grafana uids are at most 40 characters"
        # Grafana 11 writes schema 39-41; older numbers get migrated on load.
        assert d["schemaVersion"] >= 39, f"{name}: schemaVersion {d['schemaVersion']}"
        assert "id" not in d or d["id"] is None, f"{name}: a fixed id clashes across Grafana instances"
        assert TAG in d["tags"]


def test_variables_datasource_and_units() -> None:
    for name, d in load_dashboards().items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        ds = variables.get("datasource")
        assert ds is not None and ds["type"] == "datasource" and ds["query"] == "prometheus", name
        assert "run" in variables, f"{name}: no run variable"
        used = {v for e in _exprs(d) for v in re.findall(r"\$(\w+)", e)} - {"__rate_interval"}
        assert used <= set(variables), f"{name}: queries use undefined variables {used - set(variables)}"
        unused = set(variables) - used - {"datasource"}
        assert not unused, f"{name}: variables no query uses: {unused}"
        ids = []
        for p in panels(d):
            title = f"{name} / {p['title']}"
            ids.append(p["id"])
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
            unit = p["fieldConfig"]["defaults"].get("unit")
            assert unit, f"{title}: no unit"
            assert unit in set(GENERATE.UNITS.values()) | {GENERATE.RATE_UNIT, "s", "short"}, (title, unit)
            assert p.get("description"), f"{title}: no description"
            assert p["targets"] and all(t.get("refId") for t in p["targets"]), title
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
    found = {v["name"] for d in load_dashboards().values() for v in d["templating"]["list"]}
    assert {"datasource", "run", "modality", "task", "param"} <= found


def test_units_follow_the_catalogue() -> None:
    """A panel that plots one catalogue metric as it is has that metric's unit."""
    checked = 0
    for name, d in load_dashboards().items():
        for p in panels(d):
            exprs = [t["expr"] for t in p["targets"]]
            plain = [re.fullmatch(rf"(?:topk\(\d+, )?{PREFIX}(\w+)\{{[^}}]*\}}\)?", e) for e in exprs]
            if all(plain) and len({m.group(1) for m in plain}) == 1:  # type: ignore[union-attr]
                metric = plain[0].group(1)  # type: ignore[union-attr]
                assert p["fieldConfig"]["defaults"]["unit"] == GENERATE.UNITS[METRICS[metric].unit], (
                    f"{name} / {p['title']}: unit of {metric}"
                )
                checked += 1
    assert checked > 30


def test_only_catalogue_metrics_and_every_one_on_a_panel() -> None:
    families = {PREFIX + name for name in METRICS}
    shown: set[str] = set()
    for name, d in load_dashboards().items():
        for expr in _exprs(d):
            names = set(_METRIC_NAME.findall(expr))
            unknown = names - families
            assert not unknown, f"{name}: {expr!r} uses names outside the catalogue: {unknown}"
            shown |= names
    missing = sorted(families - shown - {PREFIX + n for n in GENERATE.NOT_ON_DASHBOARDS})
    assert not missing, (
        f"catalogue metrics on no dashboard panel: {missing}; add a panel in "
        "dashboards/generate.py (or list the metric in NOT_ON_DASHBOARDS with why)"
    )


# What each dashboard must show, as the metrics it must query.
REQUIRED = {
    "trainvitals-overview.json": ["step", "last_report_timestamp_seconds", "alerts_firing", "loss", "grad_norm"],
    "trainvitals-loss.json": [
        "modality_sample_share_ratio",
        "modality_grad_share_ratio",
        "modality_dilution_ratio",
        "loss_norm_exponent",
        "loss_weight_mass",
        "microbatches",
        "token_weight_spread_ratio",
    ],
    "trainvitals-params.json": [
        "param_drift_log2",
        "param_drift_consistency_ratio",
        "param_weight_decay",
        "adam_eps_dominated_ratio",
        "adam_normalized_update_rms",
    ],
    "trainvitals-softmax.json": [
        "softmax_top1_prob_mean",
        "softmax_saturated_ratio",
        "softmax_entropy_nats",
        "distill_top1_grad_share_ratio",
    ],
}


def test_each_dashboard_shows_what_it_is_for() -> None:
    dashboards = load_dashboards()
    for name, metrics in REQUIRED.items():
        text = " ".join(_exprs(dashboards[name]))
        missing = [m for m in metrics if not re.search(rf"\b{PREFIX}{m}\b", text)]
        assert not missing, f"{name}: no panel queries {missing}"
    softmax_legends = [
        t["legendFormat"]
        for p in panels(dashboards["trainvitals-softmax.json"])
        for t in p["targets"]
        if "softmax_" in t["expr"]
    ]
    assert all("{{task}}" in lf and "{{role}}" in lf for lf in softmax_legends), softmax_legends


def test_a_threshold_line_sits_where_its_rule_fires() -> None:
    d = load_dashboards()["trainvitals-loss.json"]
    dilution = next(p for p in panels(d) if p["title"] == "Dilution against the intended normalization")
    assert "trainvitals_modality_excess_dilution_ratio" in dilution["targets"][0]["expr"]  # what pages
    steps = dilution["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, 5]  # GradientDilution: above 5
    mass = next(p for p in panels(d) if p["title"] == "Loss weight mass")
    steps = mass["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [(s["value"], s["color"]) for s in steps] == [(None, "orange"), (0.5, "green"), (1.5, "red")]


def test_a_metric_without_a_curated_panel_gets_one_on_its_groups_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainvitals.wire import MetricSpec

    spec = MetricSpec(
        "probe_share_ratio", "gauge", "Share of something per modality.", "ratio", ("modality",), "hooks", "loss"
    )
    monkeypatch.setitem(METRICS, spec.name, spec)
    boards = GENERATE.boards()
    auto = {p.title: p for b in boards.values() for p in b.auto}
    curated = {
        name
        for b in boards.values()
        for _, panels in b.rows
        for p in panels
        for expr, _ in p.queries
        for name in re.findall(rf"\b{PREFIX}(\w+)", expr)
    }
    assert "probe_share_ratio" in auto and not set(auto) & curated
    assert auto["probe_share_ratio"] in boards["trainvitals-loss.json"].auto
    ((expr, legend),) = auto["probe_share_ratio"].queries
    assert expr == f'{PREFIX}probe_share_ratio{{run=~"$run", modality=~"$modality"}}'
    assert legend == "{{run}} {{modality}}"
    assert auto["probe_share_ratio"].grafana_unit() == "percentunit"
    built = boards["trainvitals-loss.json"].build().build()
    titles = [p.title for p in built.panels]
    assert titles.index(GENERATE.AUTO_ROW) < titles.index("probe_share_ratio")


def _rules():
    from trainvitals.alerts import resolve_rules
    from trainvitals.alerts.model import ThresholdRule

    return [r for r in resolve_rules("default") if isinstance(r, ThresholdRule)]


def test_every_metric_a_default_rule_pages_or_warns_on_has_a_curated_panel_with_its_line() -> None:
    curated = [
        p
        for d in load_dashboards().values()
        for row in d["panels"]
        if row.get("type") == "row" and row["title"] != GENERATE.AUTO_ROW
        for p in row.get("panels", [])
    ] + [p for d in load_dashboards().values() for p in d["panels"] if p.get("type") != "row"]
    for rule in _rules():
        if rule.severity not in ("page", "warning", "critical", "error") or rule.transform != "value":
            continue  # a ratio to a median or an increase has no line on the raw series
        shown = [p for p in curated if re.search(rf"\b{PREFIX}{rule.metric}\b", " ".join(_target_exprs(p)))]
        assert shown, f"{rule.alert}: no curated panel shows {rule.metric}"
        lines = [s["value"] for p in shown for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"]]
        assert rule.threshold in lines, f"{rule.alert}: no panel of {rule.metric} draws {rule.threshold}"


def _target_exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel.get("targets", [])]


def test_one_definition_per_metric_in_help_docs_and_dashboards() -> None:
    from trainvitals.monitor.exposition import _help
    from trainvitals.wire.reference import reference_markdown

    docs = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    assert docs == reference_markdown()  # docs/metrics.md is the table's
    descriptions = [(p, p.get("description", "")) for d in load_dashboards().values() for p in panels(d)]
    for name, spec in METRICS.items():
        assert _help(name) == spec.help  # the HELP line on /metrics
        assert spec.help.replace("|", "\\|") in docs, name
        for panel, text in descriptions:
            if any(re.search(rf"\b{PREFIX}{name}\b", e) for e in _target_exprs(panel)) and f"{PREFIX}{name}:" in text:
                assert f"{PREFIX}{name}: {spec.help}" in text, (panel["title"], name)
    # Every panel of one metric states that metric's definition.
    for panel, text in descriptions:
        names = {n for e in _target_exprs(panel) for n in re.findall(rf"\b{PREFIX}(\w+)", e)}
        plain = all(e.startswith(PREFIX) or e.startswith("topk(") for e in _target_exprs(panel))
        if len(names) == 1 and (only := names.pop()) in METRICS and plain:
            assert f"{PREFIX}{only}: {METRICS[only].help}" in text, (panel["title"], only)
    # The drift metric's two old definitions are gone.
    everything = docs + " ".join(t for _, t in descriptions)
    assert "absmax at attach" not in everything and "log2 of absmax over absmax" not in everything
