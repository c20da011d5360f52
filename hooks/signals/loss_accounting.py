"""Loss accounting, capture: where the gradient weight of a step goes (docs/incidents.md, I1-I3).

For a loss ``L = sum_it w_it * l_it`` built from per-token losses ``l_it``, the
gradient that arrives at the per-token loss tensor during the user's own backward
is exactly ``w_it = dL/dl_it``. ``track_loss`` puts a tensor hook on that tensor,
so the weights cost no extra backward; everything is batched tensor work,
accumulated on the device over the step's micro-batches, read on the host once per
report. On steps that are not reported no hook is placed; only non-finite label
losses are counted (a few small reductions per micro-batch).

This module places the hooks and accumulates, per reported step and on the device:
the sums of :mod:`~trainvitals.hooks.signals.loss_binning` (per modality bin:
samples, label tokens, loss, weight and the like; the exponent fit's moments; per
objective its weight mass), each objective's largest and smallest label-token
weight and micro-batch count, and the declared ``weight`` and ``normalization``;
every step, the micro-batches with a non-finite label loss. ``collect`` hands them
to :class:`~trainvitals.hooks.signals.loss_report.LossReport`, which combines them
across ranks and emits the figures; the definitions (label tokens, samples,
modalities, objectives, and each figure's math) are in that module.

With a ``GradScaler`` the weights arrive multiplied by the loss scale; they are
divided by the scaler's scale tensor read at hook time (no host sync). A step the
scaler skips (inf/NaN gradients, ``optimizer.step`` not called) is detected when
``scaler.update()`` has run and its accounting is discarded. Without a scaler, a
step whose ``optimizer.step`` the job skips is merged into the next one.

Zero-code accounting (``attach(loss_from_logits=True)``) reads the same weights from
the gradient at the logits instead of a per-token loss tensor
(:mod:`~trainvitals.hooks.signals.logits_accounting`): a forward hook on the LM head
places, on report steps only, a tensor hook on its output; during the backward that
hook recovers every position's weight, loss and label flag and feeds them to the same
binning and sums as ``track_loss``. Micro-batches are tagged with
``Monitor.tag_batch``. When the gradient is not a plain cross-entropy one the step's
figures are left out and a log line says so.

The binning arithmetic lives in :mod:`~trainvitals.hooks.signals.loss_binning`,
the figures in :mod:`~trainvitals.hooks.signals.loss_report`, the argument checks
in :mod:`~trainvitals.hooks.signals.loss_arguments`, the opt-in parameter-space
probe (``attach(probe_every=N)``) in :mod:`~trainvitals.hooks.signals.loss_probe`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from trainvitals.hooks.late_warnings import LateWarnings
from trainvitals.hooks.logits_finder import expected_vocab, logits_of
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.logits_accounting import (
    cross_entropy_residual,
    recover,
    residual_tolerance,
    uniform_tolerance,
)
from trainvitals.hooks.signals.loss_arguments import (
    MAX_OBJECTIVES,
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
from trainvitals.hooks.signals.loss_report import Accumulated, LossReport
from trainvitals.hooks.step import StepContext
from trainvitals.hooks.tensors import float_dtype

HEAD_BYPASS_REPORTS = 3
"""Consecutive report steps with no gradient at the LM head's output after which
zero-code accounting reads ``head_bypassed`` (before: ``no_input``)."""


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
    layout: str = ""  # zero-code: why the head's output was not read as logits (the last such)
    several: bool = False  # a micro-batch held several samples (Megatron's per-sample intent then fails)


@dataclass
class _Seam:
    """One micro-batch's logits, as the model's own output may name them: when the model
    returns its per-token losses [B, S] (Megatron's ``GPTModel`` with ``labels``), the
    weights are read there (exact: the gradient at a per-token loss is its weight) and the
    logits' gradient only checks that they are a cross-entropy's."""

    shape: tuple[int, int]  # [rows, cols] of the logits' positions, batch-first
    codes: Any
    seg: torch.Tensor | None
    per_token: bool = False  # the model's output is the per-token loss
    weight: torch.Tensor | None = None  # [N] read at the per-token loss, for the check
    loss: torch.Tensor | None = None  # [N]
    batch: Batch | None = None
    inv: torch.Tensor | None = None


class LossAccounting(Signal):
    """Loss weights per sample, modality and micro-batch; see the module docstring."""

    covers = "loss"

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
        self._report: LossReport | None = None  # set in bind, with the layout
        self._zero_code = False  # weights read from the logits' gradient (watch_logits)
        self._tags: tuple[Any, Any] | None = None  # (modality, segments) for the next logits
        self._inputs: tuple[int, int] | None = None  # the model's current input ids' [B, S]
        self._auto: torch.Tensor | None = None  # per-sample codes from the input ids' image/video tokens
        self._seam: _Seam | None = None  # the head's logits in the model's current forward
        self._head = ""  # the hooked LM head's name (zero-code)
        self._unfed = 0  # consecutive report steps whose logits got no gradient (zero-code)
        self._per_sample = False  # Megatron's default loss: per-sample intent on one-sample micro-batches

    # -- lifecycle -------------------------------------------------------------
    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._layout = SumsLayout(len(monitor.modalities), MAX_OBJECTIVES)
        if monitor.config.probe_every is not None:
            self._probe = ModalityProbe(monitor)
        self._report = LossReport(self._layout, self._objectives, self._late)
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
        logits), objective ``main``; returns the hooks' handles. Hooks on the model
        itself too: before its forward, to read the layout of its input ids; after it,
        for a fused head that never calls ``module`` (TRL's ``fused_lm_head=True``,
        whose output carries per-token log-probabilities instead of logits)."""
        if self._layout is None:
            self.bind(monitor)
        self._zero_code = True
        self._head = next((n for n, m in monitor.model.named_modules() if m is module), type(module).__name__)
        slot = self._slot("main")
        root = monitor.model
        self._per_sample = _megatron_per_sample(root) and monitor.config.loss_normalization is None
        vocab = expected_vocab(root, module)
        megatron = type(module).__module__.startswith("megatron.")
        fired = [False]  # the head ran in the model's current forward
        media = media_codes(root, monitor.modalities)

        def pre(mod: Any, args: Any, kwargs: Any) -> None:
            fired[0] = False
            self._seam = None
            ids = _input_ids(args, kwargs)
            self._inputs = None if ids is None else (int(ids.shape[0]), int(ids.shape[1]))
            self._auto = None
            if media and ids is not None and monitor.reporting_next and torch.is_grad_enabled():
                self._auto = _sample_codes(ids, media)

        def forward(mod: Any, args: Any, output: Any) -> None:
            fired[0] = True
            tags, self._tags = self._tags, None  # one tag per forward, never carried over
            if self._closed or self.broken or not torch.is_grad_enabled() or not monitor.reporting_next:
                return
            logits = logits_of(output)
            if logits is not None and not logits.requires_grad:
                return
            problem = _layout_problem(logits, vocab)
            if problem:
                self._current(monitor).layout = f"the output of {self._head!r} {problem}"
                monitor.warn_once(
                    "logits_layout",
                    "loss_from_logits: the output of %s %s: not read as logits (name the LM head: "
                    "loss_from_logits='lm_head')",
                    self._head,
                    problem,
                )
                return
            assert logits is not None
            with self.guard("the logits forward hook"):
                self._watch(monitor, logits, tags, slot, self._sequence_first(logits, megatron))

        def after(mod: Any, args: Any, output: Any) -> None:
            tags, self._tags = self._tags, None
            seam, self._seam = self._seam, None
            if self._closed or self.broken or not torch.is_grad_enabled():
                return
            if fired[0]:
                if seam is not None and _per_token_output(output, seam.shape):
                    with self.guard("the per-token loss output hook"):
                        self._watch_per_token(monitor, output, seam, slot)
                return
            fused = _fused_output(output)
            if fused is None or not monitor.reporting_next:
                return
            with self.guard("the fused head's forward hook"):
                self._watch_fused(monitor, fused[0], fused[1], tags, slot)

        handles: list[Removable] = [module.register_forward_hook(forward)]
        if module is not root:
            handles.append(root.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(root.register_forward_hook(after))
        return handles

    def _sequence_first(self, logits: torch.Tensor, megatron: bool) -> bool:
        """Whether 3-D logits are [S, B, V]: Megatron's output layer always gives them so;
        otherwise when the model's input ids [B, S] say so (B != S)."""
        if logits.dim() != 3:
            return False
        if megatron:
            return True
        ids = self._inputs
        if ids is None:
            return False
        b, s = ids
        return b != s and tuple(logits.shape[:2]) == (s, b)

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

    def _codes(self, monitor: MonitorView, modality: Any, positions: torch.Tensor, rows: int, cols: int) -> Any:
        auto, self._auto = self._auto, None
        if modality is None and auto is not None and auto.shape[0] == rows:
            return auto.to(positions.device, non_blocking=True)  # from the image/video tokens of the input ids
        if modality is None:
            if monitor.modalities:
                monitor.warn_once(
                    "logits_untagged",
                    "loss_from_logits: modalities are declared but a micro-batch came without "
                    "a modality tag (Monitor.tag_batch, or the callback's modality field); its "
                    "tokens count toward the totals only",
                )
            return -1
        try:
            return _modality_codes(monitor.modalities, modality, positions, rows, cols)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("track_loss", "tag_batch")) from None

    @staticmethod
    def _segments(segments: Any, shape: tuple[int, ...], rows: int, cols: int, device: torch.device) -> Any:
        if segments is None:
            return None
        if tuple(segments.shape) != shape:
            raise ValueError(f"tag_batch: segments have shape {tuple(segments.shape)}, the logits' positions {shape}")
        return segments.detach().reshape(rows, cols).to(device, non_blocking=True)

    def _watch(
        self, monitor: MonitorView, logits: torch.Tensor, tags: tuple[Any, Any] | None, slot: int, seq_first: bool
    ) -> None:
        self._late.poll(monitor)
        step = self._current(monitor)
        step.calls[slot] += 1
        if not step.reporting:
            return
        modality, segments = tags if tags is not None else (None, None)
        view = logits.detach().transpose(0, 1) if seq_first else logits.detach()
        shape = tuple(view.shape[:-1])
        if len(shape) == 2:
            rows, cols = shape
        else:
            rows, cols = (1, shape[0]) if segments is not None else (shape[0], 1)
        codes = self._codes(monitor, modality, view[..., 0], rows, cols)
        seg = self._segments(segments, shape, rows, cols, logits.device)
        self._imply_intent(step, rows if seg is None else 2)
        self._ensure_sums(step, logits.device)
        seam = self._seam = _Seam((rows, cols), codes, seg)
        hook = self._logits_hook(monitor, step, view, logits._version, seam, slot, seq_first)
        logits.register_hook(hook)

    def _imply_intent(self, step: _Step, samples: int) -> None:
        """Megatron's default (``calculate_per_token_loss`` off) averages each micro-batch
        over its own tokens: with one sample per micro-batch that is per-sample weighting,
        Megatron's intent, so the step reads as declared ``normalization="sample"``; a
        step with a micro-batch of several samples is a mean of means and reads as such."""
        if not self._per_sample:
            return
        if samples > 1:
            step.several = True
        step.normalization = None if step.several else "sample"

    def _watch_per_token(self, monitor: MonitorView, output: torch.Tensor, seam: _Seam, slot: int) -> None:
        """The model returned its per-token losses [B, S] (or [S, B]): read the weights
        there, as ``track_loss`` does; the logits' hook then checks them."""
        step = self._current(monitor)
        if not step.reporting:
            return
        seam.per_token = True
        rows, cols = seam.shape
        transposed = tuple(output.shape) != seam.shape
        values = output.detach()
        layout = self._layout
        assert layout is not None
        m = len(monitor.modalities)

        def weights(grad: torch.Tensor) -> None:
            step.fired += 1
            assert step.sums is not None
            fdt = step.sums.dtype
            g = grad.detach().t() if transposed else grad.detach()
            z = values.t() if transposed else values
            w = g.reshape(rows, cols).to(fdt)
            label = w != 0
            loss = z.reshape(rows, cols).to(fdt)
            self._count_nonfinite(loss, label)
            batch = bin_batch(layout, step.sums, loss, label, seam.seg, seam.codes, probe=False, count_unknown=m > 0)
            inv = self._inv_scale(monitor, grad.device, fdt)
            flat = w.reshape(-1) if inv is None else w.reshape(-1) * inv
            self._add_weights(step, slot, *weight_sums(layout, batch, flat))
            seam.weight, seam.loss, seam.batch, seam.inv = w.reshape(-1), loss.reshape(-1), batch, inv

        output.register_hook(self._hook("the per-token loss hook", weights))

    def _watch_fused(
        self,
        monitor: MonitorView,
        log_probs: torch.Tensor,
        label: torch.Tensor,
        tags: tuple[Any, Any] | None,
        slot: int,
    ) -> None:
        """A fused head's per-token log-probabilities [B, T] and label mask: the loss
        is ``-sum_t w_t log p_t``, so the gradient at ``log_probs`` is ``-w_t`` (exact,
        whatever the head computed inside)."""
        self._late.poll(monitor)
        step = self._current(monitor)
        step.calls[slot] += 1
        if not step.reporting:
            return
        modality, segments = tags if tags is not None else (None, None)
        shape = tuple(log_probs.shape)
        rows, cols = shape if len(shape) == 2 else (1, shape[0])
        if segments is not None and tuple(segments.shape) != shape and segments.dim() == 2:
            segments = segments[:, -cols:]  # labels shifted by one: the fused head scores positions 1..T-1
        if modality is not None and isinstance(modality, torch.Tensor) and modality.dim() == 2:
            if tuple(modality.shape) != shape:
                modality = modality[:, -cols:]
        codes = self._codes(monitor, modality, log_probs.detach(), rows, cols)
        seg = self._segments(segments, shape, rows, cols, log_probs.device)
        self._ensure_sums(step, log_probs.device)
        loss = (-log_probs.detach()).reshape(rows, cols)
        mask = label.detach().reshape(rows, cols).to(loss.device)
        layout = self._layout
        assert layout is not None
        m = len(monitor.modalities)

        def weights(grad: torch.Tensor) -> None:
            step.fired += 1
            assert step.sums is not None
            fdt = step.sums.dtype
            self._count_nonfinite(loss, mask)
            batch = bin_batch(layout, step.sums, loss, mask, seg, codes, probe=False, count_unknown=m > 0)
            w = -grad.detach().reshape(-1).to(fdt)
            inv = self._inv_scale(monitor, grad.device, fdt)
            if inv is not None:
                w = w * inv
            self._add_weights(step, slot, *weight_sums(layout, batch, w))

        log_probs.register_hook(self._hook("the fused head's log-prob hook", weights))

    def _logits_hook(
        self,
        monitor: MonitorView,
        step: _Step,
        logits: torch.Tensor,
        version: int,
        seam: _Seam,
        slot: int,
        seq_first: bool,
    ) -> Any:
        # ``logits`` is detached (and [B, S, V] when they came sequence-first): the hook
        # holds the values, never the autograd graph. ``version``: their version counter
        # at the forward; a later one means they were overwritten in place.
        layout = self._layout
        assert layout is not None
        config = monitor.config
        m = len(monitor.modalities)
        rows, cols = seam.shape

        def weights(grad: torch.Tensor) -> None:
            assert step.sums is not None
            fdt = step.sums.dtype
            vocab = grad.shape[-1]
            g = (grad.detach().transpose(0, 1) if seq_first else grad.detach()).reshape(-1, vocab)
            if seam.per_token:
                self._check_per_token(step, seam, g)
                return
            step.fired += 1
            if logits._version != version:
                step.sums[layout.overwritten].add_(1.0)
                return
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
            batch = bin_batch(layout, step.sums, loss, label, seam.seg, seam.codes, probe=False, count_unknown=m > 0)
            self._add_weights(step, slot, *weight_sums(layout, batch, w, uniform_tolerance(grad.dtype, UNIFORM_RTOL)))
            if m:
                step.outputs += 1
                step.sums[layout.output].add_(output_sums(layout, batch, g, 1, inv))

        return self._hook("the logits hook", weights)

    def _check_per_token(self, step: _Step, seam: _Seam, g: torch.Tensor) -> None:
        """The weights came from the model's per-token loss output; the logits' gradient
        [N, V] must be their cross-entropy's: ``||g_t||_1 = 2 w_t (1 - p_{t,y})`` with
        ``p_{t,y} = exp(-l_t)``, and zero off the label tokens. Needs no logits values
        (they may have been overwritten in place)."""
        layout = self._layout
        assert layout is not None and step.sums is not None
        if seam.weight is None or seam.loss is None:
            return  # the per-token loss got no gradient: nothing was read
        fdt = step.sums.dtype
        l1 = g.abs().sum(dim=1, dtype=torch.float32).to(fdt)
        expected = 2 * seam.weight * -torch.expm1(-seam.loss)
        residual = (l1 - expected).abs().sum()
        step.sums[layout.not_ce].add_((residual > l1.sum() * residual_tolerance(g.dtype)).to(fdt))
        if seam.batch is not None and layout.bins > 1:
            step.outputs += 1
            step.sums[layout.output].add_(output_sums(layout, seam.batch, g, 1, seam.inv))

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

    # -- coverage: why a reported step has no loss figures ----------------------
    def _coverage(self, monitor: MonitorView, ctx: StepContext, step: _Step | None) -> None:
        """This report's loss (and probe) coverage verdicts, host-side (what the device
        decides, a gradient that is not cross-entropy, loss_report adds)."""
        probe = self._probe
        if probe is None:
            monitor.coverage.clear("probe")
        elif not probe.supported:
            monitor.coverage.set_inactive("probe", "sharded", "probe_every needs unsharded parameters")
        else:
            monitor.coverage.set_active("probe")
        if step is not None and step.fired:
            self._unfed = 0
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
                wmax=step.wmax,
                wmin=step.wmin,
                calls=step.calls,
                weights=step.weights,
                normalization=step.normalization,
                fired=step.fired > 0,
                output=step.outputs > 0,
            )
        )
        report.report(
            monitor, ctx, acc, nonfinite=self._nonfinite, zero_code=self._zero_code, probe=self._probe, gram=gram
        )


