"""The drift state of the 1D parameters that have a series: their elements end to
end, the reference each drift is measured from, and the ring of change signs behind
``param_drift_consistency_ratio`` (docs/signals.md, "1D parameters").

Drift: ``param_drift_log2 = log2(1 + max_i |x_i - ref_i| / scale)``, the bits of
range a parameter's largest displacement from its reference amounts to. ``ref`` is
the parameter at attach (for one that is all zeros then, a zero-initialized bias:
its value at the first report where it is not) and ``scale`` that reference's
absmax, or :data:`NEIGHBOUR_FLOOR` (1e-2) times the median reference absmax of the
model's 1D parameters when that is larger: a parameter that stays orders of magnitude
below its neighbours (a zero-initialised attention key bias, whose true gradient is
zero, nudged by Adam to 1e-7) has no range at stake and does not read as drifting by
its own tiny scale. A walk 1.0 -> 56 reads log2(56) = 5.8 bits; a walk through zero that
changes sign, 1.0 -> -0.34, reads log2(2.34) = 1.2 bits (a ratio of absmax would
read it as shrinking). The reference survives checkpoints through
``Monitor.state_dict()``, so drift keeps counting across resumes.

Consistency: per element, the signs of its changes between consecutive reports
(+1, -1, 0 when unchanged) over the last ``drift_window`` reports; |mean sign| per
element, averaged over the elements (at most :data:`CONSISTENCY_SAMPLE` per
parameter, a deterministic strided sample beyond that). Kept as an int8 ring and
running float32 sums (integers, exact) on the device: one subtraction and one add per report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainvitals.hooks.host_finish import div, log2
from trainvitals.hooks.late_warnings import LateValue
from trainvitals.hooks.sampling import StridedSample, owner_index
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.signals.param_series import Series
from trainvitals.hooks.tensors import flat, group_amax, local

NEIGHBOUR_FLOOR = 1e-2
"""A 1D parameter's drift is measured against at least this fraction of the median
reference scale (absmax) of the model's 1D parameters."""
CONSISTENCY_SAMPLE = 1024
"""Elements per parameter whose change signs are kept."""
_SCALE_FLOOR = 1e-38
"""The smallest judged scale a drift is divided by (a parameter that is all zeros)."""


