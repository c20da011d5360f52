"""Loss accounting, per-step bookkeeping: what the optimizer step now being
accumulated has gathered, and the helpers every capture path shares.

:class:`StepBook` is the base of
:class:`~trainvitals.hooks.signals.loss.signal.LossAccounting`: it keeps the step
in progress (a new one when the optimizer step count moves, or when a
``GradScaler`` skipped the step), its sums vector on the loss's device (laid out
by :class:`~trainvitals.hooks.signals.loss.binning.SumsLayout`),
the objectives' slots, the cumulative count of micro-batches with a non-finite
loss, the scaler's inverse scale read at hook time, and the wrapper that makes a
tensor hook skip the probe's own backward and never raise into the user's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainvitals.hooks.late_warnings import LateWarnings
from trainvitals.hooks.signals.base import MonitorView, Signal
from trainvitals.hooks.signals.loss.arguments import MAX_OBJECTIVES
from trainvitals.hooks.signals.loss.binning import (
    UNIFORM_RTOL,
    Batch,
    output_finish,
    output_norms,
    weight_finish,
    weight_rows,
)
from trainvitals.hooks.signals.loss.deferred import Deferred, add_weights
from trainvitals.hooks.signals.loss.layout import SumsLayout
from trainvitals.hooks.signals.loss.plan import ROWS
from trainvitals.hooks.signals.loss.probe import ModalityProbe
from trainvitals.hooks.signals.loss.report import LossReport
from trainvitals.hooks.tensors import float_dtype

__all__ = ["LossStep", "StepBook"]

ROWS_TOTALLED = len(ROWS)
"""The per-bin rows at the start of the sums that a report totals over bins."""


@dataclass
class LossStep:
    """What the optimizer step now being accumulated has gathered so far."""

    token: tuple[int, Any]
    reporting: bool
    probe: bool
    calls: list[int] = field(default_factory=lambda: [0] * MAX_OBJECTIVES)  # micro-batches per objective
    weights: dict[int, float] = field(default_factory=dict)  # declared weight per objective slot
    normalization: str | None = None  # declared by a track_loss call of the step
    tracked: int = 0
    fired: int = 0
    outputs: int = 0
    sums: torch.Tensor | None = None  # [layout.size], float64 (float32 on mps)
    extremes: torch.Tensor | None = None  # [layout.extremes]: per objective wmax, -wmin, non-uniform
    output: torch.Tensor | None = None  # sums[layout.output]
    counter: torch.Tensor | None = None  # sums[layout.nonfinite], 0-d
    rows: torch.Tensor | None = None  # the sums' first per-bin rows, [ROWS_TOTALLED, bins] (a view)
    probe_grads: torch.Tensor | None = None  # [M, P] per-modality parameter gradients
    layout: str = ""  # zero-code: why the head's output was not read as logits (the last such)
    several: bool = False  # a micro-batch held several samples (Megatron's per-sample intent then fails)
    declared: bool = False  # a track_loss call of the step declared its normalization (nothing implied then)
    withheld: str = ""  # why the samples of a packed micro-batch cannot be known (per-sample figures withheld)
    # the micro-batch results its hooks leave to the report (one rank, figures made on
    # the host, no probe): None when the hooks add their sums themselves
    later: Deferred | None = None


class StepBuffers:
    """The sums and weight extremes (``SumsLayout.extremes``) of a reported step, in one
    kept tensor per device with its views made once, reset with one copy. Two, taken in turn: a step waiting
    for its report (or a step replaced while its hooks may still run) keeps its own
    while the next step's first micro-batch resets the other one."""

    def __init__(self, layout: SumsLayout) -> None:
        self.layout = layout
        self._key: tuple[torch.device, torch.dtype] | None = None
        self._template: torch.Tensor | None = None
        self._pair: list[tuple[torch.Tensor, ...]] = []
        self._turn = 0

    def take(self, step: LossStep, device: torch.device) -> None:
        """Give ``step`` the next buffer, reset: sums 0, extremes -inf (none seen)."""
        fdt = float_dtype(device)
        template = self._template
        if template is None or self._key != (device, fdt):
            lay = self.layout
            values = [0.0] * lay.size + [float("-inf")] * lay.extremes
            template = self._template = torch.tensor(values, dtype=fdt).to(device)
            self._pair = []
            for _ in range(2):
                whole = torch.empty_like(template)
                sums = whole[: lay.size]
                rows = sums[: ROWS_TOTALLED * lay.bins].view(ROWS_TOTALLED, lay.bins)
                self._pair.append((whole, sums, whole[lay.size :], sums[lay.output], sums[lay.nonfinite], rows))
            self._key = (device, fdt)
        self._turn ^= 1
        whole, step.sums, step.extremes, step.output, step.counter, step.rows = self._pair[self._turn]
        whole.copy_(template)


