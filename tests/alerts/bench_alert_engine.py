"""Cost of rule evaluation on the collector's ingest path, per report and per sample.

Run: ``python tests/alerts/bench_alert_engine.py [--reports 200]``.

Reports of 2,000 samples shaped like a real one (per-parameter statistics for 170
1D parameters, modality and loss series) go through ``Engine.observe`` with the
default rules. "healthy": nothing past a threshold (the common case, a fast path);
"alarming": random values, so a third of the parameter series are past a
threshold and their ``and`` conditions are looked up on every report.
"""

from __future__ import annotations

import argparse
import random
import time

from trainvitals.alerts.engine import Engine
from trainvitals.alerts.loading import resolve_rules
from trainvitals.wire import Report, Sample

PARAM_METRICS = [
    "param_min",
    "param_max",
    "param_absmax",
    "param_drift_log2",
    "param_grad_relative_rms",
    "param_drift_consistency_ratio",
    "param_weight_decay",
    "adam_eps_dominated_ratio",
    "adam_normalized_update_rms",
    "adam_exp_avg_norm",
    "adam_exp_avg_sq_norm",
]


def make_report(step: int, value) -> Report:
    samples = [
        Sample(name=n, labels={"param": f"layers.{p}.norm.weight"}, value=value())
        for p in range(180)
        for n in PARAM_METRICS
    ]
    for m in ("text", "image"):
        for n in ("modality_dilution_ratio", "modality_sample_share_ratio", "modality_grad_share_ratio", "loss"):
            samples.append(Sample(name=n, labels={"modality": m}, value=1.0))
    samples += [
        Sample(name="grad_norm_max", labels={}, value=1.0),
        Sample(name="loss_weight_mass", labels={}, value=1.0),
        Sample(name="nonfinite_total", labels={"what": "loss"}, value=0.0),
    ]
    return Report(run="bench", step=step, time=0.0, samples=samples[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    for label, value in (("healthy", lambda: 0.0), ("alarming", rng.random)):
        reports = [make_report(i * 10, value) for i in range(args.reports)]
        engine = Engine(resolve_rules("default"))
        start = time.perf_counter()
        for i, r in enumerate(reports):
            engine.observe(r, now=1000.0 + i)
        elapsed = time.perf_counter() - start
        n = sum(len(r.samples) for r in reports)
        print(
            f"{label:9s} {elapsed / len(reports) * 1e3:6.2f} ms/report  "
            f"{elapsed / n * 1e9:6.0f} ns/sample  {n / elapsed / 1e6:5.2f} M samples/s"
        )


if __name__ == "__main__":
    main()
