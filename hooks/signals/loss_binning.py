"""The arithmetic of loss accounting: samples, modality bins and the per-step sums.

Pure tensor functions and one layout; no monitor, no state, no host sync. The
signal (:mod:`~trainvitals.hooks.signals.loss_accounting`) calls :func:`bin_batch`
in ``track_loss`` (before the backward) and :func:`weight_sums` /
:func:`output_sums` from its tensor hooks (during the backward). Everything a step
gathers lands in one float vector laid out by :class:`SumsLayout`, so the step
costs one cross-rank sum and rides in the report's single host copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["UNIFORM_RTOL", "Batch", "SumsLayout", "bin_batch", "output_sums", "packed_sample_ids", "weight_sums"]

UNIFORM_RTOL = 1e-3
"""Token weights of a micro-batch within this relative spread count as uniform
(per-token normalized): float rounding of 1/n stays far below it."""


class SumsLayout:
    """Offsets into the per-step sums vector. Grouped by who writes them, so each
    writer adds one contiguous block."""

    def __init__(self, modalities: int, objectives: int):
        b = modalities + 1  # the last bin holds codes outside the declared modalities
        self.bins = b
        self.objectives = objectives
        # written in track_loss (before the backward): per bin, samples with label
        # tokens, label tokens, the sum of sqrt(label tokens) over samples, the loss over
        # label tokens, and positions (label or not) carrying the bin's code
        self.samples = slice(0, b)
        self.tokens = slice(b, 2 * b)
        self.sqrt_tokens = slice(2 * b, 3 * b)
        self.loss = slice(3 * b, 4 * b)
        self.positions = slice(4 * b, 5 * b)
        self.mixed = 5 * b
        self.unknown = 5 * b + 1
        self.prepared = slice(0, 5 * b + 2)
        # written by the per-token loss hook: weight per bin and the exponent fit's
        # count, sum x, sum y, sum xx, sum xy (x = log n_s, y = log w_s), over every
        # objective; then per objective its weight mass and its micro-batches whose
        # token weights are not uniform
        w0 = 5 * b + 2
        self.weight = slice(w0, w0 + b)
        self.fit = slice(w0 + b, w0 + b + 5)
        self.common = slice(w0, w0 + b + 5)
        o0 = w0 + b + 5
        self.mass = slice(o0, o0 + objectives)
        self.nonuniform = slice(o0 + objectives, o0 + 2 * objectives)
        # written by the output hook
        self.output = slice(o0 + 2 * objectives, o0 + 2 * objectives + b)
        # zero-code accounting: micro-batches whose logits gradient is not a plain
        # cross-entropy one (their weights cannot be read from it)
        self.not_ce = o0 + 2 * objectives + b
        # zero-code accounting: micro-batches whose logits were overwritten in place
        # before the backward (Megatron's fused cross-entropy on float32 logits)
        self.overwritten = self.not_ce + 1
        self.nonfinite = self.overwritten + 1  # the cumulative counter rides along in reports
        self.size = self.nonfinite + 1


def packed_sample_ids(segments: torch.Tensor) -> torch.Tensor:
    """Sample id per token of packed rows [R, C]: one id per distinct (row, segment id),
    numbered from 0, flattened. A sort per row, so ids need no range and no host sync."""
    rows, cols = segments.shape
    ordered, order = torch.sort(segments, dim=1, stable=True)
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    ids = new.reshape(-1).cumsum(0).sub_(1).view(rows, cols)
    return torch.empty_like(ids).scatter_(1, order, ids).reshape(-1)


@dataclass
class Batch:
    """One micro-batch, binned: what its hooks need during the backward."""

    lab: torch.Tensor  # [N] bool: label tokens
    sid: torch.Tensor  # [N] sample id per token
    n_samples: int
    has: torch.Tensor  # [S] bool: the sample has label tokens
    s_bin: torch.Tensor  # [S] modality bin per sample
    tok_bin: torch.Tensor  # [N] modality bin per token (its sample's)
    log_n: torch.Tensor  # [S] log of label tokens per sample
    fdt: torch.dtype
    probe_masks: torch.Tensor | None = None  # [M, N] label tokens per modality (probe steps)


def bin_batch(
    layout: SumsLayout,
    sums: torch.Tensor,
    loss: torch.Tensor,
    label: torch.Tensor | None,
    seg: torch.Tensor | None,
    codes: Any,
    *,
    probe: bool,
    count_unknown: bool = True,
) -> Batch:
    """Samples and modality bins of one micro-batch ``loss`` [R, C]; adds its sample,
    token and loss sums (and the mixed / unknown counts) into ``sums``. With
    ``count_unknown=False`` codes outside the declared modalities are not counted as
    unknown (untagged zero-code micro-batches: they count toward the totals only)."""
    m = layout.bins - 1
    rows, cols = loss.shape
    dev = loss.device
    fdt = sums.dtype
    lab = (label if label is not None else torch.ones_like(loss, dtype=torch.bool)).reshape(-1)
    labf = lab.to(fdt)

    # Sample ids per token, in [0, n_samples).
    if seg is None:
        n_samples = rows
        sid = torch.arange(rows, device=dev).repeat_interleave(cols)
    else:
        n_samples = rows * cols
        sid = packed_sample_ids(seg)
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
        # A sample's modality: the highest declared code on any of its positions (a VLM's
        # image code marks its image *input* positions, never its label tokens).
        anywhere = torch.full((n_samples,), -1, dtype=torch.long, device=dev).scatter_reduce_(
            0, sid, torch.where(tok_code < m, tok_code, -1), reduce="amax"
        )
        # Mixed: label tokens carrying different codes.
        hi = torch.full((n_samples,), -1, dtype=torch.long, device=dev).scatter_reduce_(
            0, sid, torch.where(lab, tok_code, -1), reduce="amax"
        )
        lo = torch.full((n_samples,), m + 1, dtype=torch.long, device=dev).scatter_reduce_(
            0, sid, torch.where(lab, tok_code, m + 1), reduce="amin"
        )
        s_bin = torch.where(anywhere >= 0, anywhere, m)
        mixed = (has & (hi != lo)).sum().to(fdt)
        unknown = (lab & (tok_code == m)).sum().to(fdt)
    if not count_unknown:
        unknown = torch.zeros((), dtype=fdt, device=dev)
    s_bin = torch.where(has, s_bin, m)
    tok_bin = s_bin[sid]
    # Every position's code, label token or not: a declared modality that marks positions
    # but never label tokens would otherwise vanish from the shares without a word.
    pos_code = binned.reshape(-1) if codes.dim() == 2 else binned.repeat_interleave(cols)

    zeros = torch.zeros(layout.bins, dtype=fdt, device=dev)
    loss_lab = torch.where(lab, loss.reshape(-1).to(fdt), 0.0)
    sums[layout.prepared].add_(
        torch.cat(
            [
                zeros.index_add(0, s_bin, has.to(fdt)),
                zeros.index_add(0, s_bin, n_s),
                zeros.index_add(0, s_bin, n_s.sqrt()),
                zeros.index_add(0, tok_bin, loss_lab),
                zeros.index_add(0, pos_code, torch.ones_like(pos_code, dtype=fdt)),
                mixed.to(fdt).reshape(1),
                unknown.to(fdt).reshape(1),
            ]
        )
    )
    batch = Batch(
        lab=lab,
        sid=sid,
        n_samples=n_samples,
        has=has,
        s_bin=s_bin,
        tok_bin=tok_bin,
        log_n=torch.log(n_s.clamp_min(1.0)),
        fdt=fdt,
    )
    if probe:
        mods = torch.arange(m, device=dev)[:, None]
        batch.probe_masks = ((tok_bin[None, :] == mods) & lab[None, :]).to(loss.dtype)
    return batch


def weight_sums(
    layout: SumsLayout, b: Batch, w: torch.Tensor, rtol: float = UNIFORM_RTOL
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the token weights ``w`` [N] (``dL/dl``, unscaled) of one micro-batch of one
    objective: its common block of the sums (weight per bin, the exponent fit's
    sufficient statistics), its weight mass, whether its token weights are
    non-uniform (beyond ``rtol``: weights read from a bfloat16 gradient need more
    than float rounding), and its largest and smallest label-token weight."""
    fdt, dev = b.fdt, w.device
    lab = b.lab
    w = torch.where(lab, w, 0.0)
    w_s = torch.zeros(b.n_samples, dtype=fdt, device=dev).index_add_(0, b.sid, w)
    # Exponent fit: sufficient statistics over samples with positive weight.
    ok = b.has & (w_s > 0)
    x = torch.where(ok, b.log_n, 0.0)
    y = torch.where(ok, torch.log(torch.where(ok, w_s, 1.0)), 0.0)
    # Token-weight uniformity within the micro-batch, and its extremes (I3).
    wmax = torch.where(lab, w, float("-inf")).amax().reshape(1)
    wmin = torch.where(lab, w, float("inf")).amin().reshape(1)
    uniform = (wmin > 0) & (wmax <= wmin * (1 + rtol))
    per_bin = torch.zeros(layout.bins, dtype=fdt, device=dev).index_add_(0, b.s_bin, w_s)
    block = torch.cat([per_bin, torch.stack([ok.to(fdt), x, y, x * x, x * y]).sum(1)])
    return block, per_bin.sum(), (torch.isfinite(wmin) & ~uniform).to(fdt).reshape(()), wmax, wmin


def output_sums(
    layout: SumsLayout, b: Batch, grad: torch.Tensor, lead_dims: int, inv_scale: torch.Tensor | None
) -> torch.Tensor:
    """Squared per-token norms of the output gradient, summed per modality bin."""
    g = grad.detach()
    dims = tuple(range(lead_dims, g.dim()))
    # One fused reduction over the feature dims: no [B, T, V] temporary.
    sq = (
        (torch.linalg.vector_norm(g, dim=dims, dtype=torch.float32) if dims else g.float().abs())
        .reshape(-1)
        .to(b.fdt)
        .square()
    )
    if inv_scale is not None:
        sq = sq * (inv_scale * inv_scale)
    return torch.zeros(layout.bins, dtype=b.fdt, device=sq.device).index_add_(0, b.tok_bin, sq)
