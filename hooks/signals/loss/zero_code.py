"""Loss accounting, zero-code seams: the token weights read from the model's own
outputs, per framework, without a ``track_loss`` call (``attach(loss_from_logits=True)``).

- Any LM head (Hugging Face Trainer, plain cross-entropy loops): a forward hook on
  the head places, on report steps only, a tensor hook on its output, the logits;
  during the backward that hook recovers every position's weight, loss and label
  flag from the gradient (:mod:`~trainvitals.hooks.signals.loss.logits`) and
  checks that it is a plain cross-entropy's.
- Megatron-core's ``GPTModel`` with labels returns its per-token losses [B, S]: the
  weights are read there (exact), the logits' gradient only checks them; its
  default per-micro-batch averaging reads as per-sample intent on one-sample
  micro-batches.
- TRL's fused LM head (``fused_lm_head=True``) never calls the head module and
  returns per-token log-probabilities: the gradient at them is minus the weights.

A cross-entropy's token weights are >= 0. On the per-token paths (fused log-probs,
per-token losses) a negative weight flags the micro-batch as not cross-entropy: a
policy gradient (GRPO's weight x advantage, zero-mean per group), a preference or
distillation loss on the same per-token log-probabilities is never read as weights.

Micro-batches are tagged with ``Monitor.tag_batch`` or from the input ids
(:mod:`~trainvitals.hooks.signals.loss.modality`). When the gradient is not a plain
cross-entropy one the step's figures are left out and a log line says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainvitals.hooks.logits_finder import expected_vocab, logits_of
from trainvitals.hooks.megatron import vocab_shard_group
from trainvitals.hooks.signals.base import MonitorView, Removable
from trainvitals.hooks.signals.loss.arguments import _modality_codes
from trainvitals.hooks.signals.loss.binning import UNIFORM_RTOL, Batch, bin_batch
from trainvitals.hooks.signals.loss.logits import (
    cross_entropy_residual,
    recover,
    residual_tolerance,
    uniform_tolerance,
)
from trainvitals.hooks.signals.loss.modality import input_ids, media_codes, sample_codes
from trainvitals.hooks.signals.loss.sharded import VocabShards, recover_shards, vocab_group, vocab_split
from trainvitals.hooks.signals.loss.step import LossStep, StepBook
from trainvitals.hooks.signals.packing.boundaries import (
    Boundaries,
    media_codes_per_sample,
    packed_segments,
    read_boundaries,
)
from trainvitals.hooks.tensors import is_dtensor, local

__all__ = ["ZeroCodeSeams"]


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
    shards: VocabShards | None = None  # DTensor logits split on the vocabulary over these ranks


class ZeroCodeSeams(StepBook):
    """The zero-code capture paths of loss accounting (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._zero_code = False  # weights read from the logits' gradient (watch_logits)
        self._tags: tuple[Any, Any] | None = None  # (modality, segments) for the next logits
        self._inputs: tuple[int, int] | None = None  # the model's current input ids' [B, S]
        self._auto: torch.Tensor | None = None  # per-sample codes from the input ids' image/video tokens
        self._bounds: Boundaries | None = None  # the samples of packed rows, read from the forward's arguments
        self._seam: _Seam | None = None  # the head's logits in the model's current forward
        self._head = ""  # the hooked LM head's name
        self._per_sample = False  # Megatron's default loss: per-sample intent on one-sample micro-batches
        self._megatron_default: bool | None = None  # track_loss on such a model (read at its first call)
        self._logits_handles: list[Removable] = []
        self._auto_head = False
        self._vocab_group: Any = None  # the logits are a vocabulary shard over this group (Megatron TP)
        self._shards: VocabShards | None = None  # the head's DTensor weight is split on the vocabulary

    def collectives_in_step(self) -> bool:
        """A vocabulary-parallel head: the backward's hooks gather each micro-batch's
        extremes over the head's shards (:func:`recover_shards`, :func:`_over_shards`)."""
        return self._shards is not None or self._vocab_group is not None

    @property
    def reads_logits(self) -> bool:
        """Zero-code accounting is on: every micro-batch is read at the LM head."""
        return self._zero_code

    def stop_reading_logits(self) -> None:
        """Turn zero-code accounting off (``track_loss`` takes over): the head's hooks are
        removed, and the step begun from them is dropped, with any hook still to fire on
        logits already made (it sees a new generation and does nothing)."""
        for handle in self._logits_handles:
            handle.remove()
        self._logits_handles = []
        self._zero_code = False
        self._tags = self._seam = self._auto = None
        self.forget_step()

    def watch_logits(self, monitor: MonitorView, module: torch.nn.Module, *, auto: bool = False) -> list[Removable]:
        """Account every micro-batch from the gradient at ``module``'s output (the
        logits), objective ``main``; returns the hooks' handles. Hooks on the model
        itself too: before its forward, to read the layout of its input ids; after it,
        for a fused head that never calls ``module`` (TRL's ``fused_lm_head=True``,
        whose output carries per-token log-probabilities instead of logits)."""
        if self._layout is None:
            self.bind(monitor)
        self._zero_code = True
        self._auto_head = auto  # found by default: a track_loss call may take over
        self._head = next((n for n, m in monitor.model.named_modules() if m is module), type(module).__name__)
        slot = self._slot("main")
        root = monitor.model
        self._per_sample = _megatron_per_sample(root) and monitor.config.loss_normalization is None
        vocab = expected_vocab(root, module)
        megatron = type(module).__module__.startswith("megatron.")
        self._vocab_group = vocab_shard_group(module) if megatron else None
        self._shards = None if megatron else vocab_group(module)  # collective: every rank attaches
        fired = [False]  # the head ran in the model's current forward
        media = media_codes(root, monitor.modalities)

        def pre(mod: Any, args: Any, kwargs: Any) -> None:
            fired[0] = False
            self._seam = None
            ids = input_ids(args, kwargs)
            self._inputs = None if ids is None else (int(ids.shape[0]), int(ids.shape[1]))
            self._auto = self._bounds = None
            if monitor.reporting_next and torch.is_grad_enabled():
                self._bounds = read_boundaries(kwargs, self._inputs)  # packed rows: their samples
                seg = self._bounds.segments if self._bounds is not None else None
                if media and ids is not None:
                    self._auto = sample_codes(ids, media) if seg is None else media_codes_per_sample(ids, media, seg)

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
            split: str | bool = False
            if is_dtensor(logits):
                split = vocab_split(logits, self._shards)
                if isinstance(split, str):  # sharded otherwise: no rank holds a token's whole gradient
                    self._current(monitor).layout = f"the output of {self._head!r} {split}"
                    monitor.warn_once(
                        "logits_layout",
                        "loss_from_logits: the output of %s %s; loss figures withheld (track_loss on the "
                        "replicated per-token losses reads them)",
                        self._head,
                        split,
                    )
                    return
            with self.guard("the logits forward hook"):
                self._watch(monitor, logits, tags, slot, self._sequence_first(logits, megatron), split is True)

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
        self._logits_handles = list(handles)
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
        if not self._zero_code and monitor.pipeline_stages == 1:  # (a stage before the last reads no logits)
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
            if len(monitor.modalities) == 1:
                return 0  # one modality declared: every sample is of it
            # Found by default, the first step may yet see track_loss take over: no word before.
            if monitor.modalities and not (self._auto_head and monitor.step == 0):
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
        self,
        monitor: MonitorView,
        logits: torch.Tensor,
        tags: tuple[Any, Any] | None,
        slot: int,
        seq_first: bool,
        split: bool = False,
    ) -> None:
        """``split``: DTensor logits split on the vocabulary over ``self._shards`` (others
        that are DTensors are replicated: the local tensor is all of them)."""
        self._late.poll(monitor)
        step = self._current(monitor)
        step.calls[slot] += 1
        if not step.reporting:
            return
        modality, segments = tags if tags is not None else (None, None)
        hooked, logits = logits, local(logits)  # a DTensor's gradient arrives at the DTensor
        view = logits.detach().transpose(0, 1) if seq_first else logits.detach()
        shape = tuple(view.shape[:-1])
        bounds, self._bounds = self._bounds, None
        if segments is None:
            segments, withheld = packed_segments(bounds, shape)
            step.withheld = step.withheld or withheld
        if len(shape) == 2:
            rows, cols = shape
        else:
            rows, cols = (1, shape[0]) if segments is not None else (shape[0], 1)
        codes = self._codes(monitor, modality, view[..., 0], rows, cols)
        seg = self._segments(segments, shape, rows, cols, logits.device)
        self._imply_intent(step, rows if seg is None else 2)
        self._ensure_sums(step, logits.device)
        seam = self._seam = _Seam((rows, cols), codes, seg, shards=self._shards if split else None)
        hook = self._logits_hook(monitor, step, view, logits._version, seam, slot, seq_first)
        hooked.register_hook(hook)

    def _imply_intent(self, step: LossStep, samples: int) -> None:
        """Megatron's default (``calculate_per_token_loss`` off) averages each micro-batch
        over its own tokens: with one sample per micro-batch that is per-sample weighting,
        Megatron's intent, so the step reads as declared ``normalization="sample"``; a
        step with a micro-batch of several samples is a mean of means and reads as such."""
        if not self._per_sample:
            return
        if samples > 1:
            step.several = True
        step.normalization = None if step.several else "sample"

    def _imply_tracked_intent(self, monitor: MonitorView, step: LossStep, samples: int) -> None:
        """``track_loss`` without a declared normalization on Megatron's default loss reads
        the intent the zero-code path reads (:meth:`_imply_intent`): per-sample weighting on
        steps whose micro-batches each hold one sample (a per-token loss [1, S]), a mean of
        means otherwise. ``attach(loss_normalization=...)`` overrides it."""
        if self._megatron_default is None:
            self._megatron_default = _megatron_per_sample(monitor.model)
        if self._megatron_default and monitor.config.loss_normalization is None:
            self._per_sample = True  # track_loss and the zero-code seams never run together
            self._imply_intent(step, samples)

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
            self._weights(step, slot, batch, flat)
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
        bounds, self._bounds = self._bounds, None
        if segments is None and bounds is not None:  # packed rows: the samples read in the forward
            found = bounds.segments
            if found is not None and found.dim() == 2 and found.shape[0] == rows and found.shape[1] in (cols, cols + 1):
                segments = found
            else:
                step.withheld = step.withheld or packed_segments(bounds, (rows, cols))[1]
        if segments is not None and tuple(segments.shape) != shape and segments.dim() == 2:
            segments = segments[:, -cols:]  # labels shifted by one: the fused head scores positions 1..T-1
        if modality is not None and isinstance(modality, torch.Tensor) and modality.dim() == 2:
            if tuple(modality.shape) != shape:
                modality = modality[:, -cols:]
        codes = self._codes(monitor, modality, log_probs.detach(), rows, cols)
        if isinstance(codes, torch.Tensor) and codes.dim() == 2 and codes.shape[1] == cols + 1:
            codes = codes[:, -cols:]  # per-token codes read from the input ids: positions 1..T-1
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
            step.sums[layout.not_ce].add_(signed(w))
            inv = self._inv_scale(monitor, grad.device, fdt)
            if inv is not None:
                w = w * inv
            self._weights(step, slot, batch, w)

        log_probs.register_hook(self._hook("the fused head's log-prob hook", weights))

    def _logits_hook(
        self,
        monitor: MonitorView,
        step: LossStep,
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
            assert step.sums is not None and step.output is not None
            if is_dtensor(grad):  # DTensor logits: this rank's piece, placed as the logits were
                if vocab_split(grad, self._shards) is not (seam.shards is not None):
                    placed = tuple(getattr(grad, "placements", ()))
                    step.layout = f"the gradient at the output of {self._head!r} is placed {placed}"
                    return
                grad = local(grad)
            fdt = step.sums.dtype
            vocab = grad.shape[-1]
            g = (grad.detach().transpose(0, 1) if seq_first else grad.detach()).reshape(-1, vocab)
            if seam.per_token:
                self._check_per_token(step, seam, g)
                return
            step.fired += 1
            if self._vocab_group is not None:  # a shard's gradient alone gives no token's weight
                step.layout = (
                    f"the output of {self._head!r} is a vocabulary shard (Megatron tensor parallel) and the "
                    "model returned no per-token losses: call the model with labels, or Monitor.track_loss"
                )
                return
            if logits._version != version:
                step.sums[layout.overwritten].add_(1.0)
                return
            z = logits.reshape(-1, vocab)
            norms = g
            if seam.shards is not None:  # a vocabulary shard: each position's extremes over the group's
                rec, residual, scale, norms = recover_shards(
                    g,
                    z,
                    seam.shards,
                    fdt,
                    cap=config.logits_max_positions,
                    period=cols,
                    chunk_bytes=config.softmax_chunk_bytes,
                )
            else:
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
            self._weights(step, slot, batch, w, uniform_tolerance(grad.dtype, UNIFORM_RTOL))
            if m:
                step.outputs += 1
                self._outputs(step, batch, norms, 1, inv)

        return self._hook("the logits hook", weights)

    def _check_per_token(self, step: LossStep, seam: _Seam, g: torch.Tensor) -> None:
        """The weights came from the model's per-token loss output; the logits' gradient
        [N, V] must be their cross-entropy's: ``||g_t||_1 = 2 w_t (1 - p_{t,y})`` with
        ``p_{t,y} = exp(-l_t)``, and zero off the label tokens. Needs no logits values
        (they may have been overwritten in place)."""
        layout = self._layout
        assert layout is not None and step.sums is not None and step.output is not None
        if seam.weight is None or seam.loss is None:
            return  # the per-token loss got no gradient: nothing was read
        fdt = step.sums.dtype
        if self._vocab_group is not None:  # a vocabulary shard: each token's sums over the group's shards
            l1, g = _over_shards(g, self._vocab_group, fdt)
        else:
            l1 = g.abs().sum(dim=1, dtype=torch.float32).to(fdt)
        expected = 2 * seam.weight * -torch.expm1(-seam.loss)
        residual = (l1 - expected).abs().sum()
        bad = (residual > l1.sum() * residual_tolerance(g.dtype)) | (signed(seam.weight) > 0)
        step.sums[layout.not_ce].add_(bad.to(fdt))
        if seam.batch is not None and layout.bins > 1:
            step.outputs += 1
            self._outputs(step, seam.batch, g, 1, seam.inv)


def _over_shards(g: torch.Tensor, group: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's L1 norm of the logits' gradient over the whole vocabulary, from the
    shards of the tensor-parallel ``group`` (one all-reduce of [N, 2] per micro-batch on
    report steps, as Megatron's own vocab-parallel cross entropy does three), and its L2
    norm as a [N, 1] stand-in for the gradient (the per-modality output-gradient norms)."""
    import torch.distributed as dist

    failure: Exception | None = None
    try:
        sums = torch.stack([g.abs().sum(dim=1, dtype=torch.float32), g.square().sum(dim=1, dtype=torch.float32)], 1)
    except Exception as exc:  # noqa: BLE001 - the other shards wait in the all-reduce: join it, then raise
        failure, sums = exc, torch.zeros(g.shape[0], 2, dtype=torch.float32, device=g.device)
    dist.all_reduce(sums, group=group)
    if failure is not None:
        raise failure
    return sums[:, 0].to(dtype), sums[:, 1:].sqrt()


def signed(weights: torch.Tensor) -> torch.Tensor:
    """1 (in ``weights``' dtype, on their device, no host sync) when any per-token weight is
    negative, else 0. A cross-entropy's weights are >= 0: a negative one is a signed
    objective (a policy gradient's advantages, a preference or distillation term) whose
    "weights" are not a cross-entropy's, so the micro-batch counts as not cross-entropy.
    Below minus the dtype's smallest normal number: a denormal is rounding, not a sign."""
    if weights.numel() == 0:
        return weights.new_zeros(())
    # the smallest weight against the bound: cheaper than a comparison per token, then any()
    return (weights.amin() < -torch.finfo(weights.dtype).tiny).to(weights.dtype)


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
