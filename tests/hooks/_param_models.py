"""Tiny models, a training loop, and slow plain-torch references for the I4 signals
(ParamHealth, AdamState); also the rank worker of their data-parallel tests
(``python _param_models.py RANK WORLD PORT OUT MODE``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


class Tiny(nn.Module):
    """Biases, LayerNorm weight and bias, and a learnable output scale (0-d, or shape
    [1] where FSDP2 needs it)."""

    def __init__(self, seed: int = 0, scalar_shape: tuple[int, ...] = ()):
        super().__init__()
        torch.manual_seed(seed)
        self.lin1 = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.lin2 = nn.Linear(12, 3)
        self.scale = nn.Parameter(torch.ones(scalar_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.norm(torch.tanh(self.lin1(x)))) * self.scale


def data(i: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g) + 2.0


def one_d(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return sorted(((n, p) for n, p in model.named_parameters() if p.ndim <= 1), key=lambda np_: np_[0])


def split_groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    """Megatron's heuristic: weight decay on matrices, none on 1D parameters."""
    return [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": wd, "name": "decay"},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"},
    ]


# Gradients of the tiny model at loss scale 1e-2 straddle eps=3e-3: fractional eps shares.
LARGE_EPS_LOSS_SCALE = 1e-2

OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.02, foreach=False),
    "adam-foreach": lambda m: torch.optim.Adam(m.parameters(), lr=0.02, foreach=True),
    "adam-fused": lambda m: torch.optim.Adam(m.parameters(), lr=0.02, fused=True),
    "adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.02, amsgrad=True, foreach=False),
    "adam-amsgrad-fused": lambda m: torch.optim.Adam(m.parameters(), lr=0.02, amsgrad=True, fused=True),
    "adam-large-eps": lambda m: torch.optim.Adam(m.parameters(), lr=0.02, eps=3e-3, betas=(0.8, 0.95)),
    "adamw-groups": lambda m: torch.optim.AdamW(split_groups(m), lr=0.02),
    "adamw-foreach-groups": lambda m: torch.optim.AdamW(split_groups(m), lr=0.02, foreach=True),
    "adamw-amsgrad-large-eps": lambda m: torch.optim.AdamW(
        split_groups(m), lr=0.02, amsgrad=True, eps=3e-3, foreach=True
    ),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
}