def _input_ids(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A forward's input ids [B, S]: ``input_ids=`` or the first 2-D integer tensor."""
    found = kwargs.get("input_ids")
    if not isinstance(found, torch.Tensor):
        found = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2), None)
    if found is None or found.dim() != 2 or found.is_floating_point() or found.dtype == torch.bool:
        return None
    return found


MEDIA_TOKEN_FIELDS = {
    "image": ("image_token_id", "image_token_index"),
    "video": ("video_token_id", "video_token_index"),
}
"""Config fields where a vision-language model names the token that stands for an
image (video) in its input ids (LLaVA, Qwen2-VL, Idefics, ...)."""


def model_media_tokens(model: Any) -> dict[str, int]:
    """``{"image": id, "video": id}`` as far as the model's config says them."""
    config = getattr(model, "config", None)
    found: dict[str, int] = {}
    if config is None:
        return found
    for name, fields in MEDIA_TOKEN_FIELDS.items():
        for f in fields:
            value = getattr(config, f, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                found[name] = value
                break
    return found


def media_codes(model: Any, modalities: tuple[str, ...]) -> list[tuple[int, int]]:
    """(modality code, token id) for each declared modality ``image``/``video`` the
    model's config names a token for, and the code of ``text`` first as (code, -1);
    empty when the model names none or ``text`` is not declared."""
    tokens = model_media_tokens(model)
    if "text" not in modalities:
        return []
    pairs = [(modalities.index(name), tid) for name, tid in tokens.items() if name in modalities]
    return [(modalities.index("text"), -1), *pairs] if pairs else []


def _sample_codes(ids: torch.Tensor, media: list[tuple[int, int]]) -> torch.Tensor:
    """Per sample: the code of the last media modality whose token its input ids hold,
    else text's."""
    text = media[0][0]
    codes = torch.full((ids.shape[0],), text, dtype=torch.long, device=ids.device)
    for code, token in media[1:]:
        codes = torch.where((ids == token).any(dim=1), code, codes)
    return codes


def _fused_output(output: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(log_probs, label_mask) of a fused LM head's output (TRL's FusedCausalLMOutput:
    per-token log-probabilities of the labels, no logits), or None."""
    if getattr(output, "logits", None) is not None:
        return None
    log_probs = getattr(output, "log_probs", None)
    label = getattr(output, "label_mask", None)
    if not (isinstance(log_probs, torch.Tensor) and isinstance(label, torch.Tensor)):
        return None
    if not log_probs.requires_grad or label.shape != log_probs.shape or log_probs.dim() not in (1, 2):
        return None
    return log_probs, label.bool()


def _per_token_output(output: Any, shape: tuple[int, int]) -> bool:
    """Whether a model's output is a per-token tensor over the logits' positions (its
    per-token losses): floating, with a gradient, [B, S] or [S, B]."""
    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or not output.requires_grad:
        return False
    return output.dim() == 2 and (tuple(output.shape) == shape or tuple(output.shape) == shape[::-1])


def _layout_problem(logits: torch.Tensor | None, vocab: int | None) -> str:
    """Why a head's output cannot be read as logits [B, S, V] / [S, B, V] / [N, V]; "" if it can."""
    if logits is None:
        return "holds no tensor"
    if logits.dim() not in (2, 3):
        return f"has {logits.dim()} dimensions, not 2 or 3"
    if vocab is not None and logits.shape[-1] != vocab:
        return f"has {logits.shape[-1]} entries in its last dimension, not the vocabulary's {vocab}"
    return ""


def _megatron_per_sample(model: Any) -> bool:
    """A Megatron-core model whose loss is averaged per micro-batch (its default)."""
    config = getattr(model, "config", None)
    return type(model).__module__.startswith("megatron.") and getattr(config, "calculate_per_token_loss", None) is False
