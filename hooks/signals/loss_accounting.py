"""Loss accounting: where the gradient weight of a step goes (INCIDENTS.md I1, I2, I3).

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

The opt-in parameter-space probe (``attach(probe_every=N)``) lives in
``loss_probe.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from trainvitals.hooks.signals.base import Signal, StepContext
from trainvitals.hooks.signals.loss_probe import ModalityProbe

log = logging.getLogger("trainvitals")

UNIFORM_RTOL = 1e-3
"""Token weights of a micro-batch within this relative spread count as uniform
(per-token normalized): float rounding of 1/n stays far below it."""

MIN_LOG_LENGTH_VAR = 1e-6
"""Below this variance of log(label tokens per sample) there is no slope to fit."""


def _float_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _packed_sample_ids(segments: torch.Tensor) -> torch.Tensor:
    """Sample id per token of packed rows [R, C]: one id per distinct (row, segment id),
    numbered from 0, flattened. A sort per row, so ids need no range and no host sync."""
    rows, cols = segments.shape
    ordered, order = torch.sort(segments, dim=1, stable=True)
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    ids = new.reshape(-1).cumsum(0).sub_(1).view(rows, cols)
    return torch.empty_like(ids).scatter_(1, order, ids).reshape(-1)


@dataclass
class _Step:
    """What the optimizer step now being accumulated has gathered so far."""

    token: tuple[int, Any]
    reporting: bool
    probe: bool
    tracked: int = 0
    fired: int = 0
    outputs: int = 0
    sums: torch.Tensor | None = None   # [layout.size], float64 (float32 on mps)
    wmax: torch.Tensor | None = None   # [1] largest label-token weight
    wmin: torch.Tensor | None = None   # [1] smallest label-token weight
    probe_grads: torch.Tensor | None = None  # [M, P] per-modality parameter gradients
    extra: dict[str, Any] = field(default_factory=dict)


class _Layout:
    """Offsets into the per-step sums vector: one device tensor, one cross-rank sum.
    Grouped by who writes them, so each writer adds one contiguous block."""

    def __init__(self, modalities: int):
        b = modalities + 1  # the last bin holds codes outside the declared modalities
        self.bins = b
        # written in track_loss (before the backward)
        self.samples = slice(0, b)
        self.tokens = slice(b, 2 * b)
        self.loss = slice(2 * b, 3 * b)
        self.mixed = 3 * b
        self.unknown = 3 * b + 1
        self.prepared = slice(0, 3 * b + 2)
        # written by the per-token loss hook: weight per bin; the exponent fit's
        # count, sum x, sum y, sum xx, sum xy (x = log n_s, y = log w_s); micro-batches
        # whose token weights are not uniform
        w0 = 3 * b + 2
        self.weight = slice(w0, w0 + b)
        self.fit = slice(w0 + b, w0 + b + 5)
        self.nonuniform = w0 + b + 5
        self.hooked = slice(w0, w0 + b + 6)
        # written by the output hook
        self.output = slice(w0 + b + 6, w0 + 2 * b + 6)
        self.nonfinite = w0 + 2 * b + 6  # the cumulative counter rides along in reports
        self.size = self.nonfinite + 1


class _LateWarnings:
    """Log-once warnings about values, read without a host sync: the value is copied
    to the host asynchronously and looked at on a later call, once it has landed."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, str, torch.Tensor, Any]] = []
        self._done: set[str] = set()

    def add(self, key: str, message: str, value: torch.Tensor) -> None:
        if key in self._done or any(p[0] == key for p in self._pending):
            return
        value = value.detach().reshape(())
        if value.device.type == "cpu":
            self._pending.append((key, message, value.clone(), None))
        elif value.device.type == "cuda":
            host = torch.empty((), dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._pending.append((key, message, host, ready))
        # other devices: no cheap completion test; the event in the report remains

    def poll(self, monitor: Any) -> None:
        keep = []
        for key, message, host, ready in self._pending:
            if ready is not None and not ready.query():
                keep.append((key, message, host, ready))
                continue
            count = float(host)  # a host tensor whose copy has completed: no device sync
            if count > 0:
                self._done.add(key)
                monitor.warn_once(key, message, int(count))
        self._pending = keep


class LossAccounting(Signal):
    """Loss weights per sample, modality and micro-batch; see the module docstring."""

    def __init__(self) -> None:
        self._step: _Step | None = None
        self._final: _Step | None = None
        self._nonfinite: torch.Tensor | None = None  # cumulative, on the loss's device
        self._probing = False  # set while the probe runs its own backward passes
        self._late = _LateWarnings()
        self._codes: dict[str, int] = {}
        self._layout: _Layout | None = None
        self._probe: ModalityProbe | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------
    def bind(self, monitor: Any) -> list:
        self._codes = {name: i for i, name in enumerate(monitor.modalities)}
        self._layout = _Layout(len(monitor.modalities))
        if monitor.config.probe_every is not None:
            self._probe = ModalityProbe(monitor)
        return []

    def before_step(self, monitor: Any, reporting: bool) -> None:
        # Gradients are final: this step's accounting is complete.
        step, self._step = self._step, None
        self._final = step if (reporting and step is not None and step.reporting) else None
        if step is not None and step.reporting and step.tracked and not step.fired:
            monitor.warn_once(
                "loss_weights_missing",
                "track_loss was called but its per-token loss received no gradient before "
                "optimizer.step(); pass the tensor the loss is reduced from, before its backward")

    def close(self) -> None:
        self._closed = True
        self._step = self._final = None  # drops the probe's gradient buffers too

    # -- the user call -----------------------------------------------------------
    def track(self, monitor: Any, per_token: torch.Tensor, *, modality: Any,
              mask: torch.Tensor | None = None, segments: torch.Tensor | None = None,
              output: torch.Tensor | None = None) -> None:
        """Account one micro-batch's per-token losses; call once per micro-batch, before
        its backward.

        ``per_token``: [B, T] (or [N]) per-token losses the loss is reduced from; it must
        require grad. ``modality``: per sample [B] or per token [B, T] integer codes,
        names from ``attach(modalities=...)`` (one per row, or one for all). ``mask``:
        [B, T] bool, the label tokens (default: all). ``segments``: [B, T] sample ids
        of packed rows. ``output``: logits or last hidden states [B, T, ...] (or
        [B*T, ...]), for ``modality_grad_norm{scope="output"}``. Wrong types, shapes
        and unknown names raise here; problems in the values become events. Every
        backward that reaches ``per_token`` within the step is counted.
        """
        if self._layout is None:  # created outside Monitor._signal: bind ourselves
            self.bind(monitor)
        rows, cols, codes = self._check(monitor, per_token, modality, mask, segments, output)
        if self._closed or getattr(self, "_trainvitals_broken", False):
            return
        try:
            self._track(monitor, per_token, rows, cols, codes, mask, segments, output)
        except Exception as exc:  # noqa: BLE001 - never break the training step
            self._broken(monitor, "track_loss", exc)

    def _broken(self, monitor: Any, where: str, exc: Exception) -> None:
        self._trainvitals_broken = True  # Monitor._guard skips us from now on
        self._step = self._final = None
        log.warning("trainvitals: loss accounting failed in %s and is turned off: %s: %s",
                    where, type(exc).__name__, exc)

    def _track(self, monitor: Any, per_token: torch.Tensor, rows: int, cols: int, codes: Any,
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
        seg = None if segments is None else segments.detach().reshape(rows, cols).to(loss.device)
        batch = self._prepare(monitor, step, loss, label, seg, codes)
        per_token.register_hook(self._weight_hook(monitor, step, batch, per_token))
        if output is not None:
            step.outputs += 1
            lead = per_token.dim() if tuple(output.shape[: per_token.dim()]) == tuple(per_token.shape) else 1
            output.register_hook(self._output_hook(monitor, step, batch, lead))

    # -- argument checks (shapes and types only: raise at once) -----------------
    def _check(self, monitor: Any, per_token: Any, modality: Any, mask: Any, segments: Any,
               output: Any) -> tuple[int, int, Any]:
        if not isinstance(per_token, torch.Tensor):
            raise TypeError(f"track_loss(per_token=...) needs a tensor of per-token losses, got "
                            f"{type(per_token).__name__}; compute the loss with reduction='none'")
        if not per_token.is_floating_point():
            raise TypeError(f"track_loss: per_token must be floating point, got {per_token.dtype}")
        if not per_token.requires_grad:
            raise ValueError(
                "track_loss: per_token does not require grad. Pass the unreduced per-token loss "
                "(e.g. F.cross_entropy(..., reduction='none')) that the loss you call backward on "
                "is computed from, before reducing it; not a detached copy, and not under torch.no_grad()")
        if per_token.dim() not in (1, 2):
            raise ValueError(f"track_loss: per_token must be [B, T] (or [N]), got shape {tuple(per_token.shape)}")
        if per_token.dim() == 1:
            rows, cols = (1, per_token.shape[0]) if segments is not None else (per_token.shape[0], 1)
        else:
            rows, cols = per_token.shape
        shape = tuple(per_token.shape)
        if not monitor.modalities:
            raise ValueError("track_loss needs modality names: attach(..., modalities=('text', 'image')), "
                             "then pass codes or names per sample")
        for name, t in (("mask", mask), ("segments", segments)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"track_loss: {name} must be a tensor shaped like per_token {shape}, "
                                f"got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"track_loss: {name} has shape {tuple(t.shape)}, per_token {shape}; "
                                 f"pass one value per token")
        if mask is not None and mask.dtype != torch.bool:
            raise TypeError(f"track_loss: mask must be boolean (label tokens), got {mask.dtype}; "
                            "e.g. mask=labels != -100")
        if segments is not None and (segments.is_floating_point() or segments.is_complex()
                                     or segments.dtype == torch.bool):
            raise TypeError(f"track_loss: segments must hold integer sample ids, got {segments.dtype}")
        if output is not None:
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"track_loss: output must be the logits or last hidden states tensor, "
                                f"got {type(output).__name__}")
            if not output.requires_grad:
                raise ValueError("track_loss: output does not require grad; pass the logits or hidden "
                                 "states the per-token loss is computed from")
            lead = tuple(output.shape[: per_token.dim()])
            if lead != shape and not (output.dim() >= 1 and output.shape[0] == per_token.numel()):
                raise ValueError(f"track_loss: output has shape {tuple(output.shape)}; it must start with "
                                 f"per_token's shape {shape} (e.g. logits [B, T, V])")
        return rows, cols, self._modality_codes(modality, per_token, rows, cols)

    def _modality_codes(self, modality: Any, per_token: torch.Tensor, rows: int, cols: int) -> Any:
        known = list(self._codes)
        if isinstance(modality, str):
            return self._code_of(modality, known)
        if isinstance(modality, int) and not isinstance(modality, bool):
            return modality
        if isinstance(modality, (list, tuple)):
            if len(modality) != rows or per_token.dim() != 2:
                raise ValueError(f"track_loss: a list of modalities needs one entry per row of a "
                                 f"[B, T] per_token (B={per_token.shape[0]}), got {len(modality)}")
            codes = [self._code_of(m, known) if isinstance(m, str) else m for m in modality]
            if not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
                raise TypeError("track_loss: modality list entries must be names or integer codes")
            return torch.tensor(codes, dtype=torch.long).to(per_token.device, non_blocking=True)
        if not isinstance(modality, torch.Tensor):
            raise TypeError(f"track_loss: modality must be codes (tensor [B] or [B, T]), names "
                            f"{known} or one name for all, got {type(modality).__name__}")
        if modality.is_floating_point() or modality.is_complex() or modality.dtype == torch.bool:
            raise TypeError(f"track_loss: modality codes must be integers, got {modality.dtype}")
        if modality.dim() == 0:
            return modality.reshape(1).expand(rows).to(per_token.device, non_blocking=True)
        shape = tuple(per_token.shape)
        if per_token.dim() == 2 and tuple(modality.shape) == shape[:1]:
            return modality.to(per_token.device, non_blocking=True)
        if tuple(modality.shape) == shape:
            return modality.reshape(rows, cols).to(per_token.device, non_blocking=True)
        raise ValueError(f"track_loss: modality has shape {tuple(modality.shape)}; pass one code per "
                         f"sample {shape[:1]} or per token {shape}")

    def _code_of(self, name: Any, known: list[str]) -> int:
        code = self._codes.get(name)
        if code is None:
            raise ValueError(f"track_loss: unknown modality {name!r}; known modalities: {known} "
                             f"(declared with attach(modalities=...))")
        return code

    # -- per-step state ---------------------------------------------------------
    def _current(self, monitor: Any) -> _Step:
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
        self._nonfinite += bad.any()

    # -- reporting steps: what the hooks need, computed before the backward ------
    def _prepare(self, monitor: Any, step: _Step, loss: torch.Tensor, label: torch.Tensor | None,
                 seg: torch.Tensor | None, codes: Any) -> dict[str, Any]:
        lay = self._layout
        m = lay.bins - 1
        rows, cols = loss.shape
        dev = loss.device
        fdt = _float_dtype(dev)
        if step.sums is None:
            step.sums = torch.zeros(lay.size, dtype=fdt, device=dev)
            step.wmax = torch.full((1,), float("-inf"), dtype=fdt, device=dev)
            step.wmin = torch.full((1,), float("inf"), dtype=fdt, device=dev)
        lab = (label if label is not None else torch.ones_like(loss, dtype=torch.bool)).reshape(-1)
        labf = lab.to(fdt)

        # Sample ids per token, in [0, n_samples).
        if seg is None:
            n_samples = rows
            sid = torch.arange(rows, device=dev).repeat_interleave(cols)
        else:
            n_samples = rows * cols
            sid = _packed_sample_ids(seg)
        n_s = torch.zeros(n_samples, dtype=fdt, device=dev).index_add_(0, sid, labf)
        has = n_s > 0

        # Modality bin per sample: declared codes, else the overflow bin m.
        if isinstance(codes, int):
            codes = torch.full((rows,), codes, dtype=torch.long, device=dev)
        codes = codes.long()
        valid = (codes >= 0) & (codes < m)
        binned = torch.where(valid, codes, m)
        if codes.dim() == 1 and seg is None:  # one code per row = per sample
            s_bin = binned
            unknown = (n_s * ~valid).sum()
            mixed = torch.zeros((), dtype=fdt, device=dev)
        else:
            tok_code = binned.reshape(-1) if codes.dim() == 2 else binned.repeat_interleave(cols)
            hi = torch.full((n_samples,), -1, dtype=torch.long, device=dev).scatter_reduce_(
                0, sid, torch.where(lab, tok_code, -1), reduce="amax")
            lo = torch.full((n_samples,), m + 1, dtype=torch.long, device=dev).scatter_reduce_(
                0, sid, torch.where(lab, tok_code, m + 1), reduce="amin")
            s_bin = hi.clamp(0, m)
            mixed = (has & (hi != lo)).sum().to(fdt)
            unknown = (lab & (tok_code == m)).sum().to(fdt)
        s_bin = torch.where(has, s_bin, m)
        tok_bin = s_bin[sid]

        zeros = torch.zeros(lay.bins, dtype=fdt, device=dev)
        loss_lab = torch.where(lab, loss.reshape(-1).to(fdt), 0.0)
        step.sums[lay.prepared].add_(torch.cat([
            zeros.index_add(0, s_bin, has.to(fdt)),
            zeros.index_add(0, s_bin, n_s),
            zeros.index_add(0, tok_bin, loss_lab),
            mixed.to(fdt).reshape(1), unknown.to(fdt).reshape(1)]))
        batch = {"lab": lab, "sid": sid, "n_samples": n_samples, "has": has, "s_bin": s_bin,
                 "tok_bin": tok_bin, "log_n": torch.log(n_s.clamp_min(1.0)), "fdt": fdt}
        if step.probe:
            mods = torch.arange(m, device=dev)[:, None]
            batch["probe_masks"] = ((tok_bin[None, :] == mods) & lab[None, :]).to(loss.dtype)
        return batch

    # -- hooks: during the user's backward ---------------------------------------
    def _inv_scale(self, monitor: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
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

    def _weight_hook(self, monitor: Any, step: _Step, b: dict[str, Any], per_token: torch.Tensor):
        lay = self._layout

        def weights(grad: torch.Tensor) -> None:
            step.fired += 1
            fdt = b["fdt"]
            dev = grad.device
            w = grad.detach().reshape(-1).to(fdt)
            inv = self._inv_scale(monitor, dev, fdt)
            if inv is not None:
                w = w * inv
            lab = b["lab"]
            w = torch.where(lab, w, 0.0)
            w_s = torch.zeros(b["n_samples"], dtype=fdt, device=dev).index_add_(0, b["sid"], w)
            # Exponent fit: sufficient statistics over samples with positive weight.
            ok = b["has"] & (w_s > 0)
            x = torch.where(ok, b["log_n"], 0.0)
            y = torch.where(ok, torch.log(torch.where(ok, w_s, 1.0)), 0.0)
            # Token-weight uniformity within the micro-batch, and its extremes (I3).
            wmax = torch.where(lab, w, float("-inf")).amax().reshape(1)
            wmin = torch.where(lab, w, float("inf")).amin().reshape(1)
            uniform = (wmin > 0) & (wmax <= wmin * (1 + UNIFORM_RTOL))
            step.sums[lay.hooked].add_(torch.cat([
                torch.zeros(lay.bins, dtype=fdt, device=dev).index_add_(0, b["s_bin"], w_s),
                torch.stack([ok.to(fdt), x, y, x * x, x * y]).sum(1),
                (torch.isfinite(wmin) & ~uniform).to(fdt)]))
            torch.maximum(step.wmax, wmax, out=step.wmax)
            torch.minimum(step.wmin, wmin, out=step.wmin)
            if step.probe and self._probe is not None:
                self._probing = True
                try:
                    step.probe_grads = self._probe.accumulate(
                        step.probe_grads, per_token, grad, b["probe_masks"], inv, monitor)
                finally:
                    self._probing = False

        return self._guarded(monitor, "the per-token loss hook", weights)

    def _guarded(self, monitor: Any, where: str, fn: Any):
        """A tensor hook running ``fn(grad)``: skipped during the probe's own backward or
        once the signal is off; a failure turns the signal off, never the user's backward."""

        def hook(grad: torch.Tensor) -> None:
            if self._probing or self._closed or getattr(self, "_trainvitals_broken", False):
                return
            try:
                fn(grad)
            except Exception as exc:  # noqa: BLE001 - never break the user's backward
                self._broken(monitor, where, exc)

        return hook

    def _output_hook(self, monitor: Any, step: _Step, b: dict[str, Any], lead_dims: int):
        lay = self._layout

        def norms(grad: torch.Tensor) -> None:
            fdt = b["fdt"]
            g = grad.detach()
            dims = tuple(range(lead_dims, g.dim()))
            # One fused reduction over the feature dims: no [B, T, V] temporary.
            sq = (torch.linalg.vector_norm(g, dim=dims, dtype=torch.float32) if dims
                  else g.float().abs()).reshape(-1).to(fdt).square()
            inv = self._inv_scale(monitor, g.device, fdt)
            if inv is not None:
                sq = sq * (inv * inv)
            step.sums[lay.output].index_add_(0, b["tok_bin"], sq)

        return self._guarded(monitor, "the output hook", norms)

    # -- report ------------------------------------------------------------------
    def collect(self, monitor: Any, ctx: StepContext) -> None:
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
                self._emit_counter(ctx)
                return
            dev = ctx.device
            fdt = _float_dtype(dev)
            sums = torch.zeros(lay.size, dtype=fdt, device=dev)
            wmax = torch.full((1,), float("-inf"), dtype=fdt, device=dev)
            wmin = torch.full((1,), float("inf"), dtype=fdt, device=dev)
        else:
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
        got: dict[str, torch.Tensor] = {}
        info = {"microbatches": 0 if step is None else step.tracked,
                "fired": step is not None and step.fired > 0,
                "output": step is not None and step.outputs > 0,
                "probe": probe}
        ctx.reduce(sums, "sum", lambda t: got.__setitem__("sum", t))
        ctx.reduce(wmax, "max", lambda t: got.__setitem__("max", t))
        ctx.reduce(wmin, "min", lambda t: self._emit(monitor, ctx, got["sum"], got["max"], t, info))

    def _emit_counter(self, ctx: StepContext) -> None:
        if self._nonfinite is not None:
            ctx.emit("nonfinite_total", self._nonfinite.float(), {"what": "loss"})

    def _emit(self, monitor: Any, ctx: StepContext, sums: torch.Tensor, wmax: torch.Tensor,
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
