"""The last elementwise steps of some figures, done on the sender thread.

A figure such as ``sqrt(sum of squares / count)`` is a reduction on the device (what
must be done where the data is) and then a few scalar operations on a handful of
numbers. Each of those would be a tensor op on the training thread: 10-20 us of
dispatch on a CPU, a kernel launch on a GPU. Done here, on the host copy the report
makes anyway, they cost the sender thread well under a microsecond per value.

The functions follow IEEE float arithmetic as the tensor ops did: a division by zero
gives inf or NaN, a root or a logarithm of NaN gives NaN, nothing raises on a
non-finite value. Each finish takes the emit's values as Python floats and returns one
value per labels entry (:meth:`trainvitals.hooks.step.StepContext.emit_block`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "AdamFinish",
    "GradRmsFinish",
    "LogRatioFinish",
    "RatioRootFinish",
    "div",
    "log",
    "log2",
    "lower_median",
    "sqrt",
]


def div(a: float, b: float) -> float:
    """``a / b`` as a tensor division gives it: ``x / 0`` is +-inf, ``0 / 0`` NaN."""
    if b != 0.0:
        return a / b
    if a != a or a == 0.0:  # NaN, or 0 / 0
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def sqrt(x: float) -> float:
    """``x ** 0.5``; NaN for NaN and below 0 (as the tensor op)."""
    return math.sqrt(x) if x >= 0.0 else math.nan


def log2(x: float) -> float:
    """``log2(x)``; -inf at 0, NaN below 0 and for NaN (as the tensor op)."""
    if x > 0.0:
        return math.log2(x)
    return -math.inf if x == 0.0 else math.nan


def log(x: float) -> float:
    """The natural logarithm; -inf at 0, NaN below 0 and for NaN (as the tensor op)."""
    if x > 0.0:
        return math.log(x)
    return -math.inf if x == 0.0 else math.nan


def round_even(x: float) -> float:
    """``torch.round``: to the nearest integer, halves to even; non-finite as it is."""
    return float(round(x)) if math.isfinite(x) else x


def lower_median(values: Sequence[float]) -> float:
    """``torch.median`` of a vector: the lower of the two middle values for an even
    count, NaN when any value is NaN."""
    if any(v != v for v in values):
        return math.nan
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class AdamFinish:
    """Adam's figures from their sums per bin ``[count below eps, update sum of squares,
    exp_avg and exp_avg_sq sums of squares]`` (``n`` each): the count over the sampled
    elements, the RMS of the update, the two norms."""

    def __init__(self, sampled: Sequence[float]) -> None:
        self.counts = [max(float(s), 1.0) for s in sampled]
        self.n = len(self.counts)

    def __call__(self, raw: list[float]) -> list[float]:
        n, counts = self.n, self.counts
        if len(raw) != 4 * n:
            raise ValueError(f"AdamFinish: {len(raw)} values for {n} bins")
        out = [div(round_even(v), c) for v, c in zip(raw[:n], counts, strict=True)]
        out += [sqrt(div(v, c)) for v, c in zip(raw[n : 2 * n], counts, strict=True)]
        out += [sqrt(v) for v in raw[2 * n :]]
        return out


class RatioRootFinish:
    """``sqrt(numerator / denominator)`` per figure, from ``[numerators, denominators]``."""

    def __call__(self, raw: list[float]) -> list[float]:
        k = len(raw) // 2
        return [sqrt(div(a, b)) for a, b in zip(raw[:k], raw[k:], strict=True)]


class GradRmsFinish:
    """Each gradient's RMS (its norm over the root of its element count; ``squared``: the
    norm's square was given) relative to the median RMS, at ``positions``."""

    def __init__(self, roots: Sequence[float], positions: Sequence[int], squared: bool, floor: float) -> None:
        self.roots, self.positions, self.squared, self.floor = list(roots), list(positions), squared, floor

    def __call__(self, raw: list[float]) -> list[float]:
        norms = [sqrt(v) for v in raw] if self.squared else raw
        rms = [div(v, r) for v, r in zip(norms, self.roots, strict=True)]
        median = lower_median(rms)
        median = median if median != median or median > self.floor else self.floor  # clamp_min keeps NaN
        return [div(rms[i], median) for i in self.positions]


class LogRatioFinish:
    """``log(x) / base`` per value, with one base per value."""

    def __init__(self, bases: Sequence[float]) -> None:
        self.bases = list(bases)

    def __call__(self, raw: list[float]) -> list[float]:
        return [div(log(x), b) for x, b in zip(raw, self.bases, strict=True)]
