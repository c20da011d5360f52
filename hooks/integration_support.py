"""What the Trainer and Lightning callbacks share: run names, state files, batch tags."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch
from torch import nn

from trainvitals.hooks.naming import unwrap
from trainvitals.wire.runs import MAX_RUN, RUN_CHARS, is_run

__all__ = ["STATE_FILE", "batch_value", "find_trainer", "run_name", "state_file", "torch_optimizer"]

STATE_FILE = "trainvitals-rank{rank}.pt"
"""The monitor's state in a checkpoint folder, one file per rank (Monitor.state_dict())."""

_BAD = re.compile(rf"[^{RUN_CHARS}/]+")


def run_name(*candidates: Any, default: str) -> str:
    """The first candidate that can be made into a valid run name, else ``default``:
    characters outside letters, digits and ``_ . : - /`` become ``_``, empty, ``.`` and
    ``..`` parts between slashes are left out, and the last 128 characters kept
    (:func:`trainvitals.wire.runs.is_run` holds for what comes back)."""
    for c in candidates:
        if c is None:
            continue
        name = _parts(_parts(_BAD.sub("_", str(c)))[-MAX_RUN:])
        if is_run(name):
            return name
    return default


def _parts(name: str) -> str:
    return "/".join(p for p in name.split("/") if p not in ("", ".", ".."))


def state_file(folder: str, rank: int) -> str:
    import os

    return os.path.join(folder, STATE_FILE.format(rank=rank))


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers (accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer, Megatron's ChainedOptimizer around its
    FP32Optimizer/Float16OptimizerWithFloat16Params): the one whose ``step`` runs the
    hooks. A ChainedOptimizer of several optimizers raises, naming them: attach one
    monitor per inner optimizer."""
    seen = set()
    # accelerate's AcceleratedOptimizer subclasses torch's Optimizer yet is a wrapper: the
    # one to hook is the optimizer it holds.
    while id(optimizer) not in seen and (
        not isinstance(optimizer, torch.optim.Optimizer)
        or isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
    ):
        seen.add(id(optimizer))
        chained = getattr(optimizer, "chained_optimizers", None)
        if isinstance(chained, (list, tuple)):
            if len(chained) != 1:
                raise TypeError(
                    f"trainvitals: {type(optimizer).__name__} chains {len(chained)} optimizers "
                    f"({', '.join(type(o).__name__ for o in chained)}); attach one monitor per inner "
                    "torch optimizer, e.g. attach(model, optimizer.chained_optimizers[0].optimizer, ...)"
                )
            optimizer = chained[0]
            continue
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is not None:
            optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"trainvitals: cannot find the torch optimizer inside {type(optimizer).__name__}")
    return optimizer


def batch_value(batch: Any, field: str | Callable[[Any], Any] | None) -> Any:
    """``field`` of a batch: a key of a dict-like batch, an attribute, or a callable's result."""
    if field is None:
        return None
    if callable(field):
        return field(batch)
    if isinstance(batch, Mapping):
        return batch.get(field)
    return getattr(batch, field, None)


def find_trainer(model: nn.Module | None = None, depth: int = 40) -> Any | None:
    """The ``transformers.Trainer`` whose code is on the caller's stack (it calls the
    callback events and ``optimizer.step()``), training ``model`` when one is given;
    None when there is none. Known by its class's name and module, so transformers is
    never imported here."""
    target = unwrap(model) if model is not None else None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if obj is not None and _is_trainer(obj):
            trained = getattr(obj, "model", None)
            if target is None or (isinstance(trained, nn.Module) and unwrap(trained) is target):
                return obj
        frame = frame.f_back
    return None


def _is_trainer(obj: Any) -> bool:
    return any(c.__name__ == "Trainer" and c.__module__.startswith("transformers.") for c in type(obj).__mro__)
