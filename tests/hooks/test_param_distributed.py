"""Data parallel, two gloo ranks on the CPU, the same batch on both (so the averaged
gradient is the single-process one): rank 0 reports what one process reports.
DDP: replicated parameters, nothing to combine. FSDP2 (``fully_shard``): every
parameter is a DTensor split across the ranks (the 1-element scale leaves one rank
an empty shard); minima, maxima, sums of squares and element counts are combined in
the report's one collective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from _param_models import dp_single_process

from tests.support import run_ranks as run_rank_processes

HERE = Path(__file__).resolve().parent
WORLD = 2
TIMEOUT_S = 180

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]


def run_ranks(tmp_path: Path, mode: str) -> dict:
    return run_rank_processes(HERE / "_param_models.py", tmp_path / "rank0.json", mode, world=WORLD, timeout=TIMEOUT_S)


def keyed(samples: list[dict]) -> dict[tuple, float]:
    return {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in samples
            if s["name"].startswith(("param_", "adam_", "optimizer_state"))}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_rank0_reports_what_one_process_reports(tmp_path, mode):
    got = run_ranks(tmp_path, mode)
    assert got["sharded"] == (mode == "fsdp")
    want = dp_single_process(mode)
    assert len(got["reports"]) == len(want) == 4  # steps 1, 2, 4, 6
    for k, (g, w) in enumerate(zip(got["reports"], want)):
        g, w = keyed(g), keyed(w)
        assert g.keys() == w.keys(), k
        assert any(name == "adam_exp_avg_norm" for name, _ in g)
        for key, value in w.items():
            if mode == "ddp":  # identical gradients, identical arithmetic
                assert g[key] == value, (k, key)
            else:  # the same numbers, summed in another order across shards
                assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (k, key)
