"""The arithmetic of loss accounting: samples, modality bins and the per-step sums.

Pure tensor functions; no monitor, no state, no host sync. The
signal (:mod:`~trainvitals.hooks.signals.loss.signal`) calls :func:`bin_batch`
in ``track_loss`` (before the backward) and :func:`weight_rows` /
:func:`output_norms` from its tensor hooks (during the backward), then
:func:`weight_finish` / :func:`output_finish` on what they return. Everything a step
gathers lands in one float vector laid out by
:class:`~trainvitals.hooks.signals.loss.layout.SumsLayout` (re-exported here), so the
step costs one cross-rank sum and rides in the report's single host copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainvitals.hooks.signals.loss.layout import LABELLED_POSITION, SumsLayout

__all__ = [
    "LABELLED_POSITION",
    "UNIFORM_RTOL",
    "Batch",
    "SumsLayout",
    "bin_batch",
    "output_finish",
    "output_norms",
    "packed_sample_ids",
    "weight_finish",
    "weight_rows",
]

UNIFORM_RTOL = 1e-3
"""Token weights of a micro-batch within this relative spread count as uniform
(per-token normalized): float rounding of 1/n stays far below it."""


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
    """One micro-batch, binned: what its hooks need during the backward. Samples are
    either the rows (``rows_as_samples``: no segments, one code per row; every
    per-sample sum is a row sum, the per-bin sums one ``index_add_``), or
    numbered per token (``sid``)."""

    lab: torch.Tensor | None  # [N] bool: label tokens ([R, C] rows as samples; None: every token, rows only)
    sid: torch.Tensor | None  # [N] sample id per token (None: rows as samples)
    n_samples: int
    has: torch.Tensor  # [S] bool: the sample has label tokens
    s_bin: torch.Tensor  # [S] modality bin per sample
    tok_bin: torch.Tensor | None  # [N] modality bin per token (its sample's); None: rows as samples
    # [5, S] SumsLayout.fit_rows of log(label tokens per sample); None: made from log_n
    # when needed (a step that keeps its results for the report never needs it)
    fit_rows: torch.Tensor | None
    log_n: torch.Tensor  # [S] that log
    fdt: torch.dtype
    probe_masks: torch.Tensor | None = None  # [M, N] label tokens per modality (probe steps)
    rows_as_samples: bool = False  # binned by bin_rows (each row one sample, one code)
    shape: tuple[int, int] = (0, 0)  # [rows, cols] of the micro-batch
    # [R] each row's loss over its label tokens (rows as samples); read at once by the
    # caller: without a mask it is a row of a kept buffer the next micro-batch writes
    row_loss: torch.Tensor | None = None

    def fit(self, layout: SumsLayout) -> torch.Tensor:
        """``fit_rows``, made from ``log_n`` the first time it is asked for."""
        if self.fit_rows is None:
            self.fit_rows = layout.fit_rows(self.log_n)
        return self.fit_rows


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
    if seg is None and (isinstance(codes, int) or codes.dim() == 1):
        return _bin_rows(layout, sums, loss, label, codes, probe=probe, count_unknown=count_unknown)
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
    sums.index_add_(
        0,
        layout.prepared_targets(dev),
        torch.cat(
            [
                zeros.index_add(0, s_bin, has.to(fdt)),
                zeros.index_add(0, s_bin, n_s),
                zeros.index_add(0, s_bin, n_s.sqrt()),
                zeros.index_add(0, tok_bin, loss_lab),
                zeros.index_add(0, pos_code, torch.where(has, -LABELLED_POSITION, 1.0).to(fdt)[sid]),
                mixed.to(fdt).reshape(1),
                unknown.to(fdt).reshape(1),
            ]
        ),
    )
    log_n = torch.log(n_s.clamp_min(1.0))
    batch = Batch(
        lab=lab,
        sid=sid,
        n_samples=n_samples,
        has=has,
        s_bin=s_bin,
        tok_bin=tok_bin,
        fit_rows=None,
        log_n=log_n,
        fdt=fdt,
        shape=(rows, cols),
    )
    if probe:
        mods = torch.arange(m, device=dev)[:, None]
        batch.probe_masks = ((tok_bin[None, :] == mods) & lab[None, :]).to(loss.dtype)
    return batch


def _bin_rows(
    layout: SumsLayout,
    sums: torch.Tensor,
    loss: torch.Tensor,
    label: torch.Tensor | None,
    codes: Any,
    *,
    probe: bool,
    count_unknown: bool,
) -> Batch:
    """``bin_batch`` when every row is one sample with one code: per-row sums, then
    every per-bin sum at once, ``features [6, R]`` added into the sums with one
    accumulating ``index_put_`` at targets gathered by the rows' bins
    (``SumsLayout.bin_targets``: the sixth feature, the tokens again, is the unknown
    count). A row without label tokens adds 0 to every feature but its positions, so it
    is binned by its code here (its positions count there) and moved to the overflow
    bin only for the hooks (``s_bin``). Without a mask every row has ``cols`` label
    tokens: those features are constants made once per shape."""
    m = layout.bins - 1
    rows, cols = loss.shape
    dev, fdt = loss.device, sums.dtype
    c = layout.row_constants(rows, cols, fdt, dev, count_unknown)
    if label is None:  # the features are constants but for the row losses, summed into them
        n_s = c.positions
        loss_s = torch.sum(loss, 1, dtype=fdt, out=c.loss_row)
        features = c.features
    else:
        n_s = label.sum(1, dtype=fdt)
        one, root = n_s.clamp(max=1.0), n_s.sqrt()
        loss_s = torch.where(label, loss, layout.constant(0.0, loss.dtype, dev)).sum(1, dtype=fdt)
        spots = torch.where(n_s > 0, layout.constant(-LABELLED_POSITION, fdt, dev), 1.0) * c.positions
        features = torch.stack([one, n_s, root, loss_s, spots, n_s])
    if isinstance(codes, int):
        binned = torch.full((rows,), codes if 0 <= codes < m else m, dtype=torch.long, device=dev)
    else:
        binned = codes.long().clamp(-1, m).remainder_(m + 1)  # outside 0..m-1: the overflow bin m
    # Each row's features added at its bin's entries: no one-hot product, so a
    # non-finite loss in one row cannot turn another bin's sums into NaN (inf * 0).
    sums.index_put_((c.targets.index_select(1, binned),), features, accumulate=True)  # targets [6, R]
    if label is None:  # every row has label tokens
        has, s_bin, fit_rows, log_n = c.has, binned, c.fit_rows, c.log_n
    else:
        has = n_s > 0
        s_bin = torch.where(has, binned, layout.constant(m, torch.long, dev))
        log_n = torch.log(n_s.clamp_min(1.0))
        fit_rows = None
    batch = Batch(
        lab=label,
        sid=None,
        n_samples=rows,
        has=has,
        s_bin=s_bin,
        tok_bin=None,
        fit_rows=fit_rows,
        log_n=log_n,
        fdt=fdt,
        rows_as_samples=True,
        shape=(rows, cols),
        row_loss=loss_s,
    )
    if probe:
        lab = label.reshape(-1) if label is not None else torch.ones(rows * cols, dtype=torch.bool, device=dev)
        mods = torch.arange(m, device=dev)[:, None]
        tok_bin = s_bin.repeat_interleave(cols)
        batch.probe_masks = ((tok_bin[None, :] == mods) & lab[None, :]).to(loss.dtype)
    return batch


def weight_rows(
    layout: SumsLayout, b: Batch, w: torch.Tensor, *, per_row: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The token weights ``w`` (``dL/dl``, unscaled; [N], or [R, C] rows as samples)
    of one micro-batch of one objective, reduced over its tokens: the weight per sample
    ``w_s`` [S] (in ``b.fdt``), and the extremes over label tokens, ``[largest,
    smallest]`` (two 0-d tensors in ``w``'s float) without a mask, ``[[largest,
    -smallest]]`` with one. ``per_row``: without a mask, the extremes of each row ([R]
    each, one op and no reshape: what is kept for the report, which takes their
    extremes). :func:`weight_finish` makes the sums from them, on the training thread
    or, for a step that keeps its results (:mod:`~trainvitals.hooks.signals.loss.deferred`),
    on the sender thread."""
    fdt, dev = b.fdt, w.device
    lab = b.lab
    if b.sid is None:  # rows as samples: the row sums widen as they add (no widened copy of w)
        if tuple(w.shape) != b.shape:
            w = w.reshape(b.shape)
        w_s = (w if lab is None else torch.where(lab, w, layout.constant(0.0, w.dtype, dev))).sum(1, dtype=fdt)
    else:
        assert lab is not None
        if w.dim() != 1:
            w = w.reshape(-1)
        w = w.to(fdt)
        zero = layout.constant(0.0, fdt, dev)
        w_s = torch.index_add(layout.constant_rows(b.n_samples, 0.0, fdt, dev), 0, b.sid, torch.where(lab, w, zero))
    if lab is None:
        # w's own extremes; weight_finish compares them in the wider float
        wmin, wmax = torch.aminmax(w, dim=1) if per_row else torch.aminmax(w)
        return w_s, [wmax, wmin]
    # the largest weight and the largest negated one, over label tokens, at once
    dims = tuple(range(1, w.dim() + 1))
    both = torch.where(lab, w * layout.label_signs(w.dim(), fdt, dev), layout.constant(float("-inf"), fdt, dev))
    return w_s, [both.amax(dims)]