@dataclass
class History:
    """What the references need: 1D values at attach and after each report, the
    gradients of each reported step, and the monitor's samples of each report."""

    attach: dict[str, torch.Tensor]
    values: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    reports: list[list[dict]] = field(default_factory=list)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in one_d(model)}


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    mon,
    steps: int,
    *,
    start: int = 0,
    history: History | None = None,
    loss_scale: float = 1.0,
) -> History:
    """``steps`` optimizer steps; records what the references need on report steps."""
    history = history or History(snapshot(model))
    for i in range(start, start + steps):
        x, y = data(i)
        loss = (model(x) - y).square().mean() * loss_scale
        loss.backward()
        reporting = mon.reporting_next
        if reporting:
            history.grads.append(
                {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
        if reporting:
            history.values.append(snapshot(model))
            history.reports.append(mon.latest())
    return history


def series(samples: list[dict], name: str) -> dict[str, float]:
    """{label value: value} of one metric in a report (label param or group)."""
    out = {}
    for s in samples:
        if s["name"] == name:
            (label,) = s["labels"].values()
            out[label] = s["value"]
    return out


# -- references ------------------------------------------------------------------------
def param_reference(
    model: nn.Module, opt: torch.optim.Optimizer, history: History, report: int, window: int
) -> dict[str, dict[str, float]]:
    """ParamHealth's statistics at report ``report`` (0-based), element by element."""
    names = dict((id(p), n) for n, p in model.named_parameters())
    wd = {names[id(p)]: float(g.get("weight_decay", 0.0)) for g in opt.param_groups for p in g["params"]}
    values = history.values[report]
    chain = [history.attach, *history.values[: report + 1]]
    out: dict[str, dict[str, float]] = {
        k: {}
        for k in (
            "param_min",
            "param_max",
            "param_absmax",
            "param_drift_log2",
            "param_drift_consistency_ratio",
            "param_weight_decay",
            "param_grad_relative_rms",
        )
    }
    grads = history.grads[report]
    rms = {n: math.sqrt(float(g.double().square().mean())) for n, g in grads.items() if g is not None}
    median = float(torch.tensor(list(rms.values()), dtype=torch.float64).median())
    for name, _ in one_d(model):
        v = values[name].double().reshape(-1)
        out["param_min"][name] = min(float(x) for x in v)
        out["param_max"][name] = max(float(x) for x in v)
        absmax = max(abs(float(x)) for x in v)
        out["param_absmax"][name] = absmax
        # Reference: the values at attach; all zeros then, the values at the first report
        # where they are not. Drift: bits of the largest displacement from it.
        ref = [float(x) for x in history.attach[name].reshape(-1)]
        if max(abs(x) for x in ref) == 0.0:
            ref = next(
                (
                    [float(x) for x in h[name].reshape(-1)]
                    for h in history.values[: report + 1]
                    if max(abs(float(x)) for x in h[name].reshape(-1)) > 0
                ),
                ref,
            )
        scale = max(abs(x) for x in ref)
        moved = max(abs(float(x) - r) for x, r in zip(v, ref, strict=True))
        out["param_drift_log2"][name] = 0.0 if scale == 0.0 else math.log2(1 + moved / scale)
        signs = []
        for before, after in itertools.pairwise(chain):
            b, a = before[name].reshape(-1).tolist(), after[name].reshape(-1).tolist()
            signs.append([(x > y) - (x < y) for x, y in zip(a, b, strict=True)])
        recent = signs[-window:]
        per_element = [abs(sum(col) / len(recent)) for col in zip(*recent, strict=True)]
        out["param_drift_consistency_ratio"][name] = sum(per_element) / len(per_element)
        out["param_weight_decay"][name] = wd[name]
        if name in rms:
            out["param_grad_relative_rms"][name] = rms[name] / median
    return out


def adam_reference(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    per_param: bool = False,
    sample: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, dict[str, float]]:
    """AdamState's statistics from the optimizer state, in float64, element-wise:
    per 1D parameter (and with ``per_param`` per matrix), and per group over the
    group's parameters that have no 1D series. ``sample`` picks the elements of a
    large tensor the ratios are computed on (default: all)."""
    names = dict((id(p), n) for n, p in model.named_parameters())
    out: dict[str, dict[str, float]] = {
        k: {}
        for k in ("adam_eps_dominated_ratio", "adam_normalized_update_rms", "adam_exp_avg_norm", "adam_exp_avg_sq_norm")
    }
    for gi, g in enumerate(opt.param_groups):
        b1, b2 = g["betas"]
        eps = g["eps"]
        label = str(g.get("name", gi))
        acc = [0.0, 0.0, 0.0, 0.0, 0]  # m^2, v^2, dominated, u^2, elements
        for p in g["params"]:
            st = opt.state[p]
            t = float(st["step"])
            v = st["max_exp_avg_sq"] if g["amsgrad"] else st["exp_avg_sq"]
            m_all = st["exp_avg"].double().reshape(-1)
            m, v = m_all, v.double().reshape(-1)
            if sample is not None and p.ndim >= 2:
                m, v = sample(m), sample(v)
            m_hat = [x / (1 - b1**t) for x in m.tolist()]
            v_hat = [x / (1 - b2**t) for x in v.tolist()]
            dominated = sum(1 for x in v_hat if math.sqrt(x) < eps)
            u_sq = sum((a / (math.sqrt(b) + eps)) ** 2 for a, b in zip(m_hat, v_hat, strict=True))
            m_sq = sum(x * x for x in m_all.tolist())
            v_sq = sum(x * x for x in st["exp_avg_sq"].double().reshape(-1).tolist())
            if p.ndim <= 1 or per_param:
                n = names[id(p)]
                out["adam_eps_dominated_ratio"][n] = dominated / len(m_hat)
                out["adam_normalized_update_rms"][n] = math.sqrt(u_sq / len(m_hat))
                out["adam_exp_avg_norm"][n] = math.sqrt(m_sq)
                out["adam_exp_avg_sq_norm"][n] = math.sqrt(v_sq)
            if p.ndim >= 2:
                for k, x in enumerate((m_sq, v_sq, dominated, u_sq, len(m_hat))):
                    acc[k] += x
        if acc[4]:
            out["adam_eps_dominated_ratio"][label] = acc[2] / acc[4]
            out["adam_normalized_update_rms"][label] = math.sqrt(acc[3] / acc[4])
            out["adam_exp_avg_norm"][label] = math.sqrt(acc[0])
            out["adam_exp_avg_sq_norm"][label] = math.sqrt(acc[1])
    return out


# -- one rank of the data-parallel tests ------------------------------------------------
DP_STEPS = 6


def dp_model(mode: str) -> Tiny:
    return Tiny(0, scalar_shape=(1,) if mode == "fsdp" else ())


def dp_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(split_groups(model), lr=0.02)


CLIP = 0.05  # far below the tiny model's gradient norm: every step is clipped


def _rank_grad_norms(rank: int, world: int, wrapped: nn.Module, opt: torch.optim.Optimizer, attach) -> list:
    """Each rank its own half of the batch; gradients clipped before every step."""
    mon = attach(wrapped, opt, run="dp", sink="null", every=2, signals=("optimizer",))
    reports = []
    for i in range(DP_STEPS):
        x, y = data(i, 8 * world)
        x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
        (wrapped(x) - y).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon.reports_at(mon.step):
            reports.append(mon.latest())
    mon.close()
    return reports


def grad_norm_reference(mode: str, world: int = 2) -> list[list[float]]:
    """Per report step: the pre-clip global norms of the steps since the previous report,
    from the averaged gradient of the ranks' halves, computed in one process."""
    torch.set_num_threads(1)
    model = dp_model(mode)
    opt = dp_optimizer(model)
    out, since = [], []
    for i in range(DP_STEPS):
        x, y = data(i, 8 * world)
        losses = [(model(x[r * 8 : (r + 1) * 8]) - y[r * 8 : (r + 1) * 8]).square().mean() for r in range(world)]
        (sum(losses) / world).backward()
        since.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        step = i + 1
        if step == 1 or step % 2 == 0:
            out.append(since)
            since = []
    return out


def _rank_main(rank: int, world: int, port: int, out: str, mode: str) -> None:
    import datetime
    import json
    import warnings

    import torch.distributed as dist

    from trainvitals.hooks import attach

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    split = mode.endswith("-split")
    mode = mode.removesuffix("-split")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    model = dp_model(mode)
    if mode == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for sub in (model.lin1, model.norm, model.lin2):
            fully_shard(sub, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = dp_optimizer(wrapped)
    if split:
        reports = _rank_grad_norms(rank, world, wrapped, opt, attach)
        if rank == 0:
            with open(out, "w") as fh:
                json.dump({"reports": reports}, fh)
        dist.barrier()
        dist.destroy_process_group()
        return
    mon = attach(wrapped, opt, run="dp", sink="null", every=2, drift_window=3, signals=("params", "adam"))
    sharded = mon.sharded
    reports = []
    for i in range(DP_STEPS):
        x, y = data(i)  # the same data on every rank: the union is this batch, gradients average to it
        (wrapped(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon.reports_at(mon.step):
            reports.append(mon.latest())
    mon.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"sharded": sharded, "reports": reports}, fh)
    dist.barrier()
    dist.destroy_process_group()


def dp_single_process(mode: str) -> list[list[dict]]:
    """The same run in one process, for comparison with rank 0 (one thread, as the
    ranks use: another thread count sums the matmuls in another order)."""
    from tests.support import one_torch_thread  # here: the ranks run this file as a script
    from trainvitals.hooks import attach

    with one_torch_thread():
        return _dp_single_process(mode, attach)


def _dp_single_process(mode: str, attach) -> list[list[dict]]:
    model = dp_model(mode)
    opt = dp_optimizer(model)
    mon = attach(model, opt, run="dp", sink="null", every=2, drift_window=3, signals=("params", "adam"))
    reports = []
    for i in range(DP_STEPS):
        x, y = data(i)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon.reports_at(mon.step):
            reports.append(mon.latest())
    mon.close()
    return reports


if __name__ == "__main__":
    import sys

    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
