"""The arithmetic of loss accounting: samples, modality bins and the per-step sums.

Pure tensor functions and one layout; no monitor, no state, no host sync. The
signal (:mod:`~trainvitals.hooks.signals.loss.signal`) calls :func:`bin_batch`
in ``track_loss`` (before the backward) and :func:`weight_rows` /
:func:`output_norms` from its tensor hooks (during the backward), then
:func:`weight_finish` / :func:`output_finish` on what they return. Everything a step
gathers lands in one float vector laid out by :class:`SumsLayout`, so the step
costs one cross-rank sum and rides in the report's single host copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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

LABELLED_POSITION = float(2**24)
"""What a position counts for in the per-bin positions row when its sample has label
tokens (a position of a sample without any counts 1): one such position outweighs
every position of samples without label tokens a step can hold, so the row is > 0
exactly when the code marks positions of label-less samples only."""

UNIFORM_RTOL = 1e-3
"""Token weights of a micro-batch within this relative spread count as uniform
(per-token normalized): float rounding of 1/n stays far below it."""


@dataclass(frozen=True)
class RowConstants:
    """Per micro-batch shape, the tensors binning rows reuses (never written, but for
    ``features``' loss row, written and read within one ``bin_batch`` call)."""

    positions: torch.Tensor  # [R] cols: positions per row (label tokens without a mask)
    one: torch.Tensor  # [R] 1.0
    root: torch.Tensor  # [R] sqrt(cols)
    has: torch.Tensor  # [R] True
    fit_rows: torch.Tensor  # [5, R] SumsLayout.fit_rows of log(cols)
    log_n: torch.Tensor  # [R] log(cols): fit_rows' second row, its own tensor
    targets: torch.Tensor  # [6, bins] SumsLayout.bin_targets
    # [6, R] the per-row features without a mask: [1, cols, sqrt(cols), loss, cols, cols],
    # the loss row (a view, ``loss_row``) written by each call: no stack per micro-batch
    features: torch.Tensor
    loss_row: torch.Tensor


class SumsLayout:
    """Offsets into the per-step sums vector. Each writer adds its entries with one
    op (an ``index_add_`` at targets made once, or an ``add_`` into a block)."""

    def __init__(self, modalities: int, objectives: int):
        b = modalities + 1  # the last bin holds codes outside the declared modalities
        self.bins = b
        self.objectives = objectives
        # per bin, in this order so that the five rows a report totals over bins
        # (samples, tokens, sqrt tokens, loss, weight) lie end to end: written in
        # track_loss (before the backward), samples with label tokens, label tokens,
        # the sum of sqrt(label tokens) over samples, the loss over label tokens; by
        # the per-token loss hook, the weight; in track_loss again, positions (label
        # or not) carrying the bin's code: +1 each in a sample without label tokens,
        # -LABELLED_POSITION in a sample with some (> 0 only when every position of the
        # code lies in samples without label tokens: then, and only then, none of the
        # modality's samples carries loss)
        self.samples = slice(0, b)
        self.tokens = slice(b, 2 * b)
        self.sqrt_tokens = slice(2 * b, 3 * b)
        self.loss = slice(3 * b, 4 * b)
        self.weight = slice(4 * b, 5 * b)
        self.positions = slice(5 * b, 6 * b)
        self.mixed = 6 * b
        self.unknown = 6 * b + 1
        # written by the per-token loss hook too: the exponent fit's count, sum x,
        # sum y, sum xx, sum xy (x = log n_s, y = log w_s), over every objective; then
        # per objective its weight mass
        w0 = 6 * b + 2
        self.fit = slice(w0, w0 + 5)
        o0 = w0 + 5
        self.mass = slice(o0, o0 + objectives)
        # written by the output hook
        self.output = slice(o0 + objectives, o0 + objectives + b)
        # zero-code accounting: micro-batches whose logits gradient is not a plain
        # cross-entropy one (their weights cannot be read from it)
        self.not_ce = o0 + objectives + b
        # zero-code accounting: micro-batches whose logits were overwritten in place
        # before the backward (Megatron's fused cross-entropy on float32 logits)
        self.overwritten = self.not_ce + 1
        self.nonfinite = self.overwritten + 1  # the cumulative counter rides along in reports
        # absorbs what the per-row binning adds outside the layout (never read)
        self.scratch = self.nonfinite + 1
        self.size = self.scratch + 1
        # beside the sums, combined across ranks by their maximum: per objective its
        # largest label-token weight, minus its smallest, and whether a micro-batch's
        # token weights were not uniform
        self.wmax = slice(0, objectives)
        self.negmin = slice(objectives, 2 * objectives)
        self.nonuniform = slice(2 * objectives, 3 * objectives)
        self.extremes = 3 * objectives
        self._tensors: dict[tuple[Any, ...], torch.Tensor] = {}
        self._row_constants: dict[tuple[Any, ...], RowConstants] = {}

    def bin_targets(self, device: torch.device, count_unknown: bool) -> torch.Tensor:
        """``[6, bins]`` where a row of bin ``b`` adds each of its six features (samples,
        tokens, sqrt tokens, loss, positions; then its tokens again): the per-bin rows at
        ``b``, the last to ``unknown`` for the overflow bin when it counts as unknown,
        else to ``scratch``."""
        key = ("targets", device, count_unknown)
        if key not in self._tensors:
            b = self.bins
            rows = [self.samples, self.tokens, self.sqrt_tokens, self.loss, self.positions]
            table = [list(range(row.start, row.start + b)) for row in rows]
            table.append([self.scratch] * (b - 1) + [self.unknown if count_unknown else self.scratch])
            self._tensors[key] = torch.tensor(table).to(device)
        return self._tensors[key]

    def prepared_targets(self, device: torch.device) -> torch.Tensor:
        """Where ``bin_batch``'s block goes: per bin its samples, tokens, sqrt tokens,
        loss and positions, then the mixed and unknown counts."""
        key = ("prepared", device)
        if key not in self._tensors:
            rows = [self.samples, self.tokens, self.sqrt_tokens, self.loss, self.positions]
            targets = [i for row in rows for i in range(row.start, row.stop)] + [self.mixed, self.unknown]
            self._tensors[key] = torch.tensor(targets).to(device)
        return self._tensors[key]

    def weight_targets(self, slot: int, device: torch.device) -> torch.Tensor:
        """Where ``weight_finish``'s weight per bin (and scratch), fit and mass of objective ``slot`` go."""
        key = ("weights", slot, device)
        if key not in self._tensors:
            weight = list(range(self.weight.start, self.weight.stop))
            fit = list(range(self.fit.start, self.fit.stop))
            self._tensors[key] = torch.tensor([*weight, self.scratch, *fit, self.mass.start + slot]).to(device)
        return self._tensors[key]

    def extreme_targets(self, slot: int, device: torch.device) -> torch.Tensor:
        """Where ``weight_finish``'s extremes of objective ``slot`` go in the extremes vector."""
        key = ("extremes", slot, device)
        if key not in self._tensors:
            targets = [self.wmax.start + slot, self.negmin.start + slot, self.nonuniform.start + slot]
            self._tensors[key] = torch.tensor(targets).to(device)
        return self._tensors[key]

    def fit_rows(self, log_n: torch.Tensor) -> torch.Tensor:
        """``[5, S]``: per sample ``[1, x, 1, x * x, x]`` (x = log n_s), what the exponent
        fit's five sums (n, sx, sy, sxx, sxy) multiply by ``[1, 1, y, 1, y]`` (y = log w_s)."""
        one = self.constant_rows(log_n.shape[0], 1.0, log_n.dtype, log_n.device)
        return torch.stack([one, log_n, one, log_n * log_n, log_n])

    def constant_fit_rows(
        self, rows: int, cols: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``fit_rows`` of ``rows`` samples of ``cols`` label tokens each, and its log
        of the label tokens (made once per shape)."""
        key = ("fit rows", rows, cols, dtype, device)
        if key not in self._tensors:
            n = torch.full((rows,), float(max(cols, 1)), dtype=dtype, device=device)
            log_n = torch.log(n)
            fit_rows = self._tensors[key] = self.fit_rows(log_n)
            self._tensors[("log n", rows, cols, dtype, device)] = log_n
            return fit_rows, log_n
        return self._tensors[key], self._tensors[("log n", rows, cols, dtype, device)]

    def with_log_weight(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``[5, 1]`` true on the fit's rows that take y, and the signs ``[1, -1, 1]`` of
        the extremes (the smallest weight travels negated: one maximum combines all)."""
        key = ("log weight", dtype, device)
        if key not in self._tensors:
            self._tensors[key] = torch.tensor([[False], [False], [True], [False], [True]]).to(device)
            self._tensors[("signs", dtype, device)] = torch.tensor([1.0, -1.0, 1.0], dtype=dtype).to(device)
        return self._tensors[key], self._tensors[("signs", dtype, device)]

    def label_signs(self, dims: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[2, 1, ...]`` (``dims`` ones) holding 1 and -1: weights and their negation at once."""
        key = ("label signs", dims, dtype, device)
        if key not in self._tensors:
            self._tensors[key] = torch.tensor([1.0, -1.0], dtype=dtype).reshape(2, *[1] * dims).to(device)
        return self._tensors[key]

    def constant_rows(self, rows: int, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[rows]`` filled with ``value`` (made once per shape; never written)."""
        key = ("rows", rows, value, dtype, device)
        if key not in self._tensors:
            if len(self._tensors) > 256:  # micro-batch shapes changed many times: start over
                self._tensors.clear()
            self._tensors[key] = torch.full((rows,), value, dtype=dtype, device=device)
        return self._tensors[key]

    def constant_sqrt_rows(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[rows]`` of sqrt(cols), computed on the device like a per-call sqrt (made once per shape)."""
        key = ("sqrt rows", rows, cols, dtype, device)
        if key not in self._tensors:
            self._tensors[key] = self.constant_rows(rows, float(cols), dtype, device).sqrt()
        return self._tensors[key]

    def row_constants(
        self, rows: int, cols: int, dtype: torch.dtype, device: torch.device, count_unknown: bool
    ) -> RowConstants:
        """What ``bin_batch`` reuses for micro-batches of ``rows`` x ``cols`` without a
        mask, looked up once per call instead of piece by piece."""
        key = (rows, cols, dtype, device, count_unknown)
        found = self._row_constants.get(key)
        if found is None:
            if len(self._row_constants) > 64:  # micro-batch shapes changed many times: start over
                self._row_constants.clear()
            positions = self.constant_rows(rows, float(cols), dtype, device)
            one = self.constant_rows(rows, 1.0, dtype, device)
            root = self.constant_sqrt_rows(rows, cols, dtype, device)
            labelled = self.constant_rows(rows, -LABELLED_POSITION * cols, dtype, device)
            features = torch.stack([one, positions, root, torch.zeros_like(one), labelled, positions])
            fit_rows, log_n = self.constant_fit_rows(rows, cols, dtype, device)
            found = RowConstants(
                positions=positions,
                one=one,
                root=root,
                has=self.constant_rows(rows, True, torch.bool, device),
                fit_rows=fit_rows,
                log_n=log_n,
                targets=self.bin_targets(device, count_unknown),
                features=features,
                loss_row=features[3],
            )
            self._row_constants[key] = found
        return found

    def constant(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 0-d tensor holding ``value`` (``where`` with a Python number makes one per call)."""
        key = ("constant", value, dtype, device)
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(value, dtype=dtype).to(device)
        return self._tensors[key]


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
