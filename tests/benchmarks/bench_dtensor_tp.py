"""The per-report cost a vocab-parallel DTensor head (``ColwiseParallel(use_local_output=
False)``, ``Shard(-1)`` logits) adds to zero-code loss accounting: on a report step, each
micro-batch's logits hook reads the weights from the shard's gradient and logits with
``recover_shards``: the shard's own reductions, one all-gather of ``5 N + C`` float64
values (C: the checked positions, at most ``logits_max_positions``) and one all-reduce of 2
over the monitor's own group. This times, on two gloo ranks of this machine (one torch
thread each, medians over repeats): the same maths on one rank's shard without the
collectives (``recover`` + ``cross_entropy_residual`` + the output norms on ``[N, V / 2]``),
the whole
``recover_shards``, and its two collectives alone.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/benchmarks/bench_dtensor_tp.py
    ... bench_dtensor_tp.py --tokens 2048 --vocab-shard 4096 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainvitals.hooks.config import Config
from trainvitals.hooks.megatron import private_group
from trainvitals.hooks.signals.loss.binning import output_norms
from trainvitals.hooks.signals.loss.logits import cross_entropy_residual, recover
from trainvitals.hooks.signals.loss.sharded import VocabShards, recover_shards


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _gradient(n: int, width: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cross-entropy gradient's shard at random logits (labels on rank 0's shard)."""
    g = torch.Generator().manual_seed(rank)
    z = torch.randn(n, width, generator=g)
    p = torch.softmax(z, dim=1) * 0.5
    if rank == 0:
        p[:, 0] -= 1.0
    return p / n, z


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--vocab-shard", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    shards = VocabShards(None, 0, private_group(tuple(range(dist.get_world_size()))))
    config = Config()
    cap, chunk = config.logits_max_positions, config.softmax_chunk_bytes
    rows = []
    for n in args.tokens:
        grad, z = _gradient(n, args.vocab_shard, dist.get_rank())

        def local(grad=grad, z=z, n=n):
            rec = recover(grad, z, torch.float64)
            cross_entropy_residual(grad, z, rec, cap=cap, period=n, chunk_bytes=chunk)
            output_norms(grad, 1)  # the per-modality output norms, taken on whole logits too

        def sharded(grad=grad, z=z, n=n):
            recover_shards(grad, z, shards, torch.float64, cap=cap, period=n, chunk_bytes=chunk)

        c = min(n, cap)
        values, pair = torch.zeros(5 * n + c, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)

        def collectives(values=values, pair=pair):
            dist.all_gather([torch.empty_like(values) for _ in range(shards.size)], values, group=shards.group)
            dist.all_reduce(pair, group=shards.group)

        rows.append((n, *(_median_ms(f, args.repeats) for f in (local, sharded, collectives))))
    if dist.get_rank() == 0:
        ranks = dist.get_world_size()
        print(
            f"| tokens per micro-batch | recover, residual, norms on one shard [N, {args.vocab_shard}], ms "
            f"| recover_shards over {ranks} ranks, ms | its all-gather + all-reduce alone, ms |"
        )
        print("|---|---|---|---|")
        for n, one, whole, comm in rows:
            print(f"| {n} | {one:.3f} | {whole:.3f} | {comm:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
