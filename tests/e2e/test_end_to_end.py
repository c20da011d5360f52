"""A real training job (the README's example) streams to a real collector on port 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support import dead_url, metric_value, needs_tools, require_tool, running_collector
from trainvitals.hooks import attach

ROOT = Path(__file__).resolve().parents[2]


def test_readme_example_reaches_metrics_with_the_reference_grad_norm():
    with running_collector() as collector:
        env = {**os.environ, "TRAINVITALS_COLLECTOR": collector.url}
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "minimal.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        ref = float(re.search(r"grad_norm (\S+)", out.stdout).group(1))
        text = collector.metrics()
        runs = collector.client.get("/v1/runs").json()
    assert metric_value(text, "trainvitals_grad_norm", run="minimal") == pytest.approx(ref, rel=1e-6)
    assert metric_value(text, "trainvitals_step", run="minimal") == 20
    assert [r["run"] for r in runs] == ["minimal"] and runs[0]["step"] == 20
    assert "Traceback" not in out.stderr


@needs_tools("promtool")
def test_metrics_of_a_real_job_pass_promtool():
    promtool = require_tool("promtool")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with running_collector() as collector:
        with attach(model, opt, run="lint", collector=collector.url, every=1) as mon:
            for _ in range(3):
                model(torch.randn(5, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            assert mon.flush(60)
        text = collector.metrics()
    assert "trainvitals_grad_norm" in text
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_example_trains_to_the_end_with_the_collector_down(tmp_path):
    env = {**os.environ, "TRAINVITALS_COLLECTOR": dead_url()}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "minimal.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "step 20 grad_norm" in out.stdout
    assert "Traceback" not in out.stderr
