"""A tiny decoder under tensor parallelism (DTensor ``parallelize_module``) and the rank
worker of its tests (``python _tp_models.py RANK WORLD PORT OUT MODE``).

q/k/v and the MLP's up projection are column-wise, o and the MLP's down projection
row-wise; the embedding, the RMSNorms, the head and a ``[1]`` gain stay plain tensors,
replicated on every rank. Rank 0 writes the monitor's reports and, for every report,
the figures computed here with plain torch from the full tensors
(``DTensor.full_tensor()``): the truth the test compares against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS, VOCAB, SEQ, BATCH = 16, 2, 32, 6, 4
STEPS = 6
EVERY = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(D)
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.norm2 = nn.RMSNorm(D)
        self.up = nn.Linear(D, 4 * D, bias=False)
        self.down = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        # -1 heads: the heads this rank holds (column-wise q/k/v give local outputs)
        q, k, v = (f(h).view(b, s, -1, D // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.gain = nn.Parameter(torch.ones(1))
        self.gain_grad: list | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        gain = self.gain
        if self.gain_grad is not None:  # "partial-grad": its gradient left Partial, as SequenceParallel does
            gain = gain.to_local(grad_placements=self.gain_grad)
        elif hasattr(gain, "full_tensor"):  # the "submesh" layout: the whole gain, as a plain tensor
            gain = gain.full_tensor()
        return self.head(self.norm(x)) * gain


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def parallelize(model: Decoder, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for name in ("q", "k", "v", "up"):
        plan[name] = ColwiseParallel()
    for name in ("o", "down"):
        plan[name] = RowwiseParallel()
    for block in model.blocks:
        parallelize_module(block, mesh, plan)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1, "name": "decay"},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"},
    ]
    # eps near the moments' size: a fractional eps-dominated share to check
    return torch.optim.AdamW(groups, lr=0.02, eps=1e-4, foreach=False)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it)."""
    gather = getattr(t, "full_tensor", None)
    return (gather() if gather is not None else t).detach().clone().double()


def truth(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    names: dict[int, str],
    grads: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    attach: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
) -> dict[str, float]:
    """Every figure of the optimizer/params/adam signals, from full tensors, keyed
    ``name|label=value``."""
    out: dict[str, float] = {}

    def norm(ts: list[torch.Tensor]) -> float:
        return math.sqrt(sum(float(t.square().sum()) for t in ts))

    groups = [(str(g.get("name", i)), [names[id(p)] for p in g["params"]]) for i, g in enumerate(opt.param_groups)]
    out["grad_norm|"] = norm(list(grads.values()))
    out["param_norm|"] = norm(list(after.values()))
    out["update_ratio|"] = norm([after[n] - before[n] for n in after]) / norm(list(after.values()))
    for label, members in groups:
        out[f"group_grad_norm|group={label}"] = norm([grads[n] for n in members])
        out[f"group_param_norm|group={label}"] = norm([after[n] for n in members])
        diff = norm([after[n] - before[n] for n in members])
        out[f"group_update_ratio|group={label}"] = diff / norm([after[n] for n in members])
    rms = {n: math.sqrt(float(g.square().mean())) for n, g in grads.items()}
    median = float(torch.tensor(sorted(rms.values()), dtype=torch.float64).median())
    one_d = sorted(n for n, t in after.items() if t.ndim <= 1)
    for n in one_d:
        x, ref = after[n], attach[n]
        out[f"param_min|param={n}"] = float(x.min())
        out[f"param_max|param={n}"] = float(x.max())
        out[f"param_absmax|param={n}"] = float(x.abs().max())
        if float(ref.abs().max()) > 0:  # a zero reference (a bias): its scale is taken later
            out[f"param_drift_log2|param={n}"] = math.log2(1 + float((x - ref).abs().max()) / float(ref.abs().max()))
        out[f"param_grad_relative_rms|param={n}"] = rms[n] / median
    group_of = {n: g for g in opt.param_groups for n in [names[id(p)] for p in g["params"]]}

    def adam(members: list[str]) -> tuple[float, float, float, float]:
        m_all, v_all, below, upd = [], [], 0, []
        for n in members:
            st, g = states[n], group_of[n]
            (b1, b2), eps, t = g["betas"], g["eps"], float(st["step"])
            m_hat = st["exp_avg"] / (1 - b1**t)
            v_hat = st["exp_avg_sq"] / (1 - b2**t)
            m_all.append(st["exp_avg"])
            v_all.append(st["exp_avg_sq"])
            below += int((v_hat.sqrt() < eps).sum())
            upd.append(m_hat / (v_hat.sqrt() + eps))
        count = sum(t.numel() for t in upd)
        return below / count, norm(upd) / math.sqrt(count), norm(m_all), norm(v_all)

    rows = ("adam_eps_dominated_ratio", "adam_normalized_update_rms", "adam_exp_avg_norm", "adam_exp_avg_sq_norm")
    for n in one_d:
        for name, value in zip(rows, adam([n]), strict=True):
            out[f"{name}|param={n}"] = value
    for label, members in groups:
        matrices = [n for n in members if after[n].ndim >= 2]
        if matrices:
            for name, value in zip(rows, adam(matrices), strict=True):
                out[f"{name}|group={label}"] = value
    return out


