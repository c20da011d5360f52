"""Data parallel, two gloo ranks on the CPU, the same batch on both (so the averaged
gradient is the single-process one): rank 0 reports what one process reports.
DDP: replicated parameters, nothing to combine. FSDP2 (``fully_shard``): every
parameter is a DTensor split across the ranks (the 1-element scale leaves one rank
an empty shard); minima, maxima, sums of squares and element counts are combined in
the report's one collective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.hooks._param_models import dp_single_process, grad_norm_reference
from tests.support import run_ranks as run_rank_processes

HERE = Path(__file__).resolve().parent
WORLD = 2
TIMEOUT_S = 180

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]


def run_ranks(tmp_path: Path, mode: str) -> dict:
    return run_rank_processes(HERE / "_param_models.py", tmp_path / "rank0.json", mode, world=WORLD, timeout=TIMEOUT_S)


def keyed(samples: list[dict]) -> dict[tuple, float]:
    return {
        (s["name"], tuple(sorted(s["labels"].items()))): s["value"]
        for s in samples
        if s["name"].startswith(("param_", "adam_", "optimizer_state"))
    }


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_rank0_reports_what_one_process_reports(tmp_path, mode):
    got = run_ranks(tmp_path, mode)
    assert got["sharded"] == (mode == "fsdp")
    want = dp_single_process(mode)
    assert len(got["reports"]) == len(want) == 4  # steps 1, 2, 4, 6
    for k, (g, w) in enumerate(zip(got["reports"], want, strict=True)):
        g, w = keyed(g), keyed(w)
        assert g.keys() == w.keys(), k
        assert any(name == "adam_exp_avg_norm" for name, _ in g)
        for key, value in w.items():
            if mode == "ddp":  # identical gradients, identical arithmetic
                assert g[key] == value, (k, key)
            else:  # the same numbers, summed in another order across shards
                assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (k, key)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_grad_norm_is_the_global_norm_before_clipping(tmp_path, mode):
    """Each rank trains on its own half of the batch and clips every step: rank 0's
    grad_norm is the norm of the averaged gradient before clipping (taken after the
    DDP all-reduce / FSDP reduce-scatter, combined across shards), and the max/mean
    cover every step since the previous report."""
    got = run_ranks(tmp_path, f"{mode}-split")["reports"]
    want = grad_norm_reference(mode)
    assert len(got) == len(want) == 4
    for report, steps in zip(got, want, strict=True):
        value = {s["name"]: s["value"] for s in report if not s["labels"]}
        assert value["grad_norm"] == pytest.approx(steps[-1], rel=1e-5)
        assert value["grad_norm_max"] == pytest.approx(max(steps), rel=1e-5)
        assert value["grad_norm_mean"] == pytest.approx(sum(steps) / len(steps), rel=1e-5)
        assert value["grad_norm"] > 0.05 * 5  # well above the clip: the norm is taken before it


def test_close_waits_until_the_process_group_lets_go_of_our_tensors():
    """gloo's worker thread drops a finished collective's tensors after the call returns;
    dropping a Python-made tensor takes the GIL, which aborts the process once the
    interpreter is finalizing. ``Monitor.close`` (atexit at the latest) therefore waits,
    bounded, until nothing but their Python objects holds the tensors we handed over."""
    from trainvitals.hooks import distributed

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        distributed.handed(t)
        assert distributed.settle(timeout=5.0)
        assert t._use_count() == 1  # the group's work is gone: nothing is left to drop late
        view = t.view(-1)  # another C++ holder: the wait gives up at its bound
        distributed.handed(t)
        assert not distributed.settle(timeout=0.05)
        del view
        assert distributed.settle(timeout=5.0)
    finally:
        dist.destroy_process_group()
