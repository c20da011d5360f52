"""Loss accounting: where the gradient weight of a step goes (docs/incidents.md, I1-I3).

For a loss ``L = sum_it w_it * l_it`` built from per-token losses ``l_it``, the
gradient that arrives at the per-token loss tensor during the user's own backward
is exactly ``w_it = dL/dl_it``. ``track_loss`` puts a tensor hook on that tensor,
so the weights cost no extra backward; everything is batched tensor work,
accumulated on the device over the step's micro-batches, read on the host once per
report. On steps that are not reported no hook is placed; only non-finite label
losses are counted (a few small reductions per micro-batch).

Definitions (per optimizer step, over all its ``track_loss`` calls and all ranks):

- Label tokens: those where ``mask`` is true (all tokens without a mask). Other
  tokens carry no loss and are ignored everywhere.
- Sample: a row of ``per_token``; with ``segments``, a (row, segment id) pair, so a
  packed row holds several samples. A 1-D ``per_token`` [N] is N one-token samples,
  or with ``segments`` [N] one packed row. Samples without label tokens do not count.
- A sample's modality: its code in a per-sample ``modality``; with per-token codes,
  the code of its label tokens. A sample whose label tokens mix codes counts under
  the highest one and is reported once as an event and a log line (a value
  problem, never raised). Codes outside ``attach(modalities=...)`` count toward the
  totals only (event + log once). A declared modality that marks positions but none
  of the label tokens (a VLM's image *input* positions) would read as absent: an
  event ``modality_without_label_tokens`` and a log line say so; pass one code per
  sample ([B]) to class samples by their inputs.
- Objectives: each ``track_loss`` call belongs to an ``objective`` (default
  ``"main"``; a hard-label term and a distillation term on the same logits are two),
  optionally with the ``weight`` it carries in the total loss (2.0, tau**2) and the
  ``normalization`` the job intends (``token``, ``sqrt``, ``sample``; or
  ``attach(loss_normalization=...)``).
- ``w_s`` = sum of the sample's label-token weights, ``n_s`` = its label tokens.
- ``modality_sample_share_ratio`` / ``_token_share_ratio`` / ``_grad_share_ratio``:
  the modality's share of samples, label tokens, and weight ``sum w`` (I1).
  ``modality_dilution_ratio`` = sample share / grad share (1 when every sample
  weighs the same; 17 in I1). ``modality_excess_dilution_ratio`` = the grad share
  the intended normalization gives the modality / the grad share it gets: the
  declared scheme; undeclared, sqrt when the fitted exponent is within 0.15 of 0.5,
  else per sample. 1 when the job does what it intends, the dilution itself for an
  undeclared per-token loss (I1), about 1 for a deliberate sqrt.
- ``loss``: mean per-token loss over every label token; ``modality_loss{modality}``
  over the modality's label tokens.
- ``loss_norm_exponent``: least-squares slope of ``log w_s`` on ``log n_s`` over
  the samples with ``w_s > 0``: 1 per-token, 0.5 sqrt, 0 per-sample normalization.
  Absent when the lengths do not vary (no slope to fit).
- ``loss_weight_mass{objective}``: the objective's ``sum w`` over the step divided
  by its declared ``weight`` (I2): 1 for a loss normalized over the step, N when the
  division by N accumulation steps is missing, the coefficient when one is carried
  but not declared. ``loss_accumulation_exponent{objective}`` = log(mass) / log(N)
  for the objective's N >= 2 micro-batches of the step: 1 when their losses were not
  divided by N, 0 when normalized, -1 when divided twice (a coefficient c shifts it
  by log c / log N, so one micro-batch never reads as a missing division). Under data
  parallelism DDP averages gradients, so a token's effective weight is
  ``w / world``: the mass is the sum over ranks divided by the world size.
  With ``attach(loss_reduction="sum")`` the job sums on purpose and divides later
  (across ranks too, as Megatron's per-token path does): the mass is the sum over
  ranks divided by ``loss_scale`` (default: the step's label tokens over all
  ranks), so 1 is still healthy.
- ``token_weight_spread_ratio{objective}``: max over the step's micro-batches (and
  ranks) of the objective's per-token weight over the min (I3): 1 for a globally
  normalized per-token loss, the token-count ratio for a mean of per-micro-batch
  means. Present only when every micro-batch is per-token normalized, i.e. its label
  tokens' weights are equal within a relative 1e-3, and the job has not declared
  per-sample weighting (one sample per micro-batch, each averaged over its own
  tokens, is then the intent).
- ``modality_grad_norm{scope="output"}``: with ``output`` (logits or last hidden
  states), the gradient of the step's loss w.r.t. that tensor restricted to the
  modality's samples: sqrt of the sum over the modality's samples (and the step's
  micro-batches and ranks) of squared per-sample output-gradient norms, scaled like
  the mass (``/ world``, or ``/ loss_scale`` with "sum").
- ``microbatches``: micro-batches in the step (this rank): the most ``track_loss``
  calls of one objective.
- ``nonfinite_total{what="loss"}``: micro-batches since attach with a non-finite
  per-token loss on a label token, counted every step, summed over ranks.

With a ``GradScaler`` the weights arrive multiplied by the loss scale; they are
divided by the scaler's scale tensor read at hook time (no host sync). A step the
scaler skips (inf/NaN gradients, ``optimizer.step`` not called) is detected when
``scaler.update()`` has run and its accounting is discarded. Without a scaler, a
step whose ``optimizer.step`` the job skips is merged into the next one.

"Absent" costs no host sync: such values are emitted with ``ctx.emit(present=...)``
and dropped on the sender thread where the condition is false (a modality without
samples has no dilution or loss either).

Zero-code accounting (``attach(loss_from_logits=True)``) reads the same weights from
the gradient at the logits instead of a per-token loss tensor
(:mod:`~trainvitals.hooks.signals.logits_accounting`): a forward hook on the LM head
places, on report steps only, a tensor hook on its output; during the backward that
hook recovers every position's weight, loss and label flag and feeds them to the same
binning and sums as ``track_loss``. Micro-batches are tagged with
``Monitor.tag_batch``. When the gradient is not a plain cross-entropy one the step's
figures are left out and a log line says so.

The binning arithmetic lives in :mod:`~trainvitals.hooks.signals.loss_binning`,
the argument checks in :mod:`~trainvitals.hooks.signals.loss_arguments`, the
opt-in parameter-space probe (``attach(probe_every=N)``) in
:mod:`~trainvitals.hooks.signals.loss_probe`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.late_warnings import LateWarnings
from trainvitals.hooks.logits_finder import logits_of
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.logits_accounting import (
    cross_entropy_residual,
    recover,
    residual_tolerance,
    uniform_tolerance,
)
from trainvitals.hooks.signals.loss_arguments import (
    MAX_OBJECTIVES,
    NORMALIZATIONS,
    _modality_codes,
    check_declarations,
    check_track_loss,
)
from trainvitals.hooks.signals.loss_binning import (
    UNIFORM_RTOL,
    Batch,
    SumsLayout,
    bin_batch,
    output_sums,
    weight_sums,
)
from trainvitals.hooks.signals.loss_probe import ModalityProbe
from trainvitals.hooks.step import StepContext
from trainvitals.hooks.tensors import float_dtype

MIN_LOG_LENGTH_VAR = 1e-6
"""Below this variance of log(label tokens per sample) there is no slope to fit."""

SQRT_TOLERANCE = 0.15
"""Undeclared, a fitted exponent within this of 0.5 is taken as a deliberate sqrt
normalization (it is 0 per sample, 1 per token: far from either)."""


@dataclass
class _Step:
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
    wmax: torch.Tensor | None = None  # [objectives] largest label-token weight
    wmin: torch.Tensor | None = None  # [objectives] smallest label-token weight
    probe_grads: torch.Tensor | None = None  # [M, P] per-modality parameter gradients


class LossAccounting(Signal):
    """Loss weights per sample, modality and micro-batch; see the module docstring."""

    def __init__(self) -> None:
        self._step: _Step | None = None
        self._final: _Step | None = None
        self._nonfinite: torch.Tensor | None = None  # cumulative, on the loss's device
        self._probing = False  # set while the probe runs its own backward passes
        self._late = LateWarnings()
        self._layout: SumsLayout | None = None
        self._probe: ModalityProbe | None = None
        self._closed = False
        self._objectives: dict[str, int] = {}  # name -> slot in the per-objective sums
        self._indices = IndexCache()
        self._zero_code = False  # weights read from the logits' gradient (watch_logits)
        self._tags: tuple[Any, Any] | None = None  # (modality, segments) for the next logits

    # -- lifecycle -------------------------------------------------------------
    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._layout = SumsLayout(len(monitor.modalities), MAX_OBJECTIVES)
        if monitor.config.probe_every is not None:
            self._probe = ModalityProbe(monitor)
        return []

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
        modality: Any,
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
        rows, cols, codes = check_track_loss(monitor.modalities, per_token, modality, mask, segments, output)
        check_declarations(objective, weight, normalization)
        slot = self._slot(objective)
        if self._layout is None:  # created outside Monitor._signal: bind ourselves
            self.bind(monitor)
        if self._closed or self.broken:
            return
        with self.guard("track_loss"):
            self._track(monitor, per_token, rows, cols, codes, mask, segments, output, slot, weight, normalization)

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
    ) -> None:
        self._late.poll(monitor)
        step = self._current(monitor)
        step.tracked += 1
        step.calls[slot] += 1
        if weight is not None:
            step.weights[slot] = float(weight)
        if normalization is not None:
            step.normalization = normalization
        if per_token.numel() == 0:
            return
        loss = per_token.detach().reshape(rows, cols)
        label = None if mask is None else mask.detach().reshape(rows, cols).to(loss.device)
        self._count_nonfinite(loss, label)
        if not step.reporting:
            return
        self._ensure_sums(step, loss.device)
        assert self._layout is not None and step.sums is not None
        seg = None if segments is None else segments.detach().reshape(rows, cols).to(loss.device)
        batch = bin_batch(self._layout, step.sums, loss, label, seg, codes, probe=step.probe)
        per_token.register_hook(self._weight_hook(monitor, step, batch, per_token, slot))
        if output is not None:
            step.outputs += 1
            lead = per_token.dim() if tuple(output.shape[: per_token.dim()]) == tuple(per_token.shape) else 1
            output.register_hook(self._output_hook(monitor, step, batch, lead))

    # -- zero-code: weights read from the logits' gradient -----------------------
    def watch_logits(self, monitor: MonitorView, module: torch.nn.Module) -> list[Removable]:
        """Account every micro-batch from the gradient at ``module``'s output (the
        logits), objective ``main``; returns the forward hook's handle."""
        if self._layout is None:
            self.bind(monitor)
        self._zero_code = True
        slot = self._slot("main")

        def forward(mod: Any, args: Any, output: Any) -> None:
            tags, self._tags = self._tags, None  # one tag per forward, never carried over
            if self._closed or self.broken or not torch.is_grad_enabled() or not monitor.reporting_next:
                return
            logits = logits_of(output)
            if logits is None or not logits.requires_grad or logits.dim() not in (2, 3):
                return
            with self.guard("the logits forward hook"):
                self._watch(monitor, logits, tags, slot)

        return [module.register_forward_hook(forward)]

    def tag(self, monitor: MonitorView, modality: Any, segments: Any) -> None:
        """Modality codes and packed-row segment ids of the next logits (checked against
        their shape when the logits arrive)."""
        if not self._zero_code:
            raise ValueError(
                "tag_batch needs zero-code loss accounting: attach(..., loss_from_logits=True); "
                "with track_loss pass modality= and segments= to it instead"
            )
        if modality is not None and not monitor.modalities:
            raise ValueError(
                "tag_batch: modality tags need modality names: attach(..., modalities=('text', "
                "'image')), then pass codes or names per sample"
            )
        if segments is not None and (
            not isinstance(segments, torch.Tensor) or segments.is_floating_point() or segments.dtype == torch.bool
        ):
            raise TypeError(
                f"tag_batch: segments must be an integer tensor of sample ids [B, T], got "
                f"{getattr(segments, 'dtype', type(segments).__name__)}"
            )
        self._tags = (modality, segments)

    def _watch(self, monitor: MonitorView, logits: torch.Tensor, tags: tuple[Any, Any] | None, slot: int) -> None:
        self._late.poll(monitor)
        step = self._current(monitor)
        step.calls[slot] += 1
        if not step.reporting:
            return
        modality, segments = tags if tags is not None else (None, None)
        shape = tuple(logits.shape[:-1])
        if len(shape) == 2:
            rows, cols = shape
        else:
            rows, cols = (1, shape[0]) if segments is not None else (shape[0], 1)
        positions = logits.detach()[..., 0]  # a view: the positions' shape and device
        if modality is None:
            if monitor.modalities:
                monitor.warn_once(
                    "logits_untagged",
                    "loss_from_logits: modalities are declared but a micro-batch came without "
                    "a modality tag (Monitor.tag_batch, or the callback's modality field); its "
                    "tokens count toward the totals only",
                )
            codes: Any = -1
        else:
            try:
                codes = _modality_codes(monitor.modalities, modality, positions, rows, cols)
            except (TypeError, ValueError) as exc:
                raise type(exc)(str(exc).replace("track_loss", "tag_batch")) from None
        seg = None
        if segments is not None:
            if tuple(segments.shape) != shape:
                raise ValueError(
                    f"tag_batch: segments have shape {tuple(segments.shape)}, the logits' positions {shape}"
                )
            seg = segments.detach().reshape(rows, cols).to(logits.device, non_blocking=True)
        self._ensure_sums(step, logits.device)
        logits.register_hook(self._logits_hook(monitor, step, logits.detach(), codes, seg, slot, rows, cols))

    def _logits_hook(
        self,
        monitor: MonitorView,
        step: _Step,
        logits: torch.Tensor,
        codes: Any,
        seg: torch.Tensor | None,
        slot: int,
        rows: int,
        cols: int,
    ) -> Any:
        # ``logits`` is detached: the hook holds the values, never the autograd graph.
        layout = self._layout
        assert layout is not None
        config = monitor.config
        m = len(monitor.modalities)

        def weights(grad: torch.Tensor) -> None:
            step.fired += 1
            assert step.sums is not None
            fdt = step.sums.dtype
            vocab = grad.shape[-1]
            g = grad.detach().reshape(-1, vocab)
            z = logits.reshape(-1, vocab)
            rec = recover(g, z, fdt)
            residual, scale = cross_entropy_residual(
                g, z, rec, cap=config.logits_max_positions, period=cols, chunk_bytes=config.softmax_chunk_bytes
            )
            step.sums[layout.not_ce].add_((residual > scale * residual_tolerance(grad.dtype)).to(fdt))
            inv = self._inv_scale(monitor, grad.device, fdt)
            w = rec.weight if inv is None else rec.weight * inv
            loss, label = rec.loss.view(rows, cols), rec.label.view(rows, cols)
            self._count_nonfinite(loss, label)
            batch = bin_batch(layout, step.sums, loss, label, seg, codes, probe=False, count_unknown=m > 0)
            self._add_weights(step, slot, *weight_sums(layout, batch, w, uniform_tolerance(grad.dtype, UNIFORM_RTOL)))
            if m:
                step.outputs += 1
                step.sums[layout.output].add_(output_sums(layout, batch, g, 1, inv))

        return self._hook("the logits hook", weights)

    # -- per-step state ---------------------------------------------------------
    def _ensure_sums(self, step: _Step, device: torch.device) -> None:
        if step.sums is None:
            assert self._layout is not None
            fdt = float_dtype(device)
            step.sums = torch.zeros(self._layout.size, dtype=fdt, device=device)
            step.wmax = torch.full((MAX_OBJECTIVES,), float("-inf"), dtype=fdt, device=device)
            step.wmin = torch.full((MAX_OBJECTIVES,), float("inf"), dtype=fdt, device=device)

    def _add_weights(
        self,
        step: _Step,
        slot: int,
        block: torch.Tensor,
        mass: torch.Tensor,
        nonuniform: torch.Tensor,
        wmax: torch.Tensor,
        wmin: torch.Tensor,
    ) -> None:
        layout = self._layout
        assert layout is not None and step.sums is not None
        assert step.wmax is not None and step.wmin is not None
        step.sums[layout.common].add_(block)
        step.sums[layout.mass.start + slot].add_(mass)
        step.sums[layout.nonuniform.start + slot].add_(nonuniform)
        top, bottom = step.wmax[slot : slot + 1], step.wmin[slot : slot + 1]
        torch.maximum(top, wmax, out=top)
        torch.minimum(bottom, wmin, out=bottom)

    def _current(self, monitor: MonitorView) -> _Step:
        # The scaler replaces its per-optimizer state in update(): a new object with
        # the optimizer step count unchanged means the scaler skipped the step.
        token = (monitor.step, getattr(monitor.scaler, "_per_optimizer_states", None))
        step = self._step
        if step is None or step.token[0] != token[0] or step.token[1] is not token[1]:
            reporting = bool(monitor.reporting_next)
            probe = reporting and self._probe is not None and self._probe.due(monitor, monitor.step + 1)
            step = self._step = _Step(token=token, reporting=reporting, probe=probe)
        return step

    def _count_nonfinite(self, loss: torch.Tensor, label: torch.Tensor | None) -> None:
        bad = ~torch.isfinite(loss)
        if label is not None:
            bad &= label
        if self._nonfinite is None:
            self._nonfinite = torch.zeros((), dtype=torch.float32, device=loss.device)
        elif self._nonfinite.device != loss.device:  # restored from a checkpoint on the CPU
            self._nonfinite = self._nonfinite.to(loss.device)
        self._nonfinite += bad.any()

    # -- hooks: during the user's backward ---------------------------------------
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

        def hook(grad: torch.Tensor) -> None:
            if self._probing or self._closed or self.broken:
                return
            with self.guard(where):
                fn(grad)

        return hook

    def _weight_hook(self, monitor: MonitorView, step: _Step, b: Batch, per_token: torch.Tensor, slot: int) -> Any:
        layout = self._layout
        assert layout is not None
        # A weak reference: the hook lives in per_token's autograd node, so a strong one
        # would make a cycle through C++ that Python's collector cannot see, keeping the
        # step's whole graph (activations, logits) alive forever.
        per_token_ref = weakref.ref(per_token)

        def weights(grad: torch.Tensor) -> None:
            step.fired += 1
            w = grad.detach().reshape(-1).to(b.fdt)
            inv = self._inv_scale(monitor, grad.device, b.fdt)
            if inv is not None:
                w = w * inv
            self._add_weights(step, slot, *weight_sums(layout, b, w))
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

    def _output_hook(self, monitor: MonitorView, step: _Step, b: Batch, lead_dims: int) -> Any:
        layout = self._layout
        assert layout is not None

        def norms(grad: torch.Tensor) -> None:
            sq = output_sums(layout, b, grad, lead_dims, self._inv_scale(monitor, grad.device, b.fdt))
            assert step.sums is not None
            step.sums[layout.output].add_(sq)

        return self._hook("the output hook", norms)

    # -- report ------------------------------------------------------------------
    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        self._late.poll(monitor)
        step, self._final = self._final, None
        lay = self._layout
        if lay is None:
            return
        distributed = monitor.world_size > 1
        probe = None
        if self._probe is not None and self._probe.due(monitor, ctx.step):
            probe = self._probe.gram(monitor, None if step is None else step.probe_grads, ctx.step)
        if step is None or step.sums is None:
            if not distributed:
                if self._nonfinite is not None:
                    ctx.emit("nonfinite_total", self._nonfinite.float(), {"what": "loss"})
                return
            dev = ctx.device
            fdt = float_dtype(dev)
            sums = torch.zeros(lay.size, dtype=fdt, device=dev)
            wmax = torch.full((MAX_OBJECTIVES,), float("-inf"), dtype=fdt, device=dev)
            wmin = torch.full((MAX_OBJECTIVES,), float("inf"), dtype=fdt, device=dev)
        else:
            assert step.wmax is not None and step.wmin is not None
            sums, wmax, wmin = step.sums, step.wmax, step.wmin
        if self._nonfinite is not None:
            sums = sums.clone()
            sums[lay.nonfinite] = self._nonfinite.to(sums.device, sums.dtype)
        self._late.add(
            "loss_mixed_modality",
            "%d sample(s) mix modalities among their label tokens; each counts under the "
            "highest code. Pass one modality per sample (or per label token of it).",
            sums[lay.mixed],
        )
        self._late.add(
            "loss_unknown_modality",
            f"%d label token(s) carry a modality code outside 0..{lay.bins - 2} "
            f"(attach(modalities={list(monitor.modalities)})); they count toward totals only",
            sums[lay.unknown],
        )
        if self._zero_code:
            self._late.add(
                "loss_not_cross_entropy",
                "loss_from_logits: %d micro-batch(es) of a reported step had a logits gradient that "
                "is not a plain cross-entropy one (label smoothing, a distillation or z-loss term on "
                "the same logits, logit soft-capping after the hooked module); their token weights "
                "cannot be read from it, so that step's loss-accounting figures are left out. Use "
                "track_loss with the per-token cross-entropy (docs/integrations.md)",
                sums[lay.not_ce],
            )
        if self._nonfinite is not None:
            self._late.add(
                "loss_nonfinite", "%d micro-batch(es) had a non-finite per-token loss on a label token", self._nonfinite
            )
        info = {
            "step": step,
            "fired": step is not None and step.fired > 0,
            "output": step is not None and step.outputs > 0,
            "probe": probe,
        }
        ctx.combine(
            [(sums, "sum"), (wmax, "max"), (wmin, "min")],
            lambda s, mx, mn: self._emit(monitor, ctx, s, mx, mn, info),
            across_ranks=True,
        )

    def _emit(
        self,
        monitor: MonitorView,
        ctx: StepContext,
        sums: torch.Tensor,
        wmax: torch.Tensor,
        wmin: torch.Tensor,
        info: dict[str, Any],
    ) -> None:
        lay = self._layout
        assert lay is not None
        step: _Step | None = info["step"]
        names = list(monitor.modalities)
        m = len(names)
        mod_labels = [{"modality": n} for n in names]
        if self._nonfinite is not None or monitor.world_size > 1:
            ctx.emit("nonfinite_total", sums[lay.nonfinite], {"what": "loss"})
        if self._zero_code:
            # Weights read from a gradient that is not a plain cross-entropy one are wrong:
            # say so (collect's log line) and leave the step's figures out.
            ctx = _Gated(ctx, (sums[lay.not_ce] == 0).to(sums.dtype))  # type: ignore[assignment]
        calls = step.calls if step is not None else [0] * MAX_OBJECTIVES
        ctx.emit("microbatches", self._indices.get([float(max(calls))], ctx.device, sums.dtype)[0])
        samples, tokens = sums[lay.samples], sums[lay.tokens]
        weight, loss_sum = sums[lay.weight], sums[lay.loss]
        total_samples, total_tokens, total_weight = samples.sum(), tokens.sum(), weight.sum()
        some = (total_tokens > 0).float()

        ctx.emit("loss", loss_sum.sum() / total_tokens, present=some)
        ctx.emit("modality_loss", loss_sum[:m] / tokens[:m], mod_labels, present=tokens[:m])
        sample_share = samples[:m] / total_samples
        ctx.emit("modality_sample_share_ratio", sample_share, mod_labels, present=some.expand(m))
        ctx.emit("modality_token_share_ratio", tokens[:m] / total_tokens, mod_labels, present=some.expand(m))
        ctx.event(
            "loss_sample_mixed_modality",
            "samples whose label tokens mix modalities (counted under the highest code)",
            when=sums[lay.mixed],
        )
        ctx.event(
            "loss_unknown_modality_code",
            "label tokens with a modality code outside attach(modalities=...)",
            when=sums[lay.unknown],
        )
        if self._zero_code:
            ctx.event(
                "loss_not_cross_entropy",
                "loss_from_logits: a micro-batch's logits gradient is not a plain cross-entropy one; "
                "this step's loss-accounting figures are left out (docs/integrations.md)",
                when=sums[lay.not_ce],
            )
        # A declared modality that marks positions (inputs) but none of the label tokens:
        # its samples are classed by their label tokens, so it reads as absent.
        unlabeled = (sums[lay.positions][:m] > 0) & (tokens[:m] == 0)
        for k, name in enumerate(names):
            ctx.event(
                "modality_without_label_tokens",
                f"modality {name!r} marks positions but none of the label tokens: samples are classed "
                "by their label tokens; to class them by their inputs pass one modality code per "
                "sample ([B]) (docs/signals.md, 'Loss accounting')",
                {"modality": name},
                when=unlabeled[k],
            )
        self._late.add(
            "loss_modality_without_labels",
            "%d declared modality(ies) mark positions but none of the label tokens, so they read "
            "as absent from the shares; pass one modality code per sample ([B]) to class "
            "samples by their inputs (docs/signals.md, 'Loss accounting')",
            unlabeled.sum(),
        )
        if not info["fired"] and monitor.world_size == 1:
            return  # no weights arrived on this step: nothing honest to say about them

        # How the job's loss combines across ranks sets the unit of weight (see module doc).
        # (Python numbers, not new device tensors: creating one would wait for the device.)
        scale: float | torch.Tensor
        if monitor.config.loss_reduction == "sum":
            scale = float(monitor.config.loss_scale) if monitor.config.loss_scale is not None else total_tokens
        else:
            scale = float(monitor.world_size)
        has_weight = (total_weight != 0).float()
        grad_share = weight[:m] / total_weight
        ctx.emit("modality_grad_share_ratio", grad_share, mod_labels, present=has_weight.expand(m))
        ctx.emit("modality_dilution_ratio", sample_share / grad_share, mod_labels, present=samples[:m] * has_weight)
        n, sx, sy, sxx, sxy = sums[lay.fit].unbind()
        var_x = sxx / n - (sx / n) ** 2
        fit_ok = (n >= 2) & (var_x > MIN_LOG_LENGTH_VAR)
        exponent = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        ctx.emit("loss_norm_exponent", exponent, present=fit_ok.float())
        declared = (step.normalization if step is not None else None) or monitor.config.loss_normalization
        expected = self._expected_share(sums, exponent, fit_ok, declared)
        ctx.emit(
            "modality_excess_dilution_ratio", expected[:m] / grad_share, mod_labels, present=samples[:m] * has_weight
        )
        self._emit_objectives(ctx, sums, wmax, wmin, calls, step, scale, some, declared)
        if info["output"]:
            ctx.emit(
                "modality_grad_norm",
                sums[lay.output][:m].sqrt() / scale,
                [{"modality": n, "scope": "output"} for n in names],
                present=samples[:m],
            )
        if info["probe"] is not None:
            assert self._probe is not None
            self._probe.emit(ctx, info["probe"], names, scale)

    def _expected_share(
        self, sums: torch.Tensor, exponent: torch.Tensor, fit_ok: torch.Tensor, declared: str | None
    ) -> torch.Tensor:
        """Each bin's share of the gradient weight under the intended normalization: the
        declared one; undeclared, sqrt when the fitted exponent is 0.5 (a known deliberate
        choice), else per sample (every sample weighs the same)."""
        lay = self._layout
        assert lay is not None
        by_beta = {0.0: sums[lay.samples], 0.5: sums[lay.sqrt_tokens], 1.0: sums[lay.tokens]}
        if declared is not None:
            weights = by_beta[NORMALIZATIONS[declared]]
        else:
            sqrt_like = fit_ok & ((exponent - 0.5).abs() < SQRT_TOLERANCE)
            weights = torch.where(sqrt_like, by_beta[0.5], by_beta[0.0])
        return weights / weights.sum()

    def _emit_objectives(
        self,
        ctx: StepContext,
        sums: torch.Tensor,
        wmax: torch.Tensor,
        wmin: torch.Tensor,
        calls: list[int],
        step: _Step | None,
        scale: float | torch.Tensor,
        some: torch.Tensor,
        declared: str | None,
    ) -> None:
        """Per objective: its weight mass relative to its declared weight, how that mass
        scales with the step's micro-batches, and its token-weight spread (I2, I3)."""
        lay = self._layout
        assert lay is not None
        active = [(name, k) for name, k in sorted(self._objectives.items(), key=lambda kv: kv[1]) if calls[k]]
        if not active:
            return
        dev = sums.device
        slots = self._indices.get([k for _, k in active], dev)
        labels = [{"objective": name} for name, _ in active]
        weights = step.weights if step is not None else {}
        declared_weight = self._indices.get([weights.get(k, 1.0) for _, k in active], dev, sums.dtype)
        mass = sums[lay.mass].index_select(0, slots) / declared_weight / scale
        ctx.emit("loss_weight_mass", mass, labels, present=some.expand(len(active)))
        # mass = N^k for N micro-batches: k = 1 when their losses were not divided by N,
        # 0 when normalized, -1 when divided twice (a coefficient shifts it by log c / log N).
        log_n = self._indices.get([math.log(max(calls[k], 2)) for _, k in active], dev, sums.dtype)
        several = self._indices.get([float(calls[k] >= 2) for _, k in active], dev, sums.dtype)
        ctx.emit("loss_accumulation_exponent", torch.log(mass) / log_n, labels, present=several * (mass > 0))
        top, bottom = wmax.index_select(0, slots), wmin.index_select(0, slots)
        spread_ok = (sums[lay.nonuniform].index_select(0, slots) == 0) & (bottom > 0) & torch.isfinite(top)
        if declared == "sample":  # per-sample weighting declared: unequal token weights are the intent
            spread_ok = torch.zeros_like(spread_ok)
        ctx.emit("token_weight_spread_ratio", top / bottom, labels, present=spread_ok.float())


class _Gated:
    """A StepContext whose samples are present only where ``ok`` > 0 (a 0-d tensor)."""

    def __init__(self, ctx: StepContext, ok: torch.Tensor) -> None:
        self._ctx = ctx
        self._ok = ok.reshape(())
        self.device = ctx.device
        self.step = ctx.step

    def emit(self, name: str, values: torch.Tensor, labels: Any = None, *, present: torch.Tensor | None = None) -> None:
        n = values.numel()
        gate = self._ok.expand(n) if present is None else present.reshape(-1).to(self._ok.dtype) * self._ok
        self._ctx.emit(name, values, labels, present=gate)

    def event(self, *args: Any, **kwargs: Any) -> None:
        self._ctx.event(*args, **kwargs)
