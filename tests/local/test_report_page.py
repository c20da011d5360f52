"""The report page: ``trainvitals report`` writes one self-contained HTML file, the
collector serves the same page for live runs. Loaded in Debian's headless chromium:
the DOM shows the incident and the plots, a screenshot is taken, and the page makes no
request outside the file (outside the collector, for the live page)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tests.browser import browser
from tests.e2e._jobs import DilutionJob
from tests.local._recorded import record
from tests.support import needs_tools, running_collector, wait_until
from trainvitals.alerts.verdict import VerdictBuilder
from trainvitals.monitor.cli import main
from trainvitals.monitor.report_page import MAX_BUCKETS, RunHistory, render_page
from trainvitals.wire import Report

READ = "read-tok-Pg7q"
RULES = Path(__file__).parents[2] / "alerts" / "rules"


def _data(page: str) -> dict:
    return json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page).group(1))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pages")
    return {name: record(folder, name) for name in ("i1", "i2", "healthy", "spike")}


def _report(files: dict[str, Path], out: Path, *names: str) -> Path:
    result = CliRunner().invoke(main, ["report", *(str(files[n]) for n in names), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"written to {out}" in result.output
    return out


def _facts(b) -> dict:
    """What the DOM shows, per run section."""
    return b.evaluate(
        """Array.from(document.querySelectorAll('section.run')).map(s => ({
            run: s.dataset.run,
            verdict: s.querySelector('[data-role=verdict]').textContent,
            incidents: Array.from(s.querySelectorAll('tr.incident')).map(r =>
                Array.from(r.querySelectorAll('td')).slice(0, 7).map(td => td.textContent)),
            timeline: s.querySelectorAll('.tl-bar').length,
            coverage: s.querySelector('[data-role=coverage]').textContent,
            plots: Array.from(s.querySelectorAll('figure.plot')).map(f => ({
                panel: f.dataset.panel, canvas: f.querySelectorAll('canvas').length,
                series: Array.from(f.querySelectorAll('.u-series th .u-label')).map(l => l.textContent)})),
        }))"""
    )


def test_the_page_is_self_contained_and_bounded(files: dict[str, Path], tmp_path: Path):
    page = _report(files, tmp_path / "r.html", "i1", "i2").read_text()
    # Every script and style is inline; nothing names a resource elsewhere.
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", page)
    assert "default-src 'none'" in page and "connect-src 'none'" in page
    data = json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page).group(1))
    (i1, i2) = data["runs"]
    assert i1["verdict"]["incidents"][0]["alert"] == "GradientDilution"
    panels = {p["key"]: p for p in i1["panels"]}
    dilution = panels["dilution"]
    assert {"alert": "GradientDilution", "value": 5.0, "kind": "above", "clear": 3.0}.items() <= dilution["thresholds"][
        0
    ].items()
    series = {s["label"]: s for s in dilution["series"]}
    assert series["modality_excess_dilution_ratio{modality=image}"]["incident"] is True
    assert max(v for v in series["modality_excess_dilution_ratio{modality=image}"]["values"] if v) == pytest.approx(
        16.96, abs=0.01
    )
    assert {"loss_mass", "grad_norm"} <= {p["key"] for p in i2["panels"]}
    # A bad file: exit 2 naming the line, nothing written.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run": "x"}\n')
    result = CliRunner().invoke(main, ["report", str(bad), "-o", str(tmp_path / "bad.html")])
    assert result.exit_code == 2 and f"{bad}:1:" in result.output and not (tmp_path / "bad.html").exists()


def test_history_keeps_an_envelope_of_bounded_size():
    history = RunHistory()
    for step in range(1, 20_001):
        value = 1000.0 if step == 12_345 else (-5.0 if step == 777 else 1.0)
        history.add(Report(run="r", step=step, time=0.0, samples=[{"name": "grad_norm", "value": value}]))
    (series,) = history.runs["r"]["grad_norm"].values()
    assert len(series.steps) <= MAX_BUCKETS
    assert max(series.hi) == 1000.0 and min(series.lo) == -5.0  # the spike and the dip survive
    assert series.steps[0] == 1.0 and list(series.steps) == sorted(series.steps)


@needs_tools("chromium")
def test_the_report_file_in_chromium(files: dict[str, Path], tmp_path: Path):
    out = _report(files, tmp_path / "report.html", "i1", "healthy")
    with browser() as b:
        b.open(out.as_uri())
        facts = _facts(b)
        shot = b.screenshot(tmp_path / "report.png")
        requests, console = b.requests, b.console
    assert requests == [out.as_uri()]  # the file itself, nothing else
    assert console == []  # no script error, no CSP refusal
    i1, healthy = facts
    assert i1["run"] == "i1" and i1["verdict"].startswith("1 incident(s), 1 of severity page in 25 reports")
    assert i1["incidents"] == [["GradientDilution", "page", "modality=image", "21", "24", "16.96", "firing"]]
    assert i1["timeline"] == 1
    # What was watched, from the reports' coverage entries.
    assert "loss (active in 24 of 24 reports)" in i1["coverage"] and "softmax: not_requested" in i1["coverage"]
    plots = {p["panel"]: p for p in i1["plots"]}
    assert plots["dilution"]["canvas"] >= 1
    assert "modality_excess_dilution_ratio{modality=image}" in plots["dilution"]["series"]
    assert {"grad_share", "loss_mass", "drift", "adam_eps", "grad_norm"} <= set(plots)
    assert healthy["verdict"].startswith("No incident in 31 reports")
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_tools("chromium")
def test_the_request_check_catches_a_page_that_fetches(files: dict[str, Path], tmp_path: Path):
    """The control: the same page without its policy and with one outside image is caught."""
    page = _report(files, tmp_path / "r.html", "i1").read_text()
    page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page)
    leaky = tmp_path / "leaky.html"
    leaky.write_text(page.replace("<main>", '<main><img src="http://198.51.100.7/pixel.png">', 1))
    with browser() as b:
        b.open(leaky.as_uri(), settle=0.5)
        assert "http://198.51.100.7/pixel.png" in b.requests


@needs_tools("chromium")
def test_the_collectors_live_pages_in_chromium(tmp_path: Path):
    job = DilutionJob()
    with running_collector(read_token=READ) as c:
        mon = job.attach(c.url, "live/i1")
        job.train(mon, 22)
        assert mon.flush(30)
        auth = {"Authorization": f"Bearer {READ}"}
        assert c.client.get("/").status_code == 401
        assert 'Basic realm="trainvitals"' in c.client.get("/runs/live/i1").headers.get_list("www-authenticate")[1]
        assert c.client.get("/runs/nope", headers=auth).status_code == 404
        assert c.client.get("/docs", headers=auth).status_code == 404  # interactive docs off (CDN scripts)
        with browser() as b:
            b.credentials = ("anyone", READ)  # the read token as a Basic password
            b.open(f"{c.url}/", settle=0.2)
            row = b.evaluate(
                "Array.from(document.querySelectorAll('tr.run')).map(r => r.textContent + '|' + r.dataset.run)"
            )
            assert row == ["live/i122reportingGradientDilution (modality=image)|live/i1"]
            b.open(f"{c.url}/runs/live/i1", settle=0.5)
            (facts,) = _facts(b)
            assert facts["incidents"] == [["GradientDilution", "page", "modality=image", "21", "22", "16.96", "firing"]]
            assert any(p["panel"] == "dilution" and p["canvas"] for p in facts["plots"])
            # Reports keep arriving: the open page redraws from the collector.
            job.train(mon, 5)
            assert mon.flush(30)
            wait_until(lambda: b.pump(0.5) or "27" in _facts(b)[0]["incidents"][0][4], 60, "the page to update")
            b.screenshot(tmp_path / "live.png")
            requests, console = b.requests, b.console
        mon.close()
    assert console == []
    assert requests and all(u.startswith(c.url + "/") for u in requests), requests
    assert f"{c.url}/runs/live/i1?format=json" in requests  # it refetched its data from where it came


def test_report_of_many_series_stays_small():
    """200 series over 10,000 steps: the page draws at most a few per plot, bucketed."""
    builder = VerdictBuilder("default")
    history = RunHistory(rules=builder.rules)
    for step in range(1, 10_001, 5):
        samples = [
            {"name": "param_drift_log2", "labels": {"param": f"p{i}"}, "value": 0.001 * i + 1e-4 * step}
            for i in range(100)
        ]
        samples += [
            {"name": "adam_eps_dominated_ratio", "labels": {"param": f"p{i}"}, "value": (i % 7) / 10}
            for i in range(100)
        ]
        report = Report(run="big", step=step, time=float(step), samples=samples)
        builder.observe(report)
        history.add(report)
    page = render_page(builder, history, title="big")  # timed in tests/benchmarks/bench_report_page.py
    assert len(page.encode()) < 3_000_000
    data = json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page).group(1))
    drift = next(p for p in data["runs"][0]["panels"] if p["key"] == "drift")
    assert len(drift["series"]) == 8 and drift["left_out"] == 92
    assert drift["series"][0]["label"] == "param_drift_log2{param=p99}"  # the most extreme first


def test_chromium_is_in_ci():
    ci = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    assert re.search(r"apt-get install[^\n]*\bchromium\b", ci)


def _grad_norm_max(path: Path) -> list[tuple[int, float]]:
    """(step, grad_norm_max) of each report in a recorded file, read as plain JSON."""
    out = []
    for line in path.read_text().splitlines():
        report = json.loads(line)
        for sample in report["samples"]:
            if sample["name"] == "grad_norm_max" and not sample.get("labels"):
                out.append((report["step"], sample["value"]))
    return out


def test_a_ratio_to_median_threshold_is_drawn_in_the_plots_unit(files: dict[str, Path], tmp_path: Path):
    """GradNormSpike fires when grad_norm_max is over 10x the median of its previous 20
    reports: the page draws that moving line (and the clear line, 3x), never a constant
    at 10; the value crosses the line exactly where the alert fired."""
    data = _data(_report(files, tmp_path / "r.html", "spike").read_text())
    (run,) = data["runs"]
    (incident,) = run["verdict"]["incidents"]
    assert (incident["alert"], incident["first_step"]) == ("GradNormSpike", 27)
    panel = next(p for p in run["panels"] if p["key"] == "grad_norm")
    assert [t for t in panel["thresholds"] if t["alert"] == "GradNormSpike"] == []  # no line at 10
    x = panel["x"]
    lines = {s["threshold"]["kind"]: s["values"] for s in panel["series"] if s.get("threshold")}
    assert set(lines) == {"above", "clear"}
    # The truth: the rule's median, from the file (the previous 20 values, from the 6th report).
    values = _grad_norm_max(files["spike"])
    expected_fire, expected_clear, crossed = {}, {}, []
    for k, (step, value) in enumerate(values):
        if k >= 5:
            med = statistics.median(v for _, v in values[max(0, k - 20) : k])
            expected_fire[step], expected_clear[step] = 10 * med, 3 * med
            if value > 10 * med:
                crossed.append(step)
    for kind, expected in (("above", expected_fire), ("clear", expected_clear)):
        drawn = {int(step): v for step, v in zip(x, lines[kind], strict=True) if v is not None}
        assert drawn.keys() == expected.keys()
        assert all(drawn[s] == pytest.approx(expected[s], rel=1e-5) for s in expected)
    assert crossed == [27]
    assert any("GradNormSpike compares grad_norm_max to its median" in n for n in panel["notes"])


def test_every_drawn_constant_is_on_the_plotted_scale(files: dict[str, Path], tmp_path: Path):
    """The audit of the default rules: a constant line comes only from a rule (or an `and`
    condition) on the metric's value as reported; a rule on a transform of the value is
    drawn as its own series or named in the caption as not drawn."""
    rules = [r for f in sorted(RULES.glob("*.yaml")) for r in yaml.safe_load(f.read_text())]
    on_value = {
        (r["alert"], r["metric"], k, r[k])
        for r in rules
        if "metric" in r and r.get("transform", "value") == "value"
        for k in ("above", "below")
        if k in r
    }
    on_value |= {
        (r["alert"], c["metric"], k, c[k])
        for r in rules
        for c in r.get("and", ())
        for k in ("above", "below")
        if k in c
    }
    transformed = {(r["alert"], r["metric"]) for r in rules if r.get("transform", "value") != "value"}
    data = _data(_report(files, tmp_path / "r.html", "i1", "i2", "spike").read_text())
    seen_transformed = set()
    for run in data["runs"]:
        for panel in run["panels"]:
            for t in panel["thresholds"]:
                assert (t["alert"], t["metric"], t["kind"], t["value"]) in on_value, t
            metrics = {s["metric"] for s in panel["series"]}
            for alert, metric in transformed:
                if metric in metrics:
                    seen_transformed.add(alert)
                    drawn = any((s.get("threshold") or {}).get("alert") == alert for s in panel["series"])
                    assert drawn or any(n.startswith(alert) and "not drawn" in n for n in panel["notes"]), alert
    assert seen_transformed == {"GradNormSpike"}


def test_a_constant_with_a_label_matcher_says_which_series_it_is_for():
    """SoftmaxSaturation watches the series of threshold 0.99 only: drawn over the 0.999
    series too, its line says so; with no 0.99 series drawn, it is not drawn."""
    builder = VerdictBuilder("default")
    history = RunHistory(rules=builder.rules)
    for step in range(1, 4):
        samples = [
            {
                "name": "softmax_saturated_ratio",
                "labels": {"task": "t", "role": "student", "threshold": th},
                "value": 0.5,
            }
            for th in ("0.99", "0.999")
        ]
        report = Report(run="both", step=step, time=float(step), samples=samples)
        builder.observe(report)
        history.add(report)
        only = Report(run="only", step=step, time=float(step), samples=samples[1:])
        builder.observe(only)
        history.add(only)
    data = _data(render_page(builder, history, title="t"))
    both, only_999 = ({p["key"]: p for p in r["panels"]}["softmax"] for r in data["runs"])
    (line,) = both["thresholds"]
    assert (line["alert"], line["value"], line["only"]) == ("SoftmaxSaturation", 0.9, "threshold=0.99")
    assert only_999["thresholds"] == []


_LABEL_BOXES = """Array.from(document.querySelectorAll('figure.plot')).map(f => {
    const box = r => ({top: r.top, bottom: r.bottom, left: r.left, right: r.right});
    return {panel: f.dataset.panel, run: f.closest('section.run').dataset.run, figure: box(f.getBoundingClientRect()),
            listed: f.querySelectorAll('.th-list .th-label').length,
            labels: Array.from(f.querySelectorAll('.th-label')).map(l => ({text: l.textContent,
                value: +l.dataset.value, ...box(l.getBoundingClientRect())}))};
})"""


def _overlaps(a: dict, b: dict) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


def _crowd_rules(path: Path) -> Path:
    """The default rules, and 30 more on loss_weight_mass 0.01 apart: too many labels to
    fit beside their lines."""
    crowd = [
        {"alert": f"Crowd{i:02d}", "metric": "loss_weight_mass", "above": round(1.3 + 0.01 * i, 2), "summary": "x"}
        for i in range(30)
    ]
    path.write_text(
        yaml.safe_dump([r for f in sorted(RULES.glob("*.yaml")) for r in yaml.safe_load(f.read_text())] + crowd)
    )
    return path


@needs_tools("chromium")
@pytest.mark.parametrize("width", [1280, 700])
def test_threshold_labels_never_overlap_in_chromium(files: dict[str, Path], tmp_path: Path, width: int):
    """Every threshold label is an element of the page; in Chromium no two label boxes
    intersect and each stays inside its plot's figure: close thresholds (the loss-mass
    plot's 1.2/1.5 and 0.5/0.8) are pushed apart, and labels too many for the plot's
    height are listed under it."""
    out = _report(files, tmp_path / "r.html", "i1", "i2", "spike")
    crowded = tmp_path / "crowd.html"
    result = CliRunner().invoke(
        main, ["report", str(files["i2"]), "--rules", str(_crowd_rules(tmp_path / "crowd.yaml")), "-o", str(crowded)]
    )
    assert result.exit_code == 0, result.output
    figures = []
    for page in (out, crowded):
        expected = {
            (r["verdict"]["run"], p["key"]): {
                v for t in p["thresholds"] for v in (t["value"], t["clear"]) if v is not None
            }
            for r in _data(page.read_text())["runs"]
            for p in r["panels"]
        }
        with browser() as b:
            b.open(page.as_uri(), width=width)
            shown = b.evaluate(_LABEL_BOXES)
            assert b.console == []
        for fig in shown:
            # One label per distinct threshold value of the plot, whatever the data's range.
            assert {lab["value"] for lab in fig["labels"]} == expected[(fig["run"], fig["panel"])], fig
            f = fig["figure"]
            for lab in fig["labels"]:
                assert f["left"] <= lab["left"] and lab["right"] <= f["right"], (fig["panel"], lab)
                assert f["top"] <= lab["top"] and lab["bottom"] <= f["bottom"], (fig["panel"], lab)
        on_page = [(fig["panel"], lab) for fig in shown for lab in fig["labels"]]
        for i, (pa, a) in enumerate(on_page):
            for pb, b in on_page[i + 1 :]:
                assert not _overlaps(a, b), (pa, a, pb, b)
        figures += shown
    assert sum(len(fig["labels"]) for fig in figures) > 40
    crowd = next(f for f in figures if f["panel"] == "loss_mass" and any("Crowd" in lab["text"] for lab in f["labels"]))
    assert crowd["listed"] == len(crowd["labels"]) >= 30  # too many for the plot: listed under it
    mass = next(f for f in figures if f["run"] == "i2" and f["panel"] == "loss_mass" and not f["listed"])
    assert (
        len(mass["labels"]) == 4
    )  # 1.5, 1.2 (LossNotAccumNormalized), 0.5, 0.8 (LossWeightMassLow): beside their lines
