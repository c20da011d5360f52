"""What the RL policy-loss seam costs on a report step: one micro-batch's forward and
GRPO's loss (the ops of ``GRPOTrainer._compute_loss`` from the log-probabilities on),
plain and under the torch function mode that follows the advantages
(``integrations_rl._FindPolicyLoss``). Forward only: the backward is untouched by the
mode (one tensor hook, as ``track_loss`` always places). One thread, medians.

    python -m tests.benchmarks.bench_rl_seam [--layers 2] [--hidden 256] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

from trainvitals.hooks.integrations_rl import _FindPolicyLoss


def loss_of(model: torch.nn.Module, ids: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    adv = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / 4


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=a.hidden,
        intermediate_size=4 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 1000, (a.batch, a.length))
    advantages = torch.randn(a.batch)
    mask = torch.ones(a.batch, a.length - 1)
    plain, seam = [], []
    for i in range(a.repeats + 3):
        t0 = time.perf_counter()
        loss_of(model, ids, advantages, mask)
        t1 = time.perf_counter()
        finder = _FindPolicyLoss(advantages)
        with finder:
            loss_of(model, ids, advantages, mask)
        t2 = time.perf_counter()
        assert finder.found is not None
        if i >= 3:  # warm-up
            plain.append(t1 - t0)
            seam.append(t2 - t1)
    p, s = statistics.median(plain) * 1e3, statistics.median(seam) * 1e3
    x = torch.zeros(4)
    per_op = []
    for _ in range(7):  # the handler's cost per torch op, on ops that cost almost nothing themselves
        t0 = time.perf_counter()
        for _ in range(2000):
            x.add(1)
        t1 = time.perf_counter()
        with _FindPolicyLoss(advantages):
            for _ in range(2000):
                x.add(1)
        t2 = time.perf_counter()
        per_op.append(((t2 - t1) - (t1 - t0)) / 2000 * 1e6)
    counter = _Count()
    with counter:
        loss_of(model, ids, advantages, mask)
    print(
        f"the mode's handler: median {statistics.median(per_op):.2f} us per torch op; "
        f"this forward+loss makes {counter.ops} torch-function calls"
    )
    print(
        f"layers={a.layers} hidden={a.hidden} batch={a.batch}x{a.length}: forward+loss median {p:.2f} ms plain, "
        f"{s:.2f} ms under the seam (+{s - p:.2f} ms, {100 * (s - p) / p:.1f}%), {a.repeats} repeats"
    )


if __name__ == "__main__":
    main()
