"""I4 trained on a tiny CPU model, leaving checkpoints behind in every format the audit
reads; and the plain-torch truth the audit's figures are compared to.

The model: two linear layers (their biases moved far and steadily by the loss: targets
offset by +3) and a learnable output scale (the RMSNorm scale before the logits) whose
gradient is tiny and biased (scaled by 1e-9 plus noise of mean -8e-9, standing in for
low-precision rounding), under Adam(eps=1e-8) without weight decay: Adam turns it into
full-size steps and the scale walks up. Between the second and the third checkpoint
the optimizer is rebuilt (a new stage): its step counts start over.
The healthy twin: a hook zeros the scale's gradient (the write-up's fix) and the
optimizer is kept."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

CHECKPOINTS = (5, 30, 60)
"""Steps the checkpoints are written at."""
REBUILD_AT = 45
"""The step after which the bug run rebuilds its optimizer (between checkpoints 2 and 3)."""
LR = 0.1


class Readout(nn.Module):
    """``scale_shape``: the output scale's shape (``(1,)`` where FSDP2 needs a dimension)."""

    def __init__(self, scale_shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 4)
        self.out_scale = nn.Parameter(torch.ones(scale_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x))) * self.out_scale


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g) * 0.1 + 3.0


@dataclass
class Saved:
    """What the run left: per checkpoint the model and optimizer state dicts (CPU copies)."""

    steps: list[int] = field(default_factory=list)
    models: list[dict[str, torch.Tensor]] = field(default_factory=list)
    optimizers: list[dict] = field(default_factory=list)


def scale_gradient(model: nn.Module, variant: str, noise: torch.Generator) -> None:
    """After the backward: the bug's tiny biased gradient on the scale, or the fix's zero
    (in place: the same on a sharded FSDP2 gradient, whose hooks would not see it)."""
    g = model.out_scale.grad
    assert g is not None
    n = torch.randn((), generator=noise) * 2e-9 - 8e-9
    if variant == "bug":
        g.mul_(1e-9).add_(n)
    else:
        g.zero_()


def train(variant: str, scale_shape: tuple[int, ...] = ()) -> Saved:
    """``bug`` (I4 with an optimizer rebuild) or ``healthy``."""
    model = Readout(scale_shape)

    def make() -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=LR, eps=1e-8)

    opt = make()
    noise = torch.Generator().manual_seed(7)
    saved = Saved()
    for i in range(1, CHECKPOINTS[-1] + 1):
        x, y = batch(i)
        (model(x) - y).square().mean().backward()
        scale_gradient(model, variant, noise)
        opt.step()
        opt.zero_grad()
        if variant == "bug" and i == REBUILD_AT:
            opt = make()  # a new stage builds a new optimizer: its state starts empty
        if i in CHECKPOINTS:
            saved.steps.append(i)
            saved.models.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sd = opt.state_dict()
            saved.optimizers.append(
                {
                    "state": {k: {n: t.clone() for n, t in st.items()} for k, st in sd["state"].items()},
                    "param_groups": [dict(g) for g in sd["param_groups"]],
                }
            )
    return saved


# -- writing the checkpoints -----------------------------------------------------------
def write_torch(saved: Saved, folder: Path, layout: str = "model") -> list[Path]:
    """torch.save dicts: ``model`` ({'model', 'optimizer', 'step'}), ``state_dict``
    ({'state_dict', 'optimizer', 'global_step'}), ``model_state_dict``, ``bare``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for step, m, o in zip(saved.steps, saved.models, saved.optimizers, strict=True):
        obj: dict = {
            "model": {"model": m, "optimizer": o, "step": step},
            "state_dict": {"state_dict": m, "optimizer": o, "global_step": step},
            "model_state_dict": {"model_state_dict": m, "optimizer_state_dict": o, "iteration": step},
            "bare": m,
        }[layout]
        path = folder / f"ckpt-{step}.pt"
        torch.save(obj, path)
        out.append(path)
    return out


def write_lightning_layout(saved: Saved, folder: Path) -> list[Path]:
    """The keys a Lightning ``.ckpt`` holds (the real trainer is tested apart)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for step, m, o in zip(saved.steps, saved.models, saved.optimizers, strict=True):
        path = folder / f"epoch=0-step={step}.ckpt"
        torch.save(
            {
                "epoch": 0,
                "global_step": step,
                "pytorch-lightning_version": "2.6.0",
                "state_dict": {f"model.{k}": v for k, v in m.items()},
                "optimizer_states": [o],
                "lr_schedulers": [],
            },
            path,
        )
        out.append(path)
    return out


