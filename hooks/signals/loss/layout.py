"""The layout of loss accounting's per-step sums: one float vector a step gathers into.

:class:`SumsLayout` says where each bin's, objective's and fit's sums lie in the
vector, and keeps the index and constant tensors the writers reuse
(:class:`RowConstants` per micro-batch shape), so that each writer adds its entries
with one op and the step costs one cross-rank sum. The binning that writes into it is
:mod:`~trainvitals.hooks.signals.loss.binning`; the report that reads it,
:mod:`~trainvitals.hooks.signals.loss.report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LABELLED_POSITION", "RowConstants", "SumsLayout"]


LABELLED_POSITION = float(2**24)
"""What a position counts for in the per-bin positions row when its sample has label
tokens (a position of a sample without any counts 1): one such position outweighs
every position of samples without label tokens a step can hold, so the row is > 0
exactly when the code marks positions of label-less samples only."""


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
