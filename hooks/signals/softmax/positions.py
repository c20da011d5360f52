"""Softmax signals, their input: the argument checks of ``observe_logits`` /
``observe_distillation`` and the positions a call keeps.

At most ``softmax_max_positions`` positions per call, with a fixed stride over all
positions (``ceil(N / cap)``, coprime with T for [B, T] logits), handed out by row
chunks: a strided view when the positions merge, else gathered into one reused
buffer. The statistics over them are :mod:`~trainvitals.hooks.signals.softmax.signal`'s,
their arithmetic :mod:`~trainvitals.hooks.signals.softmax.maths`'s.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from trainvitals.hooks.signals.softmax import maths as sm

__all__ = ["Positions", "check_logits", "check_mask", "check_name", "check_temperature"]

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_name(what: str, value: Any, example: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"{what}={value!r} is not a usable name; pass a short identifier like {example!r}")
    return value


def check_temperature(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: temperature must be a Python number like 2.0, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: temperature must be a positive finite number, got {value!r}")
    return float(value)


def check_logits(where: str, name: str, logits: Any) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"{where}: {name} must be a torch.Tensor of shape [B, T, V] or [N, V], got {type(logits).__name__}"
        )
    if not logits.is_floating_point():
        raise TypeError(
            f"{where}: {name} must be floating point (float32, bfloat16 or float16), got "
            f"{logits.dtype}; pass the model's output logits, not token ids or labels"
        )
    if logits.ndim not in (2, 3):
        raise ValueError(f"{where}: {name} must be [B, T, V] or [N, V], got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 2:
        raise ValueError(
            f"{where}: {name} needs at least 2 classes in its last dimension, got shape {tuple(logits.shape)}"
        )


def check_mask(where: str, mask: Any, logits: torch.Tensor) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{where}: mask must be a bool torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{where}: mask must be a bool tensor (e.g. labels != -100), got {mask.dtype}")
    if tuple(mask.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{where}: mask shape {tuple(mask.shape)} must equal the logits' positions "
            f"{tuple(logits.shape[:-1])} (logits.shape[:-1])"
        )


class Positions:
    """The subsampled positions of [B, T, V] or [N, V] logits, handed out by row chunks.

    Usually the kept rows are a strided view (``view(-1, V)[::stride]``). When [B, T]
    cannot merge (e.g. ``logits[:, :-1]``), the logits are addressed as a 2D
    strided view whose row stride divides both position strides, and each chunk's
    rows are gathered with ``index_select`` into one reused buffer.
    """

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor | None, cap: int):
        self.vocab = logits.shape[-1]
        self.logits = logits.detach()
        positions = math.prod(logits.shape[:-1])
        self.period = logits.shape[1] if logits.ndim == 3 else 1
        self.stride = sm.subsample_stride(positions, cap, self.period)
        self.count = -(-positions // self.stride)
        self.weights = (
            None
            if mask is None
            else (mask.detach().reshape(-1)[:: self.stride].to(logits.device, torch.float32, non_blocking=True))
        )
        self._buffer: torch.Tensor | None = None
        try:
            self.flat: torch.Tensor | None = self.logits.view(-1, self.vocab)[:: self.stride]
            self.copies = 0
        except RuntimeError:
            self.flat = None
            self.copies = 1
            b, t, v = self.logits.shape
            sb, st, sv = self.logits.stride()
            row = math.gcd(sb, st) or 1
            self._row_steps = (sb // row, st // row)
            rows = ((b - 1) * sb + (t - 1) * st) // row + 1
            self._rows2d = self.logits.as_strided((rows, v), (row, sv), self.logits.storage_offset())

    def rows(self, start: int, stop: int, step: int = 1) -> torch.Tensor:
        """Kept positions ``start:stop:step`` (indices among the kept ones), ``[n, V]``."""
        if self.flat is not None:
            return self.flat[start:stop:step]
        n = len(range(start, stop, step))
        if self._buffer is None:  # the first chunk is the largest
            self._buffer = self.logits.new_empty((n, self.vocab))
        flat = torch.arange(start, stop, step, device=self.logits.device) * self.stride
        index = (flat // self.period) * self._row_steps[0] + (flat % self.period) * self._row_steps[1]
        return torch.index_select(self._rows2d, 0, index, out=self._buffer[:n])

    def weight(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        if self.weights is None:
            return torch.ones(stop - start, device=device)
        return self.weights[start:stop]