def write_safetensors(saved: Saved, folder: Path) -> list[Path]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for step, m in zip(saved.steps, saved.models, strict=True):
        path = folder / f"model-step{step}.safetensors"
        save_file({k: v.contiguous() for k, v in m.items()}, str(path), metadata={"step": str(step)})
        out.append(path)
    return out


def write_hf(saved: Saved, folder: Path) -> list[Path]:
    """Hugging Face Trainer's ``checkpoint-N/`` layout (the real trainer is tested apart)."""
    from safetensors.torch import save_file

    out = []
    for step, m, o in zip(saved.steps, saved.models, saved.optimizers, strict=True):
        d = folder / f"checkpoint-{step}"
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in m.items()}, str(d / "model.safetensors"))
        torch.save(o, d / "optimizer.pt")
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
        out.append(d)
    return out


def write_dcp(saved: Saved, folder: Path, model: nn.Module | None = None) -> list[Path]:
    """torch.distributed.checkpoint folders from one process, keyed by parameter name
    as ``get_state_dict`` gives them (FSDP2 jobs are tested apart)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    names = list(Readout().state_dict())
    out = []
    for step, m, o in zip(saved.steps, saved.models, saved.optimizers, strict=True):
        d = folder / f"step-{step}"
        by_name = {names[int(k)]: st for k, st in o["state"].items()}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
            for g in o["param_groups"]
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(
                {"model": m, "optimizer": {"state": by_name, "param_groups": groups}, "train_state": {"step": step}},
                checkpoint_id=str(d),
                no_dist=True,
            )
        out.append(d)
    return out


# -- the truth, in plain torch, element by element --------------------------------------
def drift_truth(saved: Saved, name: str, ref_index: int = 0) -> list[float]:
    """param_drift_log2 of a 1D parameter at each checkpoint against checkpoint
    ``ref_index``: log2(1 + max|x - ref| / max(absmax(ref), 1e-2 x the median absmax of
    the model's 1D references))."""
    ref_model = saved.models[ref_index]
    scales = sorted(float(v.abs().max()) for k, v in ref_model.items() if v.ndim <= 1)
    floor = scales[(len(scales) - 1) // 2] * 1e-2
    ref = ref_model[name].reshape(-1).tolist()
    scale = max(max(abs(r) for r in ref), floor)
    out = []
    for m in saved.models:
        x = m[name].reshape(-1).tolist()
        moved = max(abs(a - b) for a, b in zip(x, ref, strict=True))
        out.append(math.log2(1 + moved / scale))
    return out


def eps_truth(saved: Saved, index: int, name: str) -> tuple[float, float]:
    """(share of elements with sqrt(v_hat) < eps, RMS of m_hat / (sqrt(v_hat) + eps))."""
    o = saved.optimizers[index]
    names = list(Readout().state_dict())
    key = next(k for k in o["state"] if names[int(k)] == name)
    st = o["state"][key]
    g = o["param_groups"][0]
    b1, b2 = g["betas"]
    eps = g["eps"]
    t = float(st["step"])
    below, sq = 0, 0.0
    m, v = st["exp_avg"].reshape(-1).tolist(), st["exp_avg_sq"].reshape(-1).tolist()
    for mi, vi in zip(m, v, strict=True):
        m_hat, v_hat = mi / (1 - b1**t), vi / (1 - b2**t)
        below += math.sqrt(v_hat) < eps
        sq += (m_hat / (math.sqrt(v_hat) + eps)) ** 2
    return below / len(m), math.sqrt(sq / len(m))
