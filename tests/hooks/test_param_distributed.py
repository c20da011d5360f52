"""Data parallel, two gloo ranks on the CPU, the same batch on both (so the averaged
gradient is the single-process one): rank 0 reports what one process reports.
DDP: replicated parameters, nothing to combine. FSDP2 (``fully_shard``): every
parameter is a DTensor split across the ranks (the 1-element scale leaves one rank
an empty shard); minima, maxima, sums of squares and element counts are combined in
the report's one collective."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from _param_models import dp_single_process

HERE = Path(__file__).resolve().parent
WORLD = 2
TIMEOUT_S = 180

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path: Path, mode: str) -> dict:
    out = tmp_path / "rank0.json"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_param_models.py"), str(r), str(WORLD), str(port),
                               str(out), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"data-parallel ranks did not finish within {TIMEOUT_S} s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    return json.loads(out.read_text())


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
