"""Which optimizer family a job steps with: what a missing division of the loss does to it.

- SGD-like (``SGD``, ``ASGD``, with or without momentum and Nesterov): the step is
  ``lr`` times the gradient (or its momentum), so a gradient N times too large is an
  N-fold learning rate.
- Adam-like (``Adam``, ``AdamW``, ``Adamax``, ``NAdam``, ``RAdam``, ``SparseAdam``,
  ``Adagrad``, ``Adadelta``, ``RMSprop``, ``Rprop``, and by name Adafactor, Lion,
  LAMB, Muon, Sophia, Shampoo): the step divides the gradient by a running measure of
  its own scale (or takes its sign, or orthogonalises it), so a gradient N times too
  large moves the parameters as far, up to eps. What changes is everything that reads
  the gradient's size: a clipping threshold engages N times sooner, eps weighs N times
  less, and the logged loss is N times larger.

Reported as ``optimizer_scale_invariant``: 1 Adam-like, 0 SGD-like, 0.5 unknown (a
class the table does not know; the rules treat it as SGD-like, the conservative
side).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["FAMILY_VALUE", "Family", "optimizer_family"]

Family = Literal["sgd", "adam", "unknown"]
FAMILY_VALUE: dict[Family, float] = {"sgd": 0.0, "adam": 1.0, "unknown": 0.5}

_SGD_LIKE: tuple[type, ...] = (torch.optim.SGD, torch.optim.ASGD)
_ADAM_LIKE: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop")
    if hasattr(torch.optim, name)
)
# Optimizers outside torch.optim, by class name (bitsandbytes, transformers, timm, ...).
_ADAM_NAMES = ("adam", "adafactor", "lion", "lamb", "lars", "muon", "sophia", "shampoo", "adagrad", "rmsprop", "came")
_SGD_NAMES = ("sgd",)


def optimizer_family(optimizer: Any) -> Family:
    """``"adam"``, ``"sgd"`` or ``"unknown"`` for ``optimizer`` (a torch optimizer)."""
    optimizer = getattr(optimizer, "watched_from", optimizer)  # the monitor's view of a pipeline job's
    if isinstance(optimizer, _ADAM_LIKE):
        return "adam"
    if isinstance(optimizer, _SGD_LIKE):
        return "sgd"
    name = type(optimizer).__name__.lower()
    if any(n in name for n in _ADAM_NAMES):
        return "adam"
    if any(n in name for n in _SGD_NAMES):
        return "sgd"
    return "unknown"
