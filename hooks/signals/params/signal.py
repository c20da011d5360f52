"""1D parameter drift (I4): range, bits gained since attach, sign consistency of the
recent changes, weight decay, and how much gradient the parameter gets compared
with the rest of the model.

Per 1D parameter of the optimizer (``ndim <= 1``, scalars included; chosen and
capped by :mod:`~trainvitals.hooks.signals.param_series`), label ``param``:

- ``param_min`` / ``param_max`` / ``param_absmax``: its range after the step.
- ``param_drift_log2`` = log2(1 + max |x - x_ref| / absmax(x_ref)): the bits of range
  its largest displacement from the reference amounts to (docs/incidents.md, I4:
  1.0 -> 56 is 5.8 bits; a walk through zero, 1.0 -> -0.34, is 1.2). The reference
  is taken in ``bind`` (for a parameter the optimizer gains later: when the monitor
  first sees it); a parameter that is all zeros then (a zero-initialized bias) takes
  as reference its value at the first report where it is non-zero; while it stays
  0 it reads 0. ``Monitor.state_dict()`` carries references across resumes.
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

A weight-decay audit runs at attach (:mod:`~trainvitals.hooks.signals.params.weight_decay`).
The drift state lives in :mod:`~trainvitals.hooks.signals.params.drift`.

Sharded parameters (FSDP2, tensor-parallel DTensors): every rank reduces its local
piece; minima, maxima and sums (gradient sums of squares, consistency sums and
element counts) are combined in the report's one collective, a piece that k ranks
hold alike (replicated) counting 1/k on each (``MonitorView.weight_of``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from trainvitals.hooks.grad_norms import GradNorms
from trainvitals.hooks.host_finish import GradRmsFinish
from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.signals.base import REBINDING, MonitorView, Removable, Signal
from trainvitals.hooks.signals.param_series import choose, groups_key
from trainvitals.hooks.signals.params.drift import DriftTracker, Reference
from trainvitals.hooks.signals.params.weight_decay import audit_weight_decay
from trainvitals.hooks.step import ReduceOp, StepContext
from trainvitals.wire.signals import SignalSpec

log = logging.getLogger("trainvitals")

_TINY = torch.finfo(torch.float32).tiny

_ROWS = (
    "param_min",
    "param_max",
    "param_absmax",
    "param_drift_log2",
    "param_drift_reference_absmax",
    "param_drift_scale",
    "param_drift_consistency_ratio",
    "param_weight_decay",
)
"""The wire names of the rows of :attr:`DriftTracker.out`, in order."""


class ParamHealth(Signal):
    spec = SignalSpec(
        name="params",
        covers="1D parameter drift (I4)",
        how_to_ask="signals= leaves out 'params'",
        group="params",
        title="1D parameters (I4)",
        dashboard="trainvitals-params.json",
        selectable=True,
        per_parameter_sums=True,
        per_param_series=True,
    )
    covers = spec.name
    uses_grad_norms = True

    def __init__(self) -> None:
        self._refs: dict[int, Reference] = {}
        self._restore: dict[str, Any] | None = None  # a loaded state waiting for its tracker
        self._key: tuple[Any, ...] | None = None
        self._drift: DriftTracker | None = None
        self._fresh = False  # tracker rebuilt at this report: no change to record yet
        self._indices = IndexCache()
        self._series: tuple[Any, ...] = (None,)
        self._grad_key: tuple[Any, ...] | None = None
        self._grad_layout: tuple[list[dict[str, str]], GradRmsFinish] | None = None

    # -- attach ----------------------------------------------------------------
    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._build(monitor)
        self._fresh = False  # the reference is the value at attach: the first report is a change
        audit_weight_decay(monitor)
        return []

    def _build(self, monitor: MonitorView) -> None:
        if self._drift is not None:
            self._drift.save_references()
        self._key = groups_key(monitor)
        series = choose(monitor)
        for s in series:
            if s.param.ndim <= 1 and id(s.param) not in self._refs:
                self._refs[id(s.param)] = Reference.of(s.param, monitor.device)
        self._drift = DriftTracker(monitor, series, self._refs)
        self._fresh = True
        if self._restore is not None:
            self._apply(self._restore)

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self._drift.state_dict() if self._drift is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restore = state
        self._restore_quiet = REBINDING.get()  # its own state back after a live settings change
        if self._drift is not None:
            self._apply(state)

    def _apply(self, state: dict[str, Any]) -> None:
        assert self._drift is not None
        restored = self._drift.load_state_dict(state)
        if restored:
            self._fresh = False  # the saved previous values are the baseline of the next change
        if not (REBINDING.get() or getattr(self, "_restore_quiet", False)):  # a live change: not a checkpoint
            log.info(
                "trainvitals: 1D drift continues from the checkpoint for %d of %d parameters",
                len(restored),
                self._drift.n,
            )

    # -- step ------------------------------------------------------------------
    def _tracker(self, monitor: MonitorView) -> DriftTracker:
        if groups_key(monitor) != self._key:
            log.info("trainvitals: the optimizer's param groups changed; 1D drift consistency restarts")
            self._build(monitor)
        assert self._drift is not None
        return self._drift

    def before_step(self, monitor: MonitorView, reporting: bool) -> None:
        if reporting:  # parameters new to the groups: their references before their first step
            self._tracker(monitor)

    def _grad_rms_layout(
        self, monitor: MonitorView, drift: DriftTracker, step_norms: GradNorms
    ) -> tuple[list[dict[str, str]], GradRmsFinish]:
        """For the step's gradient norms: the labels of the series that have a gradient,
        and what makes their relative RMS from the norms (the root of each one's global
        element count, their positions). Kept while the tracker, the parameters with a
        gradient and sharding stay the same."""
        sharded = monitor.sharded
        key = (drift, tuple(map(id, step_norms.params)), sharded)
        if key == self._grad_key and self._grad_layout is not None:
            return self._grad_layout
        # the root of each global element count (DTensor.numel is global): RMS = norm / root
        roots = [math.sqrt(monitor.numel_of(p)) for p in step_norms.params]
        grad_series = [(s.name, j) for s in drift.series if (j := step_norms.position(s.param)) is not None]
        labels = [{"param": name} for name, _ in grad_series]
        # across shards the squared norms were summed: their roots are the norms
        finish = GradRmsFinish(roots, [j for _, j in grad_series], squared=sharded, floor=_TINY)
        self._grad_key = key
        self._grad_layout = (labels, finish)
        return self._grad_layout

    def _weight_decay(self, monitor: MonitorView, drift: DriftTracker) -> torch.Tensor:
        groups = monitor.optimizer.param_groups
        wds = [groups[s.group].get("weight_decay", 0.0) for s in drift.one_d]
        if any(isinstance(w, torch.Tensor) for w in wds):
            return torch.stack([torch.as_tensor(w, dtype=torch.float32).to(monitor.device).reshape(()) for w in wds])
        return self._indices.get([float(w) for w in wds], monitor.device, torch.float32)

    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        drift = self._tracker(monitor)
        dev = monitor.device
        parts: list[tuple[torch.Tensor, ReduceOp]] = []
        consistency = False
        n = drift.n
        if not n:
            ctx.inactive_when("params", None, "no_parameters", "the optimizer holds no 1D parameter to watch")
        if n:
            values = drift.take(dev)
            low, high = drift.extremes(values)
            parts += [(low, "min"), (high, "max"), (drift.scale, "max")]
            now = drift.pair()
            if not self._fresh:
                drift.record_change(now)
            else:
                drift.restart(now)
            if drift.changes:
                consistency = True
                parts += [(drift.abs_sign_sums(), "sum"), (drift.sampled, "sum")]
        self._fresh = False
        step_norms = ctx.grad_norms
        sharded = monitor.sharded
        grads = False
        problem = monitor.grad_layout_problem(step_norms.params) if step_norms is not None else None
        if problem is not None:  # the other figures stand; the gradient's are withheld, said once
            monitor.warn_once("grad_layout", "%s (param_grad_relative_rms)", problem)
        elif step_norms is not None and step_norms.params:
            grad_labels, grad_finish = self._grad_rms_layout(monitor, drift, step_norms)
            if grad_labels:
                grads = True
                # across shards the squares add up; in one process the norms are what it takes
                squares = step_norms.norms.square() if sharded else step_norms.norms
                if monitor.weighted:  # replicated pieces: each copy counts 1 / k
                    squares = squares * step_norms.shares(monitor.weight_of)
                parts.append((squares, "sum"))
        wd = self._weight_decay(monitor, drift) if n else None
        if self._series[0] is not drift:  # the block's series, made once per tracker
            rows = [(name, drift.labels) for name in _ROWS]
            self._series = (drift, rows, rows[:6])
        _, *series = self._series

        def finish(*combined: torch.Tensor) -> None:
            # The 1D rows lie end to end in the tracker's kept buffer, in the order of the
            # report: one block emit (two before the first change, without the ratio row).
            rest = list(combined)
            if n:
                pmin, high, scale = rest.pop(0), rest.pop(0), rest.pop(0)
                _, absmax, moved = drift.max_rows(pmin, high)
                # The combined scale is the same on every rank, so every rank keeps the same.
                drift.drift_bits(values, absmax, scale, moved)
                assert wd is not None  # computed above whenever n
                # The reference's absmax and the scale judged against: what the collector needs
                # to judge a run resumed without the monitor's state over its whole life.
                drift.constant_rows(wd)
                if consistency:
                    sign_sums, sampled = rest.pop(0), rest.pop(0)
                    if sharded:  # the sampled counts combined across shards: divided here
                        drift.consistency_ratio(sign_sums, sampled)
                    ctx.emit_block(series[0], drift.flat, host=drift.finish(8, ratio=not sharded))
                else:
                    ctx.emit_block(series[1], drift.head, host=drift.finish(6, ratio=False))
                    ctx.emit(_ROWS[7], drift.wd_row, drift.labels)
            if grads:
                # Each RMS over the median RMS: the sender thread divides (a handful of numbers)
                ctx.emit_block([("param_grad_relative_rms", grad_labels)], rest.pop(0), host=grad_finish)

        ctx.combine(parts, finish, across_ranks=monitor.sharded)

    def close(self) -> None:
        self._drift = None
        self._refs.clear()