def weight_finish(
    layout: SumsLayout,
    w_s: torch.Tensor,
    top: list[torch.Tensor],
    fit_rows: torch.Tensor,
    s_bin: torch.Tensor,
    rows_as_samples: bool,
    rtol: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From :func:`weight_rows`' results and the batch's samples (``fit_rows`` [5, S],
    ``SumsLayout.fit_rows``; ``s_bin`` [S]): ``[bins + 7]`` to add at
    ``layout.weight_targets(slot)`` (the weight per bin, the exponent fit's sufficient
    statistics, the weight mass), then ``[3]`` to combine by maximum at
    ``layout.extreme_targets(slot)``: the largest label-token weight, minus the
    smallest, and whether the token weights are non-uniform beyond ``rtol`` (weights
    read from a bfloat16 gradient need more than float rounding). The flag is read only
    where every micro-batch's weights are positive and finite (else the step's extremes
    leave the spread out): there, non-uniform is ``largest > smallest * (1 + rtol)``."""
    fdt, dev = w_s.dtype, w_s.device
    zero = layout.constant(0.0, fdt, dev)
    with_y, signs = layout.with_log_weight(fdt, dev)
    # Token-weight extremes and uniformity within the micro-batch (I3).
    if len(top) == 2:
        # the product with 1 + rtol, a 0-d tensor of it, is taken in the wider float
        # (a Python number would keep w's float)
        wmax, wmin = top
        if wmax.dim():  # per row: their extremes are the micro-batch's, exactly
            wmax, wmin = wmax.max(), wmin.min()
        extremes = torch.stack([wmax, wmin, wmax > wmin * layout.constant(1 + rtol, fdt, dev)]) * signs
    else:
        wmax, negmin = top[0].unbind()
        extremes = torch.stack([wmax, negmin, wmax > negmin * -(1 + rtol)])  # -smallest * -c: smallest * c, exactly
    # Exponent fit: sufficient statistics over samples with positive weight, per sample
    # [1, x, 1, x * x, x] * [1, 1, y, 1, y] where w_s > 0, else 0. A sample without
    # label tokens has w_s = 0 (a sum of masked zeros): its weights are never kept.
    ok = w_s > 0
    y = torch.where(with_y, w_s.log(), layout.constant(1.0, fdt, dev))  # log of w_s <= 0 is never kept
    fit = torch.where(ok, fit_rows * y, zero).sum(1)
    # [bins + 1]: the extra entry goes to scratch. Added by bin, never a one-hot
    # product: a non-finite weight stays in its own bin (inf * 0 would be NaN in all).
    per_bin = torch.index_add(layout.constant_rows(layout.bins + 1, 0.0, fdt, dev), 0, s_bin, w_s)
    mass = (w_s if rows_as_samples else per_bin).sum(0, keepdim=True)
    return torch.cat([per_bin, fit, mass]), extremes


def output_norms(grad: torch.Tensor, lead_dims: int) -> torch.Tensor:
    """The output gradient's norm per token (float32): one fused reduction over the
    feature dims, no [B, T, V] temporary; :func:`output_finish` squares them and adds
    them per modality bin."""
    g = grad.detach() if grad.requires_grad else grad
    dims = tuple(range(lead_dims, g.dim()))
    return torch.linalg.vector_norm(g, dim=dims, dtype=torch.float32) if dims else g.float().abs()


def output_finish(
    into: torch.Tensor,
    norms: torch.Tensor,
    bins: torch.Tensor,
    rows: tuple[int, int] | None,
    inv_scale: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`output_norms`' per-token norms squared (unscaled by ``inv_scale``), summed
    per row first when ``rows`` (rows as samples; ``bins`` is then per row, else per
    token), added into ``into`` ([bins], the step's output sums) in place at ``bins``:
    a non-finite norm stays in its own bin."""
    sq = norms.to(into.dtype).square()
    if inv_scale is not None:
        sq = sq * (inv_scale * inv_scale)
    if rows is not None:  # rows as samples: per row, then per bin
        per_row = (sq if tuple(sq.shape) == rows else sq.reshape(rows)).sum(1)
        return into.index_add_(0, bins, per_row)
    return into.index_add_(0, bins, sq.reshape(-1))
