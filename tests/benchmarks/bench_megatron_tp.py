"""The per-report cost Megatron tensor parallelism adds to zero-code loss accounting:
on a report step, each micro-batch's check of the logits' gradient sums each token's
L1 and L2 norms over the vocabulary shards (one all-reduce of ``[N, 2]`` float32 on the
monitor's own tensor-parallel group). This times the added all-reduce against the shard's
own norms the check takes anyway (``g.abs().sum(1)``, ``g.square().sum(1)``), on two
gloo ranks of this machine, one torch thread each, medians over repeats. The
parameter figures add nothing: each parameter's share is folded into the sums that
already travel in the report's one collective.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/benchmarks/bench_megatron_tp.py
    ... bench_megatron_tp.py --tokens 2048 --vocab-shard 4096 --repeats 30
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

from trainvitals.hooks.signals.loss.zero_code import _over_shards


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--vocab-shard", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    rows = []
    for n in args.tokens:
        g = torch.randn(n, args.vocab_shard)
        sums = torch.randn(n, 2)
        norms = _median_ms(lambda g=g: (g.abs().sum(1), g.square().sum(1)), args.repeats)
        reduce = _median_ms(lambda sums=sums: dist.all_reduce(sums, group=group), args.repeats)
        rows.append((n, norms, reduce))
    _over_shards(g, group, torch.float64)  # the path itself runs
    if dist.get_rank() == 0:
        ranks = dist.get_world_size()
        shard = f"norms of one shard [N, {args.vocab_shard}], ms"
        print(f"| tokens per micro-batch | {shard} | all-reduce of [N, 2] over {ranks} ranks, ms |")
        print("|---|---|---|")
        for n, norms, reduce in rows:
            print(f"| {n} | {norms:.3f} | {reduce:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
