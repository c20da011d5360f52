"""The report page's cost: ``trainvitals report`` on a 10,000-step run with 200 series.

Run: ``python tests/benchmarks/bench_report_page.py [--steps 10000] [--every 10] [--series 200] [--rounds 3]``.

The run reports every ``--every`` steps (10: the hooks' default; 1: every step, ten
times the reports), 200 series a report: 100 parameters with ``param_drift_log2``
and ``adam_eps_dominated_ratio`` each (per-parameter metrics, the case that multiplies
series), plus the loss-accounting and optimizer figures every report carries (10
more). One parameter drifts past ParamDrift's threshold, so the page has an incident.
It is written once as a JSONL file (what a job with no collector leaves), then:

- ``file -> page``: the ``trainvitals report`` command in this process (read and
  validate every line, rules, history, render), wall time;
- ``ingest``: the verdict and history from reports already in memory (what the
  collector's pages do as reports arrive), per report;
- ``render``: the page from the history, wall time;
- the page's size in bytes, and the file's.

Medians over ``--rounds``, on one torch-free thread (nothing here uses torch). The last
line gives the figures as ``key=value``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from click.testing import CliRunner

from trainvitals.alerts.verdict import VerdictBuilder
from trainvitals.monitor.cli import main
from trainvitals.monitor.report_page import RunHistory, render_page
from trainvitals.wire import Report


def reports(steps: int, params: int, every: int = 1) -> list[dict]:
    out = []
    for step in [1, *range(every, steps + 1, every)] if every > 1 else range(1, steps + 1):
        samples = [
            {"name": "grad_norm", "labels": {}, "value": 1.0 + 0.1 * (step % 7)},
            {"name": "grad_norm_max", "labels": {}, "value": 1.2 + 0.1 * (step % 7)},
            {"name": "loss", "labels": {}, "value": 5.0 / (1 + step / 1000)},
            {"name": "loss_weight_mass", "labels": {"objective": "main"}, "value": 1.0},
            {"name": "loss_accumulation_exponent", "labels": {"objective": "main"}, "value": 0.0},
            {"name": "modality_excess_dilution_ratio", "labels": {"modality": "image"}, "value": 1.0},
            {"name": "modality_excess_dilution_ratio", "labels": {"modality": "text"}, "value": 0.9},
            {"name": "modality_dilution_ratio", "labels": {"modality": "image"}, "value": 1.0},
            {"name": "modality_grad_share_ratio", "labels": {"modality": "image"}, "value": 0.16},
            {"name": "modality_sample_share_ratio", "labels": {"modality": "image"}, "value": 0.16},
        ]
        for i in range(params):
            drift = 3.0 * step / steps if i == 0 else 1e-3 * i / params
            samples.append({"name": "param_drift_log2", "labels": {"param": f"layer{i}.bias"}, "value": drift})
            samples.append({"name": "adam_eps_dominated_ratio", "labels": {"param": f"layer{i}.bias"}, "value": 0.0})
        for i in range(1):  # the conditions ParamDrift reads, for the drifting parameter
            samples += [
                {"name": "param_drift_consistency_ratio", "labels": {"param": f"layer{i}.bias"}, "value": 0.9},
                {"name": "param_weight_decay", "labels": {"param": f"layer{i}.bias"}, "value": 0.0},
                {"name": "param_grad_relative_rms", "labels": {"param": f"layer{i}.bias"}, "value": 1e-4},
            ]
        out.append({"run": "bench", "step": step, "time": 1.7e9 + step, "samples": samples, "events": []})
    return out


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--series", type=int, default=200, help="per-parameter series (two per parameter)")
    parser.add_argument("--every", type=int, default=10, help="report interval in steps")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    params = args.series // 2
    data = reports(args.steps, params, args.every)
    series = len(data[0]["samples"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        out = Path(tmp) / "bench.html"
        file_s, ingest_s, render_s, file_cpu = [], [], [], []
        size = 0
        models = [Report.model_validate(r) for r in data]
        for _ in range(args.rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            result = CliRunner().invoke(main, ["report", str(path), "-o", str(out)])
            file_s.append(time.perf_counter() - t0)
            file_cpu.append(time.process_time() - c0)
            assert result.exit_code == 0, result.output
            size = out.stat().st_size
            builder = VerdictBuilder("default")
            history = RunHistory(rules=builder.rules)
            t0 = time.perf_counter()
            for r in models:
                builder.observe(r)
                history.add(r)
            ingest_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            page = render_page(builder, history, title="bench")
            render_s.append(time.perf_counter() - t0)
            assert [i.alert for i in builder.verdict("bench").incidents] == ["ParamDrift"], builder.verdict("bench")
        file_size = path.stat().st_size
    fmed, imed, rmed, cmed = (statistics.median(x) for x in (file_s, ingest_s, render_s, file_cpu))
    print(
        f"{'steps':>8} {'every':>6} {'series':>7} {'file MB':>8} {'file->page s':>13} {'(CPU s)':>8} "
        f"{'ingest us/report':>17} {'render s':>9} {'page MB':>8}"
    )
    print(
        f"{args.steps:>8} {args.every:>6} {series:>7} {file_size / 1e6:>8.1f} {fmed:>13.2f} {cmed:>8.2f} "
        f"{imed / len(data) * 1e6:>17.0f} {rmed:>9.3f} {size / 1e6:>8.2f}"
    )
    print(
        f"steps={args.steps} every={args.every} reports={len(data)} series={series} "
        f"file_mb={file_size / 1e6:.1f} file_to_page_s={fmed:.2f} "
        f"file_to_page_cpu_s={cmed:.2f} "
        f"ingest_us_per_report={imed / len(data) * 1e6:.0f} render_s={rmed:.3f} page_mb={size / 1e6:.2f} "
        f"page_bytes_in_memory={len(page.encode())}"
    )


if __name__ == "__main__":
    main_()
