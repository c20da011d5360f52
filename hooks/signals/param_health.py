"""1D parameter drift (I4): range, bits gained since attach, sign consistency of the
recent changes, weight decay, and how much gradient the parameter gets compared
with the rest of the model.

Per 1D parameter of the optimizer (``ndim <= 1``, scalars included; chosen and
capped by :mod:`param_series`), label ``param``:

- ``param_min`` / ``param_max`` / ``param_absmax``: its range after the step.
- ``param_drift_log2`` = log2(absmax / absmax at attach), the bits of dynamic range
  gained (INCIDENTS.md I4: 1.0 -> 56 is 5.8 bits). The reference is taken in
  ``bind`` (for a parameter the optimizer gains later: when the monitor first sees
  it, before its first step). A parameter that is all zeros at attach (a
  zero-initialized bias) takes as reference its absmax at the first report where
  it is non-zero, so it counts the bits gained since it started to move; while it
  stays 0 it reads 0.
- ``param_drift_consistency_ratio``: per element, the signs of its changes between
  consecutive reports (+1, -1, 0 when unchanged) over the last ``drift_window``
  reports; |mean sign| per element, averaged over the elements (at most 1024 per
  parameter, a deterministic strided sample beyond that). 1: every element walks
  one way (Adam amplifying biased noise); near 0: noise or no movement. Per
  element rather than the sign of the mean change, so a vector whose elements
  walk in different directions still reads 1. Absent until one change is seen.
  Alone it does not tell the incident from a bias the loss moves steadily at a
  high learning rate (that reads 1 too); ``param_grad_relative_rms`` does.
- ``param_weight_decay``: the ``weight_decay`` of its param group (0: none).
- ``param_grad_relative_rms``: its gradient RMS over the median (torch.median:
  the lower middle value for an even count) of the per-parameter gradient RMS of
  all the optimizer's parameters that have a gradient on this step. Tiny when
  Adam, not the loss, moves the parameter; absent when it has no gradient. With
  ``per_param=True`` also for the parameters with ndim >= 2 that have a series.

A weight-decay audit runs at attach: one log line and a ``weight_decay_audit``
event in the first report name the 1D parameters that get no weight decay.

Sharded parameters (FSDP2 DTensors): every rank reduces its local shard; minima,
maxima and sums (gradient sums of squares, consistency sums and element counts)
are combined in the report's one collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from trainvitals.hooks.signals.base import Signal, StepContext
from trainvitals.hooks.signals.param_series import (
    Series,
    choose,
    flat,
    groups_key,
    stride_for,
)
from trainvitals.hooks.tensors import group_amax, group_amin, group_sum, local

log = logging.getLogger("trainvitals")

_CONSISTENCY_SAMPLE = 1024  # elements per parameter whose change signs are kept
_TINY = torch.finfo(torch.float32).tiny
_AUDIT_NAMES = 5


def _counts_index(counts: list[int], device: torch.device) -> torch.Tensor:
    """Element -> owner index for tensors of ``counts`` elements laid end to end."""
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long)).to(device)


class _Layout:
    """Per-layout buffers: which parameters, their element index, the sign ring."""

    def __init__(self, monitor: Any, series: list[Series], refs: dict[int, torch.Tensor]):
        dev = monitor.device
        self.series = series
        self.one_d = [s for s in series if s.param.ndim <= 1]
        self.labels = [{"param": s.name} for s in self.one_d]
        self.n = len(self.one_d)
        # Complex parameters count as (real, imaginary) pairs, as Adam treats them.
        counts = [flat(local(s.param).detach()).numel() for s in self.one_d]
        self.counts = counts
        self.idx = _counts_index(counts, dev)
        self.strides = [stride_for(c, _CONSISTENCY_SAMPLE) for c in counts]
        sampled = [-(-c // st) for c, st in zip(counts, self.strides)]
        self.dense = all(st == 1 for st in self.strides)
        self.sidx = self.idx if self.dense else _counts_index(sampled, dev)
        self.sampled = torch.tensor(sampled, dtype=torch.float32).to(dev)
        self.ref = (torch.stack([refs[id(s.param)] for s in self.one_d]).to(dev, torch.float32)
                    if self.one_d else torch.zeros(0, device=dev))
        window = monitor.config.drift_window
        self.window = window
        self.prev = self.sample(self.values(dev)).clone()
        self.ring = torch.zeros(window, self.prev.numel(), dtype=torch.int8, device=dev)
        self.sums = torch.zeros(self.prev.numel(), dtype=torch.int32, device=dev)
        self.changes = 0

    def values(self, dev: torch.device) -> torch.Tensor:
        """The local elements of the 1D parameters, end to end, as float32."""
        if not self.one_d:
            return torch.zeros(0, device=dev)
        return torch.cat([flat(local(s.param).detach()).to(dev, torch.float32, non_blocking=True)
                          for s in self.one_d])

    def sample(self, values: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return values
        parts, start = [], 0
        for n, st in zip(self.counts, self.strides):
            parts.append(values[start : start + n : st])
            start += n
        return torch.cat(parts)

    def record_change(self, now: torch.Tensor) -> None:
        """Push sign(now - prev) into the ring (NaN compares as no change)."""
        sign = (now > self.prev).to(torch.int8) - (now < self.prev).to(torch.int8)
        slot = self.changes % self.window
        self.sums += sign - self.ring[slot]
        self.ring[slot] = sign
        self.changes += 1
        self.prev.copy_(now)


class _Join:
    """Collects the cross-rank combinations of several partials, then calls ``finish``
    once with all of them (at once when nothing is sharded)."""

    def __init__(self, ctx: StepContext, sharded: bool, finish: Callable[..., None]):
        self.ctx, self.sharded, self.finish = ctx, sharded, finish
        self.parts: list[tuple[torch.Tensor, str]] = []

    def add(self, t: torch.Tensor, op: str) -> None:
        self.parts.append((t, op))

    def run(self) -> None:
        if not self.sharded:
            self.finish(*(t for t, _ in self.parts))
            return
        out: list[torch.Tensor | None] = [None] * len(self.parts)

        def store(i: int, t: torch.Tensor) -> None:
            out[i] = t
            if all(o is not None for o in out):
                self.finish(*out)

        for i, (t, op) in enumerate(self.parts):
            self.ctx.reduce(t, op, lambda c, i=i: store(i, c))  # type: ignore[arg-type]


class ParamHealth(Signal):
    def __init__(self) -> None:
        self._refs: dict[int, torch.Tensor] = {}
        self._key: tuple | None = None
        self._layout: _Layout | None = None
        self._fresh = False  # layout rebuilt at this report: no change to record yet
        self._wd_key: tuple | None = None
        self._wd: torch.Tensor | None = None
        self._grad_sq: torch.Tensor | None = None
        self._grad_numel: torch.Tensor | None = None
        self._grad_numel_key: tuple | None = None
        self._grad_pos_key: tuple | None = None
        self._grad_pos: torch.Tensor | None = None  # series with a gradient -> gradient position
        self._grad_labels: list[dict[str, str]] = []

    # -- attach ----------------------------------------------------------------
    def bind(self, monitor: Any) -> list:
        self._build(monitor)
        self._fresh = False  # the reference is the value at attach: the first report is a change
        self._audit(monitor)
        return []

    def _build(self, monitor: Any) -> None:
        self._key = groups_key(monitor)
        series = choose(monitor)
        dev = monitor.device
        for s in series:
            if s.param.ndim <= 1 and id(s.param) not in self._refs:
                v = flat(local(s.param).detach())
                self._refs[id(s.param)] = (v.abs().amax().to(dev, torch.float32) if v.numel()
                                           else torch.zeros((), device=dev))
        self._layout = _Layout(monitor, series, self._refs)
        self._fresh = True

    def _audit(self, monitor: Any) -> None:
        one_d: list[tuple[str, bool]] = []
        for label, group in monitor.groups():
            wd = group.get("weight_decay", 0.0)
            decays = bool(float(wd) != 0.0)  # attach time, not the training step
            for i, p in enumerate(group["params"]):
                if p.ndim <= 1:
                    one_d.append((monitor.name_of(p, f"{label}.{i}"), decays))
        none = sorted(name for name, decays in one_d if not decays)
        msg = f"weight-decay audit: {len(none)} of {len(one_d)} 1D parameters get no weight decay"
        if none:
            shown = ", ".join(none[:_AUDIT_NAMES])
            more = f" and {len(none) - _AUDIT_NAMES} more" if len(none) > _AUDIT_NAMES else ""
            msg += f": {shown}{more} (under Adam, nothing pulls them back if they drift; INCIDENTS I4)"
        log.info("trainvitals: %s", msg)
        monitor.event("weight_decay_audit", msg, {})

    # -- step ------------------------------------------------------------------
    def _ensure_layout(self, monitor: Any) -> _Layout:
        if groups_key(monitor) != self._key:
            log.info("trainvitals: the optimizer's param groups changed; 1D drift consistency restarts")
            self._build(monitor)
        assert self._layout is not None
        return self._layout

    def before_step(self, monitor: Any, reporting: bool) -> None:
        if not reporting:
            return
        self._ensure_layout(monitor)
        params, norms = monitor.grad_norms()  # shared with OptimizerStats: one foreach call
        dev = monitor.device
        if not params:
            self._grad_sq = None
            return
        self._grad_sq = norms.square()
        numel_key = tuple(p.numel() for p in params)  # global sizes (DTensor.numel is global)
        if numel_key != self._grad_numel_key:
            self._grad_numel_key = numel_key
            self._grad_numel = torch.tensor(numel_key, dtype=torch.float32).to(dev)
        where = {id(p): j for j, p in enumerate(params)}
        series = self._layout.series if self._layout else []
        grad_series = [(i, where[id(s.param)]) for i, s in enumerate(series) if id(s.param) in where]
        key = (id(self._layout), tuple(grad_series))
        if key != self._grad_pos_key:
            self._grad_pos_key = key
            self._grad_pos = torch.tensor([j for _, j in grad_series], dtype=torch.long).to(dev)
            self._grad_labels = [{"param": series[i].name} for i, _ in grad_series]

    def _weight_decay(self, monitor: Any, lay: _Layout) -> torch.Tensor:
        groups = monitor.optimizer.param_groups
        wds = [groups[s.group].get("weight_decay", 0.0) for s in lay.one_d]
        if any(isinstance(w, torch.Tensor) for w in wds):
            return torch.stack([torch.as_tensor(w, dtype=torch.float32).to(monitor.device).reshape(())
                                for w in wds])
        key = (id(lay), tuple(wds))
        if key != self._wd_key:
            self._wd_key = key
            self._wd = torch.tensor([float(w) for w in wds], dtype=torch.float32).to(monitor.device)
        return self._wd

    def collect(self, monitor: Any, ctx: StepContext) -> None:
        lay = self._ensure_layout(monitor)
        dev = monitor.device
        join = _Join(ctx, monitor.sharded, lambda *t: None)
        consistency = False
        if lay.n:
            values = lay.values(dev)
            join.add(group_amin(values, lay.idx, lay.n), "min")
            join.add(torch.cat([group_amax(values, lay.idx, lay.n), lay.ref]), "max")
            now = lay.sample(values)
            if not self._fresh:
                lay.record_change(now)
            else:
                lay.prev.copy_(now)
            count = min(lay.changes, lay.window)
            if count:
                consistency = True
                mean_abs = lay.sums.abs().to(torch.float32) / count
                join.add(torch.cat([group_sum(mean_abs, lay.sidx, lay.n), lay.sampled]), "sum")
        self._fresh = False
        grads = self._grad_sq is not None and bool(self._grad_labels)
        if grads:
            join.add(self._grad_sq, "sum")
        wd = self._weight_decay(monitor, lay) if lay.n else None
        n = lay.n
        grad_numel, grad_pos, grad_labels = self._grad_numel, self._grad_pos, self._grad_labels
        self._grad_sq = None

        def finish(*parts: torch.Tensor) -> None:
            parts_list = list(parts)
            if n:
                pmin = parts_list.pop(0)
                mx = parts_list.pop(0)
                pmax, ref = mx[:n], mx[n:]
                absmax = torch.maximum(pmax, -pmin)
                # All-zero at attach: the first non-zero absmax becomes the reference. The
                # combined values are the same on every rank, so every rank keeps the same.
                ref = torch.where(ref > 0, ref, absmax)
                lay.ref = ref
                ctx.emit("param_min", pmin, lay.labels)
                ctx.emit("param_max", pmax, lay.labels)
                ctx.emit("param_absmax", absmax, lay.labels)
                ctx.emit("param_drift_log2", torch.log2(absmax.clamp_min(_TINY) / ref.clamp_min(_TINY)),
                         lay.labels)
                if consistency:
                    sums = parts_list.pop(0)
                    ctx.emit("param_drift_consistency_ratio", sums[:n] / sums[n:].clamp_min(1), lay.labels)
                ctx.emit("param_weight_decay", wd, lay.labels)
            if grads:
                sq = parts_list.pop(0)
                rms = (sq / grad_numel).sqrt()
                median = torch.median(rms).clamp_min(_TINY)
                ctx.emit("param_grad_relative_rms", rms[grad_pos] / median, grad_labels)

        join.finish = finish
        join.run()

    def close(self) -> None:
        self._layout = None
        self._refs.clear()
        self._grad_sq = None
