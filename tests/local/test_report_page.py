"""The report page: ``trainvitals report`` writes one self-contained HTML file, the
collector serves the same page for live runs. Loaded in Debian's headless chromium:
the DOM shows the incident and the plots, a screenshot is taken, and the page makes no
request outside the file (outside the collector, for the live page)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
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


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pages")
    return {name: record(folder, name) for name in ("i1", "i2", "healthy")}


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
    builder, history = VerdictBuilder("default"), RunHistory()
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
