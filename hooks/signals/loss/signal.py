"""Loss accounting, capture: where the gradient weight of a step goes (docs/incidents.md, I1-I3).

For a loss ``L = sum_it w_it * l_it`` built from per-token losses ``l_it``, the
gradient that arrives at the per-token loss tensor during the user's own backward
is exactly ``w_it = dL/dl_it``. ``track_loss`` puts a tensor hook on that tensor,
so the weights cost no extra backward; everything is batched tensor work,
accumulated on the device over the step's micro-batches, read on the host once per
report. On steps that are not reported no hook is placed; only non-finite label
losses are counted (a few small reductions per micro-batch).

This module places the hooks and accumulates, per reported step and on the device:
the sums of :mod:`~trainvitals.hooks.signals.loss.binning` (per modality bin:
samples, label tokens, loss, weight and the like; the exponent fit's moments; per
objective its weight mass), each objective's largest and smallest label-token
weight and micro-batch count, and the declared ``weight`` and ``normalization``;
every step, the micro-batches with a non-finite label loss. ``collect`` hands them
to :class:`~trainvitals.hooks.signals.loss.report.LossReport`, which combines them
across ranks and emits the figures; the definitions (label tokens, samples,
modalities, objectives, and each figure's math) are in that module.

With a ``GradScaler`` the weights arrive multiplied by the loss scale; they are
divided by the scaler's scale tensor read at hook time (no host sync). A step the
scaler skips (inf/NaN gradients, ``optimizer.step`` not called) is detected when
``scaler.update()`` has run and its accounting is discarded. Without a scaler, a
step whose ``optimizer.step`` the job skips is merged into the next one.

Zero-code accounting (``attach(loss_from_logits=True)``) reads the same weights from
the model's own outputs instead (the logits' gradient, Megatron's per-token losses,
TRL's fused head): :mod:`~trainvitals.hooks.signals.loss.zero_code`, with samples
tagged from a VLM's input ids by :mod:`~trainvitals.hooks.signals.loss.modality`.

The modules, in data-flow order: the argument checks
(:mod:`~trainvitals.hooks.signals.loss.arguments`), the step's bookkeeping
(:mod:`~trainvitals.hooks.signals.loss.step`), the binning arithmetic
(:mod:`~trainvitals.hooks.signals.loss.binning`), this signal (``track_loss`` and its
hooks, coverage, collect), the figures (:mod:`~trainvitals.hooks.signals.loss.report`,
whose index plan is :mod:`~trainvitals.hooks.signals.loss.plan`); the opt-in
parameter-space probe (``attach(probe_every=N)``) is
:mod:`~trainvitals.hooks.signals.loss.probe`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainvitals.hooks.config import Config
from trainvitals.hooks.signals.base import MonitorView, Removable
from trainvitals.hooks.signals.loss.arguments import MAX_OBJECTIVES, UNTAGGED, TrackChecks
from trainvitals.hooks.signals.loss.binning import Batch, bin_batch
from trainvitals.hooks.signals.loss.layout import SumsLayout
from trainvitals.hooks.signals.loss.probe import ModalityProbe
from trainvitals.hooks.signals.loss.report import Accumulated, LossReport
from trainvitals.hooks.signals.loss.sharded import token_layout_problem
from trainvitals.hooks.signals.loss.step import LossStep
from trainvitals.hooks.signals.loss.zero_code import ZeroCodeSeams
from trainvitals.hooks.step import StepContext
from trainvitals.hooks.tensors import is_dtensor, local
from trainvitals.wire.signals import SignalSpec

__all__ = ["HEAD_BYPASS_REPORTS", "LossAccounting"]

HEAD_BYPASS_REPORTS = 3
"""Consecutive report steps with no gradient at the LM head's output after which
zero-code accounting reads ``head_bypassed`` (before: ``no_input``)."""


class LossAccounting(ZeroCodeSeams):
    """Loss weights per sample, modality and micro-batch; see the module docstring.
    The per-step bookkeeping is :class:`~trainvitals.hooks.signals.loss.step.StepBook`,
    the zero-code capture paths :class:`~trainvitals.hooks.signals.loss.zero_code.ZeroCodeSeams`."""

    spec = SignalSpec(
        name="loss",
        covers="loss accounting, I1-I3: track_loss or zero-code from the logits",
        how_to_ask="no track_loss() call and no attach(loss_from_logits=...)",
        group="loss",
        title="Loss accounting (I1-I3)",
        dashboard="trainvitals-loss.json",
        first_call="track_loss()",
    )
    covers = spec.name

    def __init__(self) -> None:
        super().__init__()
        self._report: LossReport | None = None  # set in bind, with the layout
        self._unfed = 0  # consecutive report steps whose logits got no gradient (zero-code)
        self._checks = TrackChecks()  # track_loss's argument checks, kept per argument layout

    # -- lifecycle -------------------------------------------------------------
    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._layout = SumsLayout(len(monitor.modalities), MAX_OBJECTIVES)
        if monitor.config.probe_every is not None:
            self._probe = ModalityProbe(monitor)
        self._report = LossReport(self._layout, self._objectives, self._late)
        if monitor.pipeline_stages > 1:  # "main" in the same slot on the stage that reads no loss
            self._slot("main")
        return []

    def settings_changed(self, monitor: MonitorView, old: Config, new: Config) -> None:
        if old.probe_every != new.probe_every:
            # Between steps: no probe step is in flight, its buffers live in the step.
            self._probe = ModalityProbe(monitor) if new.probe_every is not None else None

    def before_step(self, monitor: MonitorView, reporting: bool) -> None:
        # Gradients are final: this step's accounting is complete.
        step, self._step = self._step, None
        self._final = step if (reporting and step is not None and step.reporting) else None
        if step is not None and step.reporting and step.tracked and not step.fired:
            monitor.warn_once(
                "loss_weights_missing",
                "track_loss was called but its per-token loss received no gradient before "
                "optimizer.step(); pass the tensor the loss is reduced from, before its backward",
            )

    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite": self._nonfinite.cpu() if self._nonfinite is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("nonfinite") is not None:
            self._nonfinite = state["nonfinite"].clone()

    def reset(self) -> None:
        self._step = self._final = None  # drops the probe's gradient buffers too

    def close(self) -> None:
        self._closed = True
        self.reset()

    # -- the user call -----------------------------------------------------------
    def track(
        self,
        monitor: MonitorView,
        per_token: torch.Tensor,
        *,
        modality: Any = None,
        mask: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
        objective: str = "main",
        weight: float | None = None,
        normalization: str | None = None,
    ) -> None:
        """Account one micro-batch's per-token losses; see ``Monitor.track_loss``.
        Wrong types, shapes and unknown names raise here; past the checks nothing does."""
        if self._zero_code:
            raise ValueError(
                "track_loss: zero-code loss accounting is on (attach(loss_from_logits=...)); "
                "it already accounts every token from the logits' gradient, so track_loss "
                "would count them twice. Use one or the other"
            )
        checks = self._checks
        rows, cols, codes = checks(monitor.modalities, per_token, modality, mask, segments, output)
        if modality is None and len(monitor.modalities) > 1:
            monitor.warn_once(
                "track_loss_untagged",
                "track_loss: modalities %s are declared but a micro-batch came without modality=...; "
                "its tokens count toward the totals only",
                "/".join(monitor.modalities),
            )
        checks.declarations(objective, weight, normalization)
        slot = self._slot(objective)
        if self._layout is None:  # created outside Monitor._signal: bind ourselves
            self.bind(monitor)
        if self._closed or self.broken:
            return
        hooked = per_token  # a DTensor's gradient arrives at the DTensor: hooked there
        if is_dtensor(per_token):
            problem = token_layout_problem(per_token, "per-token losses")
            if problem:
                self.run_guarded("track_loss", self._withhold, monitor, problem)
                return
            per_token = local(per_token)  # replicated: every rank holds all of its tokens
        if output is not None and is_dtensor(output) and token_layout_problem(output, "output"):
            monitor.warn_once(
                "track_loss_output_layout",
                "track_loss: %s; the per-modality output-gradient norms are withheld",
                token_layout_problem(output, "output"),
            )
            output = None  # a shard's gradient gives no sample's norm
        # Statistics only: no autograd (no detach per tensor). The grad mode is set by a
        # plain call, not a context manager: this runs once per micro-batch.
        grad_was = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # called as a function: sets the mode now
        try:
            self.run_guarded(
                "track_loss",
                self._track,
                monitor,
                per_token,
                rows,
                cols,
                codes,
                mask,
                segments,
                output,
                slot,
                weight,
                normalization,
                hooked,
            )
        finally:
            torch.set_grad_enabled(grad_was)

    def _withhold(self, monitor: MonitorView, problem: str) -> None:
        """A micro-batch whose per-token losses cannot be read exactly: nothing of it is
        counted, the step's loss coverage names why (and a log line, once)."""
        self._late.poll(monitor)
        step = self._current(monitor)
        step.layout = f"track_loss: the {problem}"
        monitor.warn_once("track_loss_layout", "%s; loss figures withheld", step.layout)

    def _track(
        self,
        monitor: MonitorView,
        per_token: torch.Tensor,
        rows: int,
        cols: int,
        codes: Any,
        mask: torch.Tensor | None,
        segments: torch.Tensor | None,
        output: torch.Tensor | None,
        slot: int,
        weight: float | None,
        normalization: str | None,
        hooked: torch.Tensor,
    ) -> None:
        self._late.poll(monitor)
        step = self._current(monitor)
        step.tracked += 1
        step.calls[slot] += 1
        if weight is not None:
            step.weights[slot] = float(weight)
        if normalization is not None:
            step.normalization, step.declared = normalization, True
        elif not step.declared:
            self._imply_tracked_intent(monitor, step, rows if segments is None else 2)
        if per_token.numel() == 0:
            return
        loss = per_token if tuple(per_token.shape) == (rows, cols) else per_token.reshape(rows, cols)
        label = None if mask is None else mask.detach().reshape(rows, cols).to(loss.device)
        if not step.reporting:
            self._count_nonfinite(loss, label)
            return
        self._ensure_sums(step, loss.device)
        assert self._layout is not None and step.sums is not None
        seg = None if segments is None else segments.detach().reshape(rows, cols).to(loss.device)
        untagged = type(codes) is int and codes == UNTAGGED  # no modality given: the totals only
        batch = bin_batch(
            self._layout, step.sums, loss, label, seg, codes, probe=step.probe, count_unknown=not untagged
        )
        self._count_nonfinite(loss, label, batch.row_loss)
        batch.row_loss = None  # it may be a kept buffer's row, written by the next micro-batch
        hooked.register_hook(self._weight_hook(monitor, step, batch, per_token, slot))
        if output is not None:
            step.outputs += 1
            lead = per_token.dim() if tuple(output.shape[: per_token.dim()]) == tuple(per_token.shape) else 1
            output.register_hook(self._output_hook(monitor, step, batch, lead))

    def _weight_hook(self, monitor: MonitorView, step: LossStep, b: Batch, per_token: torch.Tensor, slot: int) -> Any:
        layout = self._layout
        assert layout is not None
        # A weak reference: the hook lives in per_token's autograd node, so a strong one
        # would make a cycle through C++ that Python's collector cannot see, keeping the
        # step's whole graph (activations, logits) alive forever.
        per_token_ref = weakref.ref(per_token)

        def weights(grad: torch.Tensor) -> None:
            if is_dtensor(grad):  # the gradient at replicated DTensor losses: every rank's is whole
                problem = token_layout_problem(grad, "gradient at the per-token losses")
                if problem:
                    step.layout = f"track_loss: the {problem}"
                    return
                grad = local(grad)
            step.fired += 1
            w = grad.detach() if grad.requires_grad else grad  # weight_rows widens what it sums
            inv = self._inv_scale(monitor, grad.device, b.fdt)
            if inv is not None:
                w = w.to(b.fdt) * inv
            self._weights(step, slot, b, w)
            source = per_token_ref()
            if step.probe and self._probe is not None and source is not None and b.probe_masks is not None:
                self._probing = True
                try:
                    step.probe_grads = self._probe.accumulate(
                        step.probe_grads, source, grad, b.probe_masks, inv, monitor
                    )
                finally:
                    self._probing = False

        return self._hook("the per-token loss hook", weights)

    def _output_hook(self, monitor: MonitorView, step: LossStep, b: Batch, lead_dims: int) -> Any:
        layout = self._layout
        assert layout is not None

        def norms(grad: torch.Tensor) -> None:
            if is_dtensor(grad):
                if token_layout_problem(grad, "output gradient"):
                    return  # a partial or sharded gradient: no sample's norm from this rank's piece
                grad = local(grad)
            self._outputs(step, b, grad, lead_dims, self._inv_scale(monitor, grad.device, b.fdt))

        return self._hook("the output hook", norms)

    # -- coverage: why a reported step has no loss figures ----------------------
    def _coverage(self, monitor: MonitorView, ctx: StepContext, step: LossStep | None) -> None:
        """This report's loss (and probe) coverage verdicts, host-side (what the device
        decides, a gradient that is not cross-entropy, loss_report adds)."""
        probe = self._probe
        if probe is None:
            monitor.coverage.clear("probe")
        elif not probe.supported:
            monitor.coverage.set_inactive("probe", "sharded", "probe_every needs unsharded parameters")
        else:
            monitor.coverage.set_active("probe")
        if not self._zero_code and step is not None and step.layout:
            ctx.inactive_when("loss", None, "sharded", step.layout)
            return
        if step is not None and step.fired:
            self._unfed = 0
            return
        if monitor.pipeline_stages > 1:  # the loss is on the last stage: judged from every stage's (report)
            return
        if not self._zero_code:
            tracked = step is not None and step.tracked > 0
            ctx.inactive_when(
                "loss",
                None,
                "no_input",
                "track_loss was called but its per-token loss got no gradient before optimizer.step()"
                if tracked
                else "no track_loss call in the reported step",
            )
            return
        if step is not None and step.layout:
            ctx.inactive_when("loss", None, "logits_layout", step.layout)
            return
        self._unfed += 1
        forwards = step is not None and step.calls[self._objectives.get("main", 0)] > 0
        if self._unfed >= HEAD_BYPASS_REPORTS:
            ctx.inactive_when(
                "loss",
                None,
                "head_bypassed",
                f"no gradient reached the output of {self._head!r} in the last {self._unfed} reported steps"
                + ("" if forwards else ", and it did not run in this one (a fused or chunked loss that bypasses it?)"),
            )
        else:
            ctx.inactive_when(
                "loss",
                None,
                "no_input",
                f"the output of {self._head!r} got no gradient in the reported step"
                if forwards
                else f"{self._head!r} did not run in the reported step",
            )

    # -- report: the step's sums handed to loss_report ---------------------------
    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        self._late.poll(monitor)
        step, self._final = self._final, None
        report = self._report
        if report is None:
            return
        self._coverage(monitor, ctx, step)
        gram = None
        if self._probe is not None and self._probe.due(monitor, ctx.step):
            gram = self._probe.gram(monitor, None if step is None else step.probe_grads, ctx.step)
        acc = (
            Accumulated()
            if step is None
            else Accumulated(
                sums=step.sums,
                extremes=step.extremes,
                counter=step.counter,
                rows=step.rows,
                calls=step.calls,
                weights=step.weights,
                normalization=step.normalization,
                fired=step.fired > 0,
                output=step.outputs > 0,
                later=step.later,
                withheld=step.withheld,
            )
        )
        report.report(
            monitor, ctx, acc, nonfinite=self._nonfinite, zero_code=self._zero_code, probe=self._probe, gram=gram
        )
