"""A framework job run in a fresh Python (its script writes its truth as JSON), and the
reports it wrote (JSONL, the default sink) read back and judged by the default rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainvitals.alerts import Engine, resolve_rules
from trainvitals.wire.schema import Report, ends_run


def run_script(script: Path, tmp_path: Path, *options: str, timeout: float = 600) -> dict:
    """``python SCRIPT TMP/result.json OPTIONS...`` in ``tmp_path``, offline (no Hub); fails
    the test with the output's tail on a non-zero exit; returns the JSON it wrote. A fresh
    process: a Trainer changes the working folder and global state."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(script), str(out), *options],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def read_reports(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def figures(reports: list[dict], name: str, **labels: str) -> dict[int, float]:
    """Step -> value of one series over the reports."""
    return {
        r["step"]: s["value"]
        for r in reports
        for s in r.get("samples", [])
        if s["name"] == name and s["labels"] == labels
    }


def firing(reports: list[dict]) -> set[str]:
    """Names of the default rules firing at the run's last step: every report evaluated in
    order but the one ``Monitor.close()`` sends (a run's end resolves its alerts)."""
    engine = Engine(resolve_rules("default"))
    for i, r in enumerate(reports):
        report = Report.model_validate(r)
        if not ends_run(report):
            engine.observe(report, now=1000.0 + i)
    return {a.rule.alert for a in engine.firing()}


LOSS_RULES = {"MeanOfMeansLoss", "LossNotAccumNormalized", "LossWeightMassLow", "GradientDilution"}
