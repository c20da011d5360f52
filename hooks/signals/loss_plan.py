"""Loss accounting's report plan: which entries of the step's sums each figure divides.

:class:`~trainvitals.hooks.signals.loss_report.LossReport` turns a reported step's
sums into some thirty figures over modalities and objectives. Made one by one they
cost a tensor op each (a slice, a division, a comparison: ~120 ops per report);
instead the report concatenates everything it reads into one pool vector and each
level of ratios is one gather of numerators, one of denominators and one division.
A :class:`Plan` holds those index tensors for one report layout (modalities,
active objectives, scale, declared normalization), built once on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.signals.loss_arguments import NORMALIZATIONS
from trainvitals.hooks.signals.loss_binning import SumsLayout

__all__ = ["MIN_LOG_LENGTH_VAR", "ROWS", "SHARES", "SQRT_TOLERANCE", "Plan"]

MIN_LOG_LENGTH_VAR = 1e-6
"""Below this variance of log(label tokens per sample) there is no slope to fit."""

SQRT_TOLERANCE = 0.15
"""Undeclared, a fitted exponent within this of 0.5 is taken as a deliberate sqrt
normalization (it is 0 per sample, 1 per token: far from either)."""

ROWS = ("samples", "tokens", "sqrt_tokens", "loss", "weight")
"""The per-bin rows of the sums whose totals over bins a report divides by."""

SHARES = {0.0: "samples", 0.5: "sqrt_tokens", 1.0: "tokens"}
"""The bin row whose share each normalization's exponent intends."""