class StepBook(Signal):
    """The per-step state of loss accounting and the helpers its capture paths share."""

    def __init__(self) -> None:
        self._step: LossStep | None = None
        self._final: LossStep | None = None
        self._nonfinite: torch.Tensor | None = None  # cumulative, on the loss's device
        self._probing = False  # set while the probe runs its own backward passes
        self._late = LateWarnings()
        self._layout: SumsLayout | None = None
        self._probe: ModalityProbe | None = None
        self._closed = False
        self._objectives: dict[str, int] = {}  # name -> slot in the per-objective sums
        self._buffers: StepBuffers | None = None
        self._generation = 0  # bumped by forget_step: tensor hooks made before it do nothing

    def forget_step(self) -> None:
        """Drop the step being accounted; the tensor hooks registered for it do nothing."""
        self._generation += 1
        self._step = None

    def _slot(self, objective: str) -> int:
        slot = self._objectives.get(objective)
        if slot is None:
            if len(self._objectives) >= MAX_OBJECTIVES:
                raise ValueError(
                    f"track_loss: objective {objective!r} would be the {MAX_OBJECTIVES + 1}th; "
                    f"at most {MAX_OBJECTIVES} are accounted ({sorted(self._objectives)})"
                )
            slot = self._objectives[objective] = len(self._objectives)
        return slot

    def _ensure_sums(self, step: LossStep, device: torch.device) -> None:
        if step.sums is None:
            assert self._layout is not None
            if self._buffers is None or self._buffers.layout is not self._layout:
                self._buffers = StepBuffers(self._layout)
            self._buffers.take(step, device)

    def _add_weights(self, step: LossStep, slot: int, values: torch.Tensor, extremes: torch.Tensor) -> None:
        """Add ``weight_finish``'s values of objective ``slot`` into the step's sums, and
        its extremes into the objective's (each by its maximum)."""
        assert self._layout is not None and step.sums is not None and step.extremes is not None
        add_weights(self._layout, step.sums, step.extremes, slot, values, extremes)

    def _weights(self, step: LossStep, slot: int, b: Batch, w: torch.Tensor, rtol: float = UNIFORM_RTOL) -> None:
        """A hook's token weights ``w`` of objective ``slot``: their sums added into the
        step's, or their reduction over the tokens kept for the report."""
        layout = self._layout
        assert layout is not None
        later = step.later
        if later is not None and later.fits(3 * b.n_samples + 2 * b.shape[0]):
            w_s, top = weight_rows(layout, b, w, per_row=True)
            if later.weights(slot, w_s, top, b.log_n, b.s_bin, b.rows_as_samples, rtol):
                return
        else:
            w_s, top = weight_rows(layout, b, w)
        if later is not None:  # the step keeps no more (another thread's hook may have filled it)
            self._keep_no_more(step, later)
        self._add_weights(step, slot, *weight_finish(layout, w_s, top, b.fit(layout), b.s_bin, b.rows_as_samples, rtol))

    def _outputs(
        self, step: LossStep, b: Batch, grad: torch.Tensor, lead_dims: int, inv_scale: torch.Tensor | None
    ) -> None:
        """An output gradient's squared norms added per bin into the step's sums, or its
        per-token norms kept for the report."""
        assert step.output is not None
        norms = output_norms(grad, lead_dims)
        bins, rows = (b.s_bin, b.shape) if b.tok_bin is None else (b.tok_bin, None)
        later = step.later
        if later is not None:
            if later.outputs(norms, bins, rows, inv_scale):
                return
            self._keep_no_more(step, later)
        output_finish(step.output, norms, bins, rows, inv_scale)

    def _keep_no_more(self, step: LossStep, later: Deferred) -> None:
        """The step keeps nothing more for its report: what it kept is added into its
        sums now, before the result that did not fit, so the sums add in the hooks'
        order whatever the step kept."""
        assert self._layout is not None and step.sums is not None and step.extremes is not None
        step.later = None
        kept = later.close()  # once: a hook on another thread may get here too
        if kept is not None:
            Deferred.apply(self._layout, *kept, step.sums, step.extremes)

    def _current(self, monitor: MonitorView) -> LossStep:
        # The scaler replaces its per-optimizer state in update(): a new object with
        # the optimizer step count unchanged means the scaler skipped the step.
        token = (monitor.step, getattr(monitor.scaler, "_per_optimizer_states", None))
        step = self._step
        if step is None or step.token[0] != token[0] or step.token[1] is not token[1]:
            reporting = bool(monitor.reporting_next)
            probe = reporting and self._probe is not None and self._probe.due(monitor, monitor.step + 1)
            step = self._step = LossStep(token=token, reporting=reporting, probe=probe)
            if reporting and not probe and monitor.world_size == 1 and LossReport.on_host:
                step.later = Deferred()
        return step

    def _count_nonfinite(
        self, loss: torch.Tensor, label: torch.Tensor | None, rows: torch.Tensor | None = None
    ) -> None:
        """Count the micro-batch if a label token's loss is not finite: ``loss * 0`` is
        NaN exactly there and 0 elsewhere, so its sum is nonzero exactly then (a sum of
        zeros cannot overflow; four ops instead of isfinite's six). ``rows``: the rows'
        sums of the label tokens' losses in a wider float than the loss (binning made
        them): finite values that narrow cannot overflow it, so a row sum is not finite
        exactly when one of its label losses is not, and one dot with zeros (NaN exactly
        then) takes the place of the product and the sum."""
        layout = self._layout
        assert layout is not None
        counter = self._nonfinite
        if counter is None:
            counter = self._nonfinite = torch.zeros((), dtype=torch.float32, device=loss.device)
        elif counter.device != loss.device:  # restored from a checkpoint on the CPU
            counter = self._nonfinite = counter.to(loss.device)
        if rows is not None and rows.dtype.itemsize > loss.dtype.itemsize:
            zeros = layout.constant_rows(rows.shape[0], 0.0, rows.dtype, rows.device)
            counter += torch.dot(rows, zeros) != layout.constant(0.0, rows.dtype, rows.device)
            return
        zero = layout.constant(0.0, loss.dtype, loss.device)  # a kept 0-d tensor: no scalar wrapped per call
        probe = loss * zero
        if label is not None:
            probe = torch.where(label, probe, zero)
        counter += probe.sum() != zero

    @staticmethod
    def _inv_scale(monitor: MonitorView, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """1 / the GradScaler's scale, read at hook time as a tensor (no host sync)."""
        scaler = monitor.scaler
        if scaler is None:
            return None
        enabled = getattr(scaler, "is_enabled", None)
        if enabled is not None and not enabled():
            return None
        scale = getattr(scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None
        return scale.detach().reshape(()).to(device, dtype, non_blocking=True).reciprocal()

    def _hook(self, where: str, fn: Any) -> Any:
        """A tensor hook running ``fn(grad)``: skipped during the probe's own backward or
        once the signal is off; a failure turns the signal off, never the user's backward."""

        generation = self._generation

        def hook(grad: torch.Tensor) -> None:
            if self._probing or self._closed or self.broken or self._generation != generation:
                return
            self.run_guarded(where, fn, grad)

        return hook
