"""megatron-core 0.16.1's ``GPTModel`` with ``tensor_model_parallel_size=2`` on two gloo
ranks (``_megatron_job`` with ``tp=2``): Megatron's shards are plain tensors marked
``tensor_model_parallel`` / ``partition_dim``, its gradients in ``main_grad``. Every
optimizer/params/adam figure of rank 0 is checked against the same figure computed with
plain torch from the full tensors (each split gathered over the tensor-parallel group
along its ``partition_dim``; ``tests/hooks/_tp_models.truth``): a split counts once per
rank, a replicated norm or row-parallel bias once in all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_configure._helpers import job_env

HERE = Path(__file__).resolve().parent
JOB = HERE / "_megatron_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # Megatron, ranks, a launcher


def _run(tmp_path: Path, *options: str) -> dict:
    out = tmp_path / "result.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [*launcher, str(JOB), str(out), *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=job_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    return result


def test_every_figure_matches_the_gathered_full_tensors(tmp_path):
    got = _run(tmp_path, "per_token=1", "mode=attach", "steps=4", "tp=2", "figures=1", "logits=0")
    assert all(got["coverage"][s]["active"] for s in ("optimizer", "params", "adam"))
    assert len(got["reports"]) == len(got["truths"]) == 4
    kinds = {key.split("|")[0] for key in got["truths"][0]}
    assert {"grad_norm", "group_grad_norm", "param_norm", "update_ratio", "param_grad_relative_rms"} <= kinds
    assert {"param_min", "param_max", "param_absmax", "param_drift_log2", "adam_exp_avg_norm"} <= kinds
    assert {"adam_exp_avg_sq_norm", "adam_eps_dominated_ratio", "adam_normalized_update_rms"} <= kinds
    # a 1D split (column-parallel bias) and a replicated norm are among the figures checked
    assert "param_max|param=decoder.layers.0.mlp.linear_fc1.bias" in got["truths"][0]
    assert "param_max|param=decoder.final_layernorm.weight" in got["truths"][0]
    for k, (report, truth) in enumerate(zip(got["reports"], got["truths"], strict=True)):
        for key, want in truth.items():
            assert key in report, (k, key)
            assert report[key] == pytest.approx(want, rel=1e-4, abs=1e-12), (k, key)
