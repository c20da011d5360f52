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
  totals only (event + log once).
- ``w_s`` = sum of the sample's label-token weights, ``n_s`` = its label tokens.
- ``modality_sample_share_ratio`` / ``_token_share_ratio`` / ``_grad_share_ratio``:
  the modality's share of samples, label tokens, and weight ``sum w`` (I1).
  ``modality_dilution_ratio`` = sample share / grad share (1 when every sample
  weighs the same; 17 in I1).
- ``loss``: mean per-token loss over every label token; ``modality_loss{modality}``
  over the modality's label tokens.
- ``loss_norm_exponent``: least-squares slope of ``log w_s`` on ``log n_s`` over
  the samples with ``w_s > 0``: 1 per-token, 0.5 sqrt, 0 per-sample normalization.
  Absent when the lengths do not vary (no slope to fit).
- ``loss_weight_mass``: ``sum w`` over the step (I2): 1 for a loss normalized over
  the step, N when the division by N accumulation steps is missing. Under data
  parallelism DDP averages gradients, so a token's effective weight is
  ``w / world``: the mass is the sum over ranks divided by the world size.
  With ``attach(loss_reduction="sum")`` the job sums on purpose and divides later
  (across ranks too, as Megatron's per-token path does): the mass is the sum over
  ranks divided by ``loss_scale`` (default: the step's label tokens over all
  ranks), so 1 is still healthy.
- ``token_weight_spread_ratio``: max over the step's micro-batches (and ranks) of
  their per-token weight over the min (I3): 1 for a globally normalized per-token
  loss, the token-count ratio for a mean of per-micro-batch means. Present only
  when every micro-batch is per-token normalized, i.e. its label tokens' weights
  are equal within a relative 1e-3.
- ``modality_grad_norm{scope="output"}``: with ``output`` (logits or last hidden
  states), the gradient of the step's loss w.r.t. that tensor restricted to the
  modality's samples: sqrt of the sum over the modality's samples (and the step's
  micro-batches and ranks) of squared per-sample output-gradient norms, scaled like
  the mass (``/ world``, or ``/ loss_scale`` with "sum").
- ``microbatches``: ``track_loss`` calls in the step (this rank).
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

The binning arithmetic lives in :mod:`~trainvitals.hooks.signals.loss_binning`,
the argument checks in :mod:`~trainvitals.hooks.signals.loss_arguments`, the
opt-in parameter-space probe (``attach(probe_every=N)``) in
:mod:`~trainvitals.hooks.signals.loss_probe`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from trainvitals.hooks.late_warnings import LateWarnings
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.loss_arguments import check_track_loss
from trainvitals.hooks.signals.loss_binning import (
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


@dataclass
class _Step:
    """What the optimizer step now being accumulated has gathered so far."""

    token: tuple[int, Any]
    reporting: bool
    probe: bool
    tracked: int = 0
    fired: int = 0
    outputs: int = 0
    sums: torch.Tensor | None = None  # [layout.size], float64 (float32 on mps)
    wmax: torch.Tensor | None = None  # [1] largest label-token weight
    wmin: torch.Tensor | None = None  # [1] smallest label-token weight
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

    # -- lifecycle -------------------------------------------------------------
    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._layout = SumsLayout(len(monitor.modalities))
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
                "optimizer.step(); pass the tensor the loss is reduced from, before its backward")

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
    def track(self, monitor: MonitorView, per_token: torch.Tensor, *, modality: Any,
              mask: torch.Tensor | None = None, segments: torch.Tensor | None = None,
              output: torch.Tensor | None = None) -> None:
        """Account one micro-batch's per-token losses; see ``Monitor.track_loss``.
        Wrong types, shapes and unknown names raise here; past the checks nothing does."""
        rows, cols, codes = check_track_loss(monitor.modalities, per_token, modality, mask, segments, output)
        if self._layout is None:  # created outside Monitor._signal: bind ourselves
            self.bind(monitor)
        if self._closed or self.broken:
            return
        with self.guard("track_loss"):
            self._track(monitor, per_token, rows, cols, codes, mask, segments, output)

    def _track(self, monitor: MonitorView, per_token: torch.Tensor, rows: int, cols: int, codes: Any,
               mask: torch.Tensor | None, segments: torch.Tensor | None, output: torch.Tensor | None) -> None:
        self._late.poll(monitor)
        step = self._current(monitor)
        step.tracked += 1
        if per_token.numel() == 0:
            return
        loss = per_token.detach().reshape(rows, cols)
        label = None if mask is None else mask.detach().reshape(rows, cols).to(loss.device)
        self._count_nonfinite(loss, label)
        if not step.reporting:
            return
        assert self._layout is not None
        if step.sums is None:
            fdt = float_dtype(loss.device)
            step.sums = torch.zeros(self._layout.size, dtype=fdt, device=loss.device)
            step.wmax = torch.full((1,), float("-inf"), dtype=fdt, device=loss.device)
            step.wmin = torch.full((1,), float("inf"), dtype=fdt, device=loss.device)
        seg = None if segments is None else segments.detach().reshape(rows, cols).to(loss.device)
        batch = bin_batch(self._layout, step.sums, loss, label, seg, codes, probe=step.probe)
        per_token.register_hook(self._weight_hook(monitor, step, batch, per_token))
        if output is not None:
            step.outputs += 1
            lead = per_token.dim() if tuple(output.shape[: per_token.dim()]) == tuple(per_token.shape) else 1
            output.register_hook(self._output_hook(monitor, step, batch, lead))

    # -- per-step state ---------------------------------------------------------
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

    def _weight_hook(self, monitor: MonitorView, step: _Step, b: Batch, per_token: torch.Tensor) -> Any:
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
            block, wmax, wmin = weight_sums(layout, b, w)
            assert step.sums is not None and step.wmax is not None and step.wmin is not None
            step.sums[layout.hooked].add_(block)
            torch.maximum(step.wmax, wmax, out=step.wmax)
            torch.minimum(step.wmin, wmin, out=step.wmin)
            source = per_token_ref()
            if step.probe and self._probe is not None and source is not None and b.probe_masks is not None:
                self._probing = True
                try:
                    step.probe_grads = self._probe.accumulate(
                        step.probe_grads, source, grad, b.probe_masks, inv, monitor)
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
            wmax = torch.full((1,), float("-inf"), dtype=fdt, device=dev)
            wmin = torch.full((1,), float("inf"), dtype=fdt, device=dev)
        else:
            assert step.wmax is not None and step.wmin is not None
            sums, wmax, wmin = step.sums, step.wmax, step.wmin
        if self._nonfinite is not None:
            sums = sums.clone()
            sums[lay.nonfinite] = self._nonfinite.to(sums.device, sums.dtype)
        self._late.add("loss_mixed_modality",
                       "%d sample(s) mix modalities among their label tokens; each counts under the "
                       "highest code. Pass one modality per sample (or per label token of it).",
                       sums[lay.mixed])
        self._late.add("loss_unknown_modality",
                       f"%d label token(s) carry a modality code outside 0..{lay.bins - 2} "
                       f"(attach(modalities={list(monitor.modalities)})); they count toward totals only",
                       sums[lay.unknown])
        if self._nonfinite is not None:
            self._late.add("loss_nonfinite", "%d micro-batch(es) had a non-finite per-token loss on a "
                           "label token", self._nonfinite)
        info = {"microbatches": 0 if step is None else step.tracked,
                "fired": step is not None and step.fired > 0,
                "output": step is not None and step.outputs > 0,
                "probe": probe}
        ctx.combine([(sums, "sum"), (wmax, "max"), (wmin, "min")],
                    lambda s, mx, mn: self._emit(monitor, ctx, s, mx, mn, info), across_ranks=True)

    def _emit(self, monitor: MonitorView, ctx: StepContext, sums: torch.Tensor, wmax: torch.Tensor,
              wmin: torch.Tensor, info: dict[str, Any]) -> None:
        lay = self._layout
        names = list(monitor.modalities)
        m = len(names)
        mod_labels = [{"modality": n} for n in names]
        if self._nonfinite is not None or monitor.world_size > 1:
            ctx.emit("nonfinite_total", sums[lay.nonfinite], {"what": "loss"})
        ctx.emit("microbatches", torch.tensor(float(info["microbatches"])))
        samples, tokens = sums[lay.samples], sums[lay.tokens]
        weight, loss_sum = sums[lay.weight], sums[lay.loss]
        total_samples, total_tokens, total_weight = samples.sum(), tokens.sum(), weight.sum()
        some = (total_tokens > 0).float()

        ctx.emit("loss", loss_sum.sum() / total_tokens, present=some)
        ctx.emit("modality_loss", loss_sum[:m] / tokens[:m], mod_labels, present=tokens[:m])
        sample_share = samples[:m] / total_samples
        ctx.emit("modality_sample_share_ratio", sample_share, mod_labels, present=some.expand(m))
        ctx.emit("modality_token_share_ratio", tokens[:m] / total_tokens, mod_labels, present=some.expand(m))
        ctx.event("loss_sample_mixed_modality",
                  "samples whose label tokens mix modalities (counted under the highest code)",
                  when=sums[lay.mixed])
        ctx.event("loss_unknown_modality_code", "label tokens with a modality code outside attach(modalities=...)",
                  when=sums[lay.unknown])
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
        ctx.emit("modality_dilution_ratio", sample_share / grad_share, mod_labels,
                 present=samples[:m] * has_weight)
        ctx.emit("loss_weight_mass", total_weight / scale, present=some)
        n, sx, sy, sxx, sxy = sums[lay.fit].unbind()
        var_x = sxx / n - (sx / n) ** 2
        fit_ok = (n >= 2) & (var_x > MIN_LOG_LENGTH_VAR)
        ctx.emit("loss_norm_exponent", (n * sxy - sx * sy) / (n * sxx - sx * sx), present=fit_ok.float())
        spread_ok = (sums[lay.nonuniform] == 0) & (wmin > 0).squeeze(0) & torch.isfinite(wmax).squeeze(0)
        ctx.emit("token_weight_spread_ratio", (wmax / wmin).squeeze(0), present=spread_ok.float())
        if info["output"]:
            ctx.emit("modality_grad_norm", sums[lay.output][:m].sqrt() / scale,
                     [{"modality": n, "scope": "output"} for n in names], present=samples[:m])
        if info["probe"] is not None:
            self._probe.emit(ctx, info["probe"], names, scale)
