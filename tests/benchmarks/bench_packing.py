"""Cost of the packing signal: the boundary-leak probe per probe, and the static signs
per report step, against an unmonitored training step of the same micro-batch.

A Llama (``--layers`` layers, width ``--width``, vocabulary 2048, sdpa) trains on one
packed row per step (``DataCollatorWithFlattening``: restarting position ids, no mask;
``--samples`` samples of 32-128 tokens). Three arms, blocks interleaved, on one torch
thread, time the calling thread's CPU time (``time.thread_time``):

- ``step``: one unmonitored training step (forward, backward, AdamW);
- ``probe``: the probe alone (``PackingLeak.before_step`` on a probe step: two forward
  passes of the micro-batch without gradients, eval mode, RNG forked), monitored with
  ``packing_probe_every=1``;
- ``signs``: what the signal adds to a report step without a probe (its forward
  pre-hook and its ``collect``), monitored with ``packing_probe_every=None``.

    python tests/benchmarks/bench_packing.py
    python tests/benchmarks/bench_packing.py --layers 4 --width 256 --samples 16 --runs 15

The last line holds ``key=value`` figures: ``step_ms``, ``probe_ms``, ``signs_ms``,
``probe_over_step`` and ``probe_per_step_at_1000`` (the probe's cost spread over the
default 1000 steps between probes, as a fraction of a step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

from trainvitals.hooks import attach
from trainvitals.hooks.signals.packing.leak import PackingLeak


def model_of(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 64),
        max_position_embeddings=256,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return AutoModelForCausalLM.from_config(config)


def batch_of(samples: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 129, (samples,), generator=g).tolist()
    items = [{"input_ids": torch.randint(0, 2048, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening()(items)


class Timer:
    """Thread CPU time spent in wrapped methods, per step."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, cls: type, name: str) -> None:
        orig = getattr(cls, name)
        timer = self

        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                timer.spent += time.thread_time() - t0

        setattr(cls, name, timed)


def step(model, opt, batch) -> None:
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    batches = [batch_of(args.samples, s) for s in range(4)]
    tokens = statistics.median(int(b["input_ids"].shape[1]) for b in batches)
    timer = Timer()
    for name in ("before_step", "_pre", "collect"):
        timer.wrap(PackingLeak, name)
    arms: dict[str, list[float]] = {"step": [], "probe": [], "signs": []}
    for block in range(args.runs):
        # unmonitored
        model = model_of(args.layers, args.width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step(model, opt, batches[0])  # warm-up
        t0 = time.thread_time()
        for k in range(args.steps):
            step(model, opt, batches[k % 4])
        arms["step"].append((time.thread_time() - t0) / args.steps)
        # the probe on every step; then the static signs alone
        for arm, every in (("probe", 1), ("signs", None)):
            model = model_of(args.layers, args.width)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with attach(
                model, opt, run="bench", sink="null", every=1, packing_probe_every=every, loss_from_logits=False
            ):
                step(model, opt, batches[0])  # warm-up (the first report builds its layouts)
                timer.spent = 0.0
                for k in range(args.steps):
                    step(model, opt, batches[k % 4])
                arms[arm].append(timer.spent / args.steps)
        print(f"block {block}: " + ", ".join(f"{k} {1000 * v[-1]:.2f} ms" for k, v in arms.items()), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in arms.items()}
    print(f"Llama {args.layers} layers, width {args.width}, one packed row of ~{tokens:.0f} tokens")
    print(f"{'arm':<8} {'median ms':>10} {'min':>8} {'max':>8}")
    for k, v in arms.items():
        print(f"{k:<8} {1000 * med[k]:>10.2f} {1000 * min(v):>8.2f} {1000 * max(v):>8.2f}")
    return {
        "step_ms": 1000 * med["step"],
        "probe_ms": 1000 * med["probe"],
        "signs_ms": 1000 * med["signs"],
        "probe_over_step": med["probe"] / med["step"],
        "probe_per_step_at_1000": med["probe"] / med["step"] / 1000,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    figures = run(parser.parse_args())
    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