def judged_scales(scales: Sequence[float]) -> list[float]:
    """The scale each drift is judged against, from the references' absmax (host
    numbers; the device does the same in :meth:`DriftTracker.drift_bits`): its own, or
    :data:`NEIGHBOUR_FLOOR` times the median (torch.nanmedian: the lower middle value)
    of the scales that are not 0, when that is larger."""
    known = sorted(s for s in scales if s > 0)
    floor = known[(len(known) - 1) // 2] * NEIGHBOUR_FLOOR if known else 0.0
    return [max(s, floor) for s in scales]


def drift_log2(moved: float, judged: float) -> float:
    """``param_drift_log2`` of a largest displacement ``moved`` = max |x - ref| against
    the judged scale: ``log2(1 + moved / judged)``, the scale floored at 1e-38."""
    return log2(1.0 + div(moved, max(judged, _SCALE_FLOOR)))


def sign_consistency(signs: torch.Tensor) -> float:
    """``param_drift_consistency_ratio`` from the change signs ``[changes, elements]``
    (+1, -1, 0): per element |mean sign| over the changes, averaged over the elements;
    NaN without a change or an element."""
    if signs.shape[0] == 0 or signs.shape[1] == 0:
        return math.nan
    return float(signs.to(torch.float64).mean(0).abs().mean())


@dataclass
class Reference:
    """What a parameter's drift is measured from (rank-local elements)."""

    values: torch.Tensor  # flat float32, on the monitor's device
    scale: torch.Tensor  # 0-d: absmax of ``values`` (combined across shards at reports); 0 until non-zero

    @staticmethod
    def of(p: torch.Tensor, device: torch.device) -> Reference:
        v = flat(local(p).detach()).to(device, torch.float32).clone()
        return Reference(v, v.abs().amax() if v.numel() else torch.zeros((), device=device))


class DriftTracker:
    """One arrangement of the series' 1D parameters: references and change-sign ring."""

    def __init__(self, monitor: MonitorView, series: list[Series], refs: dict[int, Reference]):
        dev = monitor.device
        self.series = series
        self.one_d = [s for s in series if s.param.ndim <= 1]
        self.labels = [{"param": s.name} for s in self.one_d]
        self.n = len(self.one_d)
        # Complex parameters count as (real, imaginary) pairs, as Adam treats them.
        self.counts = [flat(local(s.param).detach()).numel() for s in self.one_d]
        self.owner = owner_index(self.counts, dev)  # element -> parameter
        self.consistency = StridedSample(self.counts, CONSISTENCY_SAMPLE)
        self.sampled_owner = self.owner if self.consistency.dense else self.consistency.owners(dev)
        self.sampled = torch.tensor(self.consistency.sizes, dtype=torch.float32).to(dev)
        self.refs = refs
        chosen = [refs[id(s.param)] for s in self.one_d]
        self.ref_values = torch.cat([r.values for r in chosen]) if chosen else torch.zeros(0, device=dev)
        self.scale = torch.stack([r.scale for r in chosen]) if chosen else torch.zeros(0, device=dev)
        self.judged = self.scale  # the scale drift is judged against; set by drift_bits
        self.window = monitor.config.drift_window
        prev = self.consistency.take_from(self.values(dev)).clone()
        # The sampled previous values and their negations (0 - x) as rows [2, S]: one
        # comparison with this report's pair gives both "went up" and "went down".
        self.prev2 = torch.stack([prev, 0 - prev])
        self.ring = torch.zeros(self.window, prev.numel(), dtype=torch.int8, device=dev)
        self.sums = torch.zeros(prev.numel(), device=dev)  # float32: integers, |x| <= window
        # Comparison results written as int8 in place (no conversion op per report).
        self._updown = torch.empty(2, prev.numel(), dtype=torch.int8, device=dev)
        self._up, self._down = self._updown.unbind()
        self._zero = torch.zeros((), device=dev)  # for torch.where without a scalar tensor per call
        self._nan = torch.full((), float("nan"), device=dev)
        self._one = torch.ones((), device=dev)
        self.changes = 0
        self._slots = list(self.ring.unbind(0))  # the ring's rows as views, made once
        # Each report writes rows [x, |x|, |ref - x|, 0 - x] of the elements x into one of
        # two kept buffers, the other than the previous report's (whose rows x and 0 - x are
        # the previous values of the change signs), and reduces the first three with one
        # scatter. The views every report reads are made once.
        total = self.owner.numel()
        self._rows = [torch.empty(4, total, device=dev) for _ in range(2)]
        self._values = [r[0] for r in self._rows]
        self._negated = [r[1:] for r in self._rows]  # written by one subtraction from _base
        self._absolute = [r[1:3] for r in self._rows]
        self._reduced = [r[:3] for r in self._rows]
        self._base = torch.zeros(3, total, device=dev)  # [0, ref, 0]: minus x gives rows 1-3
        self._base_ref_row = self._base[1]
        self._base_ref: torch.Tensor | None = None  # the ref_values copied into _base
        self._parity: int | None = None  # the buffer prev2 lies in (None: its own tensor)
        self._current = 0  # the buffer of this report
        if self.consistency.dense:
            self._pairs = [r[0::3] for r in self._rows]  # rows x and 0 - x
            self._pair_parts: list[list[torch.Tensor]] = []
        else:
            self._pairs = [torch.empty(2, prev.numel(), device=dev) for _ in range(2)]
            self._pair_parts = [self._sampled_columns(r[0::3]) for r in self._rows]
        # The report's rows, in the order they are emitted, in one kept buffer: min, max,
        # absmax, drift (first the largest |x - ref|), reference absmax, judged scale,
        # consistency, weight decay. The per-parameter reductions write into it in place
        # (include_self=False: every parameter with an element is overwritten; one without
        # keeps the identity); the rows that change only with the references or the groups
        # are copied in when they do.
        self.flat = torch.empty(8 * self.n, device=dev)  # what is emitted: 1-D, no view per report
        self.out = self.flat.view(8, self.n)
        self.out[0] = float("inf")
        self.out[1:4] = float("-inf")
        self._min = self.out[0]
        self._max = self.out[1:4]
        self._max_rows = tuple(self._max.unbind())  # max, absmax, moved: views made once
        self._scale_row, self._judged_row = self.out[4], self.out[5]
        self._ratio_row = self.out[6]
        self.head = self.flat[: 6 * self.n]  # the rows before the consistency ratio
        self.wd_row = self.out[7]
        self._rows_of: tuple[torch.Tensor | None, ...] = (None, None, None)  # scale, judged, wd copied in
        self._owner3 = self.owner.expand(3, -1)
        # The rows are written over by the report (drift, values combined across ranks):
        # without an element a parameter's reductions would keep them.
        self._empty = 0 in self.counts
        # |sign sums| as float32: the per-parameter sum reduces them straight into the
        # ratio row (integers well inside float32's exact range)
        self._abs_sums = torch.empty(prev.numel(), device=dev)
        self._sampled_host = [float(max(k, 1)) for k in self.consistency.sizes]
        self._finishes: dict[tuple[int, bool, int], DriftFinish] = {}  # per rows, drift, changes in the window
        self._settle()

    def _settle(self) -> None:
        """Forget whether every reference has its range (after the references changed)."""
        # Whether every reference had a range at a past report, read without a sync: from
        # then on no reference is taken again, the scale and the judged scale stay the same.
        self._all_set = LateValue()
        self._settled: torch.Tensor | None = None  # the judged scale, clamped, once known fixed
        self._candidate: torch.Tensor | None = None  # the one the pending flag is about

    @property
    def prev(self) -> torch.Tensor:
        """The sampled values at the previous report (a view: written in place on load)."""
        return self.prev2[0]

    def _sampled_columns(self, pair: torch.Tensor) -> list[torch.Tensor]:
        """Views of the consistency sample's columns of ``pair`` [2, N], per parameter."""
        parts, start = [], 0
        for n, s in zip(self.consistency.counts, self.consistency.strides, strict=True):
            parts.append(pair[:, start : start + n : s])
            start += n
        return parts

    def values(self, dev: torch.device) -> torch.Tensor:
        """The local elements of the 1D parameters, end to end, as float32."""
        if not self.one_d:
            return torch.zeros(0, device=dev)
        out = torch.cat([flat(local(s.param)).to(dev, torch.float32, non_blocking=True) for s in self.one_d])
        return out.detach() if out.requires_grad else out  # one detach, only outside no_grad

    def take(self, dev: torch.device) -> torch.Tensor:
        """This report's elements, as :meth:`values`, written into a kept buffer that
        stays as it is until the report after the next one."""
        self._current = 1 if self._parity == 0 else 0
        out = self._values[self._current]
        with torch.no_grad():  # out= takes no tensor that needs a gradient
            torch.cat([flat(local(s.param)).to(dev, torch.float32, non_blocking=True) for s in self.one_d], out=out)
        return out

    def displacement(self, values: torch.Tensor) -> torch.Tensor:
        """Per parameter, the largest |x - ref| over its local elements."""
        return group_amax((values - self.ref_values).abs(), self.owner, self.n)

    def extremes(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per parameter, over its local elements (``values``: what :meth:`take` gave):
        the minimum ``[n]``, and ``[3, n]`` rows of the maximum, the largest ``|x|`` and
        the largest ``|x - ref|`` (one reduction for all). Both are rows of :attr:`out`:
        read them in this report."""
        if self._base_ref is not self.ref_values:  # a new reference (rare after the first reports)
            self._base_ref_row.copy_(self.ref_values)
            self._base_ref = self.ref_values
        k = self._current
        if self._empty:  # a parameter without local elements (a shard) must read the identities
            self._min.fill_(float("inf"))
            self._max.fill_(float("-inf"))
        torch.sub(self._base, values, out=self._negated[k])  # 0 - x, ref - x, 0 - x
        self._absolute[k].abs_()
        self._max.scatter_reduce_(1, self._owner3, self._reduced[k], "amax", include_self=False)
        self._min.scatter_reduce_(0, self.owner, values, "amin", include_self=False)
        return self._min, self._max

    def max_rows(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows (max, absmax, moved) of :attr:`out`, with ``low`` and ``high``
        (:meth:`extremes` combined across ranks) copied in when they are other tensors."""
        if low is not self._min:
            self._min.copy_(low)
        if high is not self._max:
            self._max.copy_(high.view(3, self.n))
        return self._max_rows

    def constant_rows(self, wd: torch.Tensor) -> None:
        """Copy the reference absmax, the judged scale and the weight decay into
        :attr:`out` when they are other tensors than the ones copied last."""
        kept = self._rows_of
        if kept[0] is not self.scale:
            self._scale_row.copy_(self.scale)
        if kept[1] is not self.judged:
            self._judged_row.copy_(self.judged)
        if kept[2] is not wd:
            self.wd_row.copy_(wd)
        self._rows_of = (self.scale, self.judged, wd)

    def drift_bits(
        self, values: torch.Tensor, absmax: torch.Tensor, scale: torch.Tensor, moved: torch.Tensor
    ) -> torch.Tensor:
        """``param_drift_log2`` from the combined absmax, reference scale and displacement.
        Once the scales are settled (below), the row keeps the displacement and
        :meth:`finish` makes the drift of it on the sender thread.
        A parameter still all zeros at its reference takes, at the first report where it
        is not, its values then as its reference (drift 0 there). Once every reference is
        known (a report later, without a sync) to have a range, only the last step is left:
        nothing else can change (the combined scale is then this scale on every rank).
        Written into :attr:`out`'s drift row (``moved`` may be that row)."""
        out = self._max_rows[2]
        if self._settled is None and self._candidate is not None and self._all_set.get() == [True]:
            self._settled = self._candidate
        if self._settled is not None:  # the row keeps the displacement: the sender thread finishes it
            return out
        had = scale > 0  # a reference with a range; else it takes the values now (0 while all zeros)
        self.scale = torch.where(had, scale, absmax)
        has = self.scale > 0
        fresh = has > had  # the parameters that take their reference now
        self.ref_values = torch.where(fresh[self.owner], values, self.ref_values)
        # A scale that matters: a reference orders of magnitude below the model's other 1D
        # parameters (a zero-initialised bias Adam nudged to 1e-8) is judged against
        # NEIGHBOUR_FLOOR x their median scale, not against itself (1e-8 -> 1e-7 is no range).
        known = torch.where(has, self.scale, self._nan)
        floor = torch.nan_to_num(torch.nanmedian(known), nan=0.0) * NEIGHBOUR_FLOOR
        self.judged = torch.maximum(self.scale, floor)
        self._candidate = self.judged.clamp_min(_SCALE_FLOOR)
        self._all_set.start(has.all())
        # 0 where the reference is taken now (no displacement yet) or is still all zeros
        return torch.where(had, torch.addcdiv(self._one, moved, self._candidate).log2_(), self._zero, out=out)

    def save_references(self) -> None:
        """Write the (possibly updated) references back to the per-parameter table."""
        for s, ref_values, scale in zip(
            self.one_d, self.ref_values.split(self.counts), self.scale.unbind(), strict=True
        ):
            self.refs[id(s.param)] = Reference(ref_values, scale)

    def pair(self) -> torch.Tensor:
        """This report's sampled values and their negations [2, S] (after :meth:`extremes`)."""
        k = self._current
        if self._pair_parts:
            torch.cat(self._pair_parts[k], dim=1, out=self._pairs[k])
        return self._pairs[k]

    def restart(self, now2: torch.Tensor) -> None:
        """Take :meth:`pair` as the previous values without recording a change."""
        self.prev2, self._parity = now2, self._current

    def record_change(self, now2: torch.Tensor) -> None:
        """Push sign(now - prev) of the sampled elements into the ring (NaN: no change).
        ``now2`` (:meth:`pair`) becomes the previous values: the caller writes it no more."""
        # [now > prev, -now > -prev]: up and down in one comparison (False for NaN)
        torch.gt(now2, self.prev2, out=self._updown)
        slot = self._slots[self.changes % self.window]
        self.sums.sub_(slot)  # the oldest sign leaves the window,
        torch.sub(self._up, self._down, out=slot)  # the new one takes its place in the ring
        self.sums.add_(slot)
        self.changes += 1
        self.restart(now2)

    def mean_abs_sign(self) -> torch.Tensor:
        """Per sampled element, |mean sign| over the changes in the window."""
        return self.sums.abs() / min(self.changes, self.window)

    def abs_sign_sums(self) -> torch.Tensor:
        """Per parameter, the sum over its sampled elements of |sum of the signs in the
        window| (an integer, as float32), written into :attr:`out`'s ratio row: read it in
        this report. :meth:`finish` (one process) or :meth:`consistency_ratio` divides it."""
        torch.abs(self.sums, out=self._abs_sums)
        if self._empty:  # a parameter without local elements (a shard) sums to 0
            self._ratio_row.zero_()
        return self._ratio_row.scatter_reduce_(0, self.sampled_owner, self._abs_sums, "sum", include_self=False)

    def consistency_ratio(self, sign_sums: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """``param_drift_consistency_ratio`` from :meth:`abs_sign_sums` and the sampled
        element counts, both combined across shards: the mean |mean sign| per element."""
        w = min(self.changes, self.window)
        return torch.div(sign_sums, sampled.clamp_min(1) * w, out=self._ratio_row)

    def finish(self, rows: int, ratio: bool) -> DriftFinish | None:
        """What the sender thread does to this report's first ``rows`` rows of :attr:`out`:
        the drift from the displacement once the scales are settled, and (``ratio``) the
        consistency row's division by the sampled elements; None when neither."""
        drift = self._settled is not None
        if not drift and not ratio:
            return None
        key = (rows, drift, min(self.changes, self.window) if ratio else 0)
        found = self._finishes.get(key)  # a handful: the window fills in its first reports
        if found is None:
            den = [k * key[2] for k in self._sampled_host] if ratio else None
            found = self._finishes[key] = DriftFinish(self.n, rows, drift, den)
        return found

    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """References, sign ring and change count per parameter name (CPU tensors)."""
        self.save_references()
        per_param: dict[str, Any] = {}
        sizes = self.consistency.sizes
        for s, prev, ring in zip(self.one_d, self.prev.split(sizes), self.ring.split(sizes, dim=1), strict=True):
            ref = self.refs[id(s.param)]
            per_param[s.name] = {
                "ref": ref.values.cpu(),
                "scale": ref.scale.cpu(),
                "prev": prev.cpu(),
                "ring": ring.cpu(),
            }
        return {"changes": self.changes, "window": self.window, "params": per_param}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Restore what matches by name and shape; return the names restored."""
        saved = state.get("params", {})
        same_window = state.get("window") == self.window
        restored = []
        sizes = self.consistency.sizes
        start = 0
        for s, count, size in zip(self.one_d, self.counts, sizes, strict=True):
            entry = saved.get(s.name)
            if entry is not None and entry["ref"].numel() == count:
                dev = self.prev.device
                ref = Reference(entry["ref"].to(dev, torch.float32), entry["scale"].to(dev, torch.float32))
                self.refs[id(s.param)] = ref
                if same_window and entry["ring"].shape == (self.window, size):
                    saved_prev = entry["prev"].to(dev, torch.float32)
                    self.prev2[0, start : start + size] = saved_prev
                    self.prev2[1, start : start + size] = 0 - saved_prev
                    self.ring[:, start : start + size] = entry["ring"].to(dev)
                restored.append(s.name)
            start += size
        chosen = [self.refs[id(s.param)] for s in self.one_d]
        if chosen:
            self.ref_values = torch.cat([r.values for r in chosen])
            self.scale = torch.stack([r.scale for r in chosen])
        self._settle()
        if same_window:
            self.changes = int(state.get("changes", 0))
            self.sums = self.ring.sum(0, dtype=torch.float32)
            self._slots = list(self.ring.unbind(0))
        return restored


class DriftFinish:
    """On the sender thread, the rows of :attr:`DriftTracker.out` a report sends: with
    ``drift``, the drift row becomes ``log2(1 + displacement / judged scale)`` (the judged
    scale is its own row, floored as the device floored it); with ``ratio_den``, the
    consistency row's sums are divided by the sampled elements times the window."""

    def __init__(self, n: int, rows: int, drift: bool, ratio_den: list[float] | None) -> None:
        self.n, self.rows, self.drift, self.ratio_den = n, rows, drift, ratio_den

    def __call__(self, raw: list[float]) -> list[float]:
        n = self.n
        if len(raw) != self.rows * n:
            raise ValueError(f"DriftFinish: {len(raw)} values for {self.rows} rows of {n}")
        out = list(raw)
        if self.drift:
            judged = raw[5 * n : 6 * n]
            out[3 * n : 4 * n] = [drift_log2(moved, j) for moved, j in zip(raw[3 * n : 4 * n], judged, strict=True)]
        if self.ratio_den is not None:
            out[6 * n : 7 * n] = [div(v, d) for v, d in zip(raw[6 * n : 7 * n], self.ratio_den, strict=True)]
        return out
