"""Tensor parallelism, two gloo ranks on the CPU: a tiny decoder split by DTensor
``parallelize_module`` (q/k/v and the MLP's up projection column-wise, o and down
row-wise) beside plain replicated tensors (embedding, RMSNorms, head, a ``[1]`` gain).
Every optimizer/params/adam figure of rank 0 is checked against the same figure
computed with plain torch from the full tensors in the ranks (``tests/hooks/_tp_models.py``):
a sharded piece counts once per rank, a replicated one once in all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.hooks._tp_models import EVERY, STEPS
from tests.support import run_ranks as run_rank_processes

HERE = Path(__file__).resolve().parent
WORLD = 2
TIMEOUT_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]


def run_ranks(tmp_path: Path, mode: str) -> dict:
    return run_rank_processes(HERE / "_tp_models.py", tmp_path / "rank0.json", mode, world=WORLD, timeout=TIMEOUT_S)


def test_every_figure_matches_the_full_tensors(tmp_path):
    got = run_ranks(tmp_path, "tp")
    assert all(got["coverage"][s]["active"] for s in ("optimizer", "params", "adam"))
    assert len(got["reports"]) == len(got["truths"]) == 1 + STEPS // EVERY  # steps 1, 2, 4, 6
    kinds = {key.split("|")[0] for key in got["truths"][0]}
    assert {"grad_norm", "group_grad_norm", "param_norm", "update_ratio", "param_grad_relative_rms"} <= kinds
    assert {"param_min", "param_max", "param_absmax", "param_drift_log2", "adam_exp_avg_norm"} <= kinds
    assert {"adam_exp_avg_sq_norm", "adam_eps_dominated_ratio", "adam_normalized_update_rms"} <= kinds
    # the eps-dominated share of the matrices is a fraction, not 0 or 1: its counts are checked
    assert 0 < got["truths"][0]["adam_eps_dominated_ratio|group=decay"] < 1
    for k, (report, truth) in enumerate(zip(got["reports"], got["truths"], strict=True)):
        for key, want in truth.items():
            assert key in report, (k, key)
            assert report[key] == pytest.approx(want, rel=1e-4, abs=1e-12), (k, key)


def test_a_mesh_not_spanning_the_job_withholds_the_figures(tmp_path):
    """The gain on a one-rank mesh in a job of two: what its sums over the job mean is
    unknown, so the optimizer, params and adam figures are withheld, coverage says why."""
    got = run_ranks(tmp_path, "submesh")
    for signal in ("optimizer", "params", "adam"):
        entry = got["coverage"][signal]
        assert (entry["active"], entry["reason"]) == (False, "sharded")
        assert "gain" in entry["detail"] and "mesh of 1 ranks in a job of 2" in entry["detail"]
    for report in got["reports"]:
        withheld = [k for k in report if k.startswith(("grad_norm", "group_", "param_", "update_ratio", "adam_"))]
        assert withheld == []


def test_a_gradient_placed_unlike_its_parameter_withholds_the_gradient_figures(tmp_path):
    """A ``Replicate`` gain whose gradient stays ``Partial`` (as SequenceParallel leaves
    norm weights' gradients): the ranks' pieces of its gradient do not give its norm, so
    the optimizer figures and ``param_grad_relative_rms`` are withheld, the rest stand."""
    got = run_ranks(tmp_path, "partial-grad")
    entry = got["coverage"]["optimizer"]
    assert (entry["active"], entry["reason"]) == (False, "sharded")
    assert "gain" in entry["detail"] and "Partial" in entry["detail"]
    assert got["coverage"]["params"]["active"] and got["coverage"]["adam"]["active"]
    for report, truth in zip(got["reports"], got["truths"], strict=True):
        assert not [k for k in report if k.startswith(("grad_norm", "group_", "param_norm", "update_ratio"))]
        assert not [k for k in report if k.startswith("param_grad_relative_rms")]
        for key in [k for k in truth if k.startswith(("param_min", "param_max", "adam_exp_avg_sq_norm"))]:
            assert report[key] == pytest.approx(truth[key], rel=1e-4, abs=1e-12), key