class Plan:
    """The index tensors of one report layout (modalities, active objectives, scale,
    declared normalization): which pool entries each ratio divides. Built once per
    layout on the host; a report then costs a gather pair and one division per level.

    The pool is ``cat([sums, totals of the ROWS over bins, wmax, wmin, consts,
    products, fit, sqrt(output)])``: ``consts`` is ``[1, 0, scale or 1, declared
    weights...]``; ``products`` the exponent fit's ``[n sxy, n sxx, sx sy, n n, sx sy,
    sx sx, n sxy, n n]``, ``fit`` its numerator, denominator, minus numerator and 0. Level 1 (``num1 / den1``) is, in
    order: the loss; per modality its loss, its sample, token, weight and
    sqrt-token shares; the exponent, var(log n), n; the scale (scale / 1); per
    objective its spread, its mass over its declared weight; per modality sqrt of its
    output sums. Level 2 (``num2 / den2`` over level 1): per modality the dilution
    and the intended share over the weight share; per objective the mass over the
    scale; per modality its output gradient norm over the scale."""

    def __init__(
        self,
        lay: SumsLayout,
        m: int,
        slots: tuple[int, ...],
        declared_weights: tuple[float, ...],
        scale: float | None,
        declared: str | None,
        zero_code: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        k = len(slots)
        at = {name: lay.size + i for i, name in enumerate(ROWS)}
        wmax0 = lay.size + len(ROWS)
        wmin0 = wmax0 + lay.objectives
        one = wmin0 + lay.objectives
        zero, scale_at, weights0 = one + 1, one + 2, one + 3
        prod0 = weights0 + k
        fit0 = prod0 + 8
        out0 = fit0 + 4
        n, sx, sy, sxx, sxy = range(lay.fit.start, lay.fit.stop)

        def bins(row: str) -> list[int]:
            start = getattr(lay, row).start
            return list(range(start, start + m))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device)

        def floats(values: list[Any]) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        share = {row: 1 + (i + 1) * m for i, row in enumerate(("samples", "tokens", "weight", "sqrt_tokens"))}
        num1 = [at["loss"], *bins("loss")]
        den1 = [at["tokens"], *bins("tokens")]
        for row in share:
            num1 += bins(row)
            den1 += [at[row]] * m
        self.exponent = len(num1)
        # the exponent, minus it, var(log n) = (n sxx - sx sx) / n^2, n
        num1 += [fit0, fit0 + 2, fit0 + 1, n]
        den1 += [fit0 + 1, fit0 + 1, prod0 + 3, one]
        # the fit holds with var(log n) > MIN_LOG_LENGTH_VAR and n >= 2 (counts); sqrt-like
        # when also 0.5 - SQRT_TOLERANCE < exponent < 0.5 + SQRT_TOLERANCE
        self.fit_checks = tensor([self.exponent + 2, self.exponent + 3, self.exponent, self.exponent + 1])
        self.fit_bounds = floats([MIN_LOG_LENGTH_VAR, 1.5, 0.5 - SQRT_TOLERANCE, -0.5 - SQRT_TOLERANCE])
        self.scale = len(num1)
        num1.append(at["tokens"] if scale is None else scale_at)
        den1.append(one)
        num1 += [wmax0 + s for s in slots]
        den1 += [wmin0 + s for s in slots]
        massw = len(num1)
        num1 += [lay.mass.start + s for s in slots]
        den1 += list(range(weights0, weights0 + k))
        sqrt_output = len(num1)
        num1 += list(range(out0, out0 + m))
        den1 += [one] * m

        intended = SHARES[NORMALIZATIONS[declared]] if declared is not None else "sqrt_tokens"
        num2 = [*range(share["samples"], share["samples"] + m), *range(share[intended], share[intended] + m)]
        den2 = list(range(share["weight"], share["weight"] + m)) * 2
        num2 += list(range(massw, massw + k))
        den2 += [self.scale] * k
        num2 += list(range(sqrt_output, sqrt_output + m))
        den2 += [self.scale] * m

        # presence: both pool entries nonzero. The step's label tokens; per modality its
        # label tokens, then the step's (the sample and token shares); the weight's
        # total (grad share); the modality's samples and the weight's total (dilution);
        # its samples (output norm); per objective the step's label tokens (mass).
        present = [at["tokens"], *bins("tokens"), *[at["tokens"]] * (2 * m)]
        present_and = [one] * len(present)
        present += [at["weight"]] * m
        present += bins("samples")
        present_and += [one] * m + [at["weight"]] * m
        present += bins("samples")
        present += [at["tokens"]] * k
        present_and += [one] * (m + k)

        # Each level splits into its figures with one op (``Tensor.split``), not a slice each.
        # level 1: loss; modality loss, sample and token shares; weight share; sqrt-token
        # share; exponent; -exponent, var(log n), n; scale; spread; mass; sqrt(output)
        self.first_sizes = [1, 3 * m, m, m, 1, 3, 1, k, k, m]
        # presence: loss; the three rows; weight share; dilution; output norm; mass
        self.presence_sizes = [1, 3 * m, m, m, m, k]
        # level 2: dilution; intended over weight share; mass over scale; output norm
        self.second_sizes = [m, m, k, m]
        assert sum(self.first_sizes) == len(num1) and sum(self.second_sizes) == len(num2)
        assert sum(self.presence_sizes) == len(present)

        # events: mixed, unknown, (not cross-entropy,) then each modality's positions
        # times "its label tokens == 0"
        counts = [lay.mixed, lay.unknown] + ([lay.not_ce] if zero_code else [])
        self.flags = tensor(counts + bins("positions"))
        self.flags_if_zero = tensor([zero] * len(counts) + bins("tokens"))

        self.rows = tensor([i for row in ROWS for i in range(getattr(lay, row).start, getattr(lay, row).stop)])
        # products [[n sxy, n sxx, sx sy, n n], [sx sy, sx sx, n sxy, n n]]; their
        # difference [numerator, denominator, -numerator, 0]
        self.fit = tensor([n, sxy, n, sxx, sx, sy, n, n, sx, sy, sx, sx, n, sxy, n, n])
        self.consts = floats([1.0, 0.0, 1.0 if scale is None else scale, *declared_weights])
        self.num1, self.den1 = tensor(num1), tensor(den1)
        self.num2, self.den2 = tensor(num2), tensor(den2)
        self.present, self.present_and = tensor(present), tensor(present_and)
        self.blind = tensor([lay.not_ce, lay.overwritten])
        self.none_k = torch.zeros(k, dtype=torch.bool).to(device)
        # the spread holds where every micro-batch was uniform (a count: 0), the smallest
        # weight is in (0, inf) and the largest finite: each within its row's open bounds
        self.spread_checks = tensor(
            [lay.nonuniform.start + s for s in slots] + [wmin0 + s for s in slots] + [wmax0 + s for s in slots]
        )
        self.spread_low = floats([[-0.5], [0.0], [float("-inf")]])
        self.spread_high = floats([[0.5], [float("inf")], [float("inf")]])