def step_with_truth(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    names: dict[int, str],
    attached: dict[str, torch.Tensor],
    reporting: bool,
) -> dict[str, float] | None:
    """``opt.step()``; on a reporting step, with the figures of :func:`truth` from the
    full tensors before and after it (collectives for DTensors: every rank calls it)."""
    if reporting:
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        before = {n: full(p) for n, p in model.named_parameters()}
    opt.step()
    if not reporting:
        return None
    after = {n: full(p) for n, p in model.named_parameters()}
    states = {
        names[id(p)]: {"step": st["step"], "exp_avg": full(st["exp_avg"]), "exp_avg_sq": full(st["exp_avg_sq"])}
        for p, st in opt.state.items()
    }
    return truth(model, opt, names, grads, before, after, attached, states)


def flat_report(samples: list[dict]) -> dict[str, float]:
    return {s["name"] + "|" + ",".join(f"{k}={v}" for k, v in sorted(s["labels"].items())): s["value"] for s in samples}


def _rank_main(rank: int, world: int, port: int, out: str, mode: str) -> None:
    import datetime
    import json
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.hooks import attach

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    model = Decoder()
    mesh = init_device_mesh("cpu", (world,))
    parallelize(model, mesh)
    if mode == "submesh":  # a layout the sums cannot be combined for: the gain on a one-rank mesh
        from torch.distributed.tensor import DTensor, Replicate

        solo = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "solo"))["solo"]
        model.gain = nn.Parameter(DTensor.from_local(torch.ones(1), solo, [Replicate()], run_check=False))
    if mode == "partial-grad":  # a Replicate gain whose gradient stays Partial (summed by the optimizer)
        from torch.distributed.tensor import DTensor, Partial, Replicate

        model.gain = nn.Parameter(DTensor.from_local(torch.ones(1), mesh, [Replicate()], run_check=False))
        model.gain_grad = [Partial()]
    names = {id(p): n for n, p in model.named_parameters()}
    opt = optimizer(model)
    mon = attach(model, opt, run="tp", sink="null", every=EVERY, update_sample=1 << 16)
    attached = {n: full(p) for n, p in model.named_parameters()}
    reports, truths = [], []
    for i in range(STEPS):
        tokens, targets = batch(i)  # the same batch on every rank (tensor parallel)
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
        reporting = mon.reporting_next
        found = step_with_truth(model, opt, names, attached, reporting)
        if found is not None:
            truths.append(found)
        opt.zero_grad(set_to_none=True)
        if reporting:
            reports.append(flat_report(mon.latest()))
    coverage = {e["signal"]: e for e in mon.latest_coverage()}
    mon.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"reports": reports, "truths": truths, "coverage": coverage}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
