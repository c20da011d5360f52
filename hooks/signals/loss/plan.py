"""Loss accounting's report plan: which entries of the step's sums each figure divides.

:class:`~trainvitals.hooks.signals.loss.report.LossReport` turns a reported step's
sums into some thirty figures over modalities and objectives. Made one by one they
cost a tensor op each (a slice, a division, a comparison: ~120 ops per report);
instead the report concatenates everything it reads into one pool vector, and each
level of ratios is one gather of numerators, one of denominators and one division,
split into its figures with one op. A value that is needed as it is passes through
the division as ``x / 1`` (exact), its negation as ``x / -1`` (exact too): so the
counts that gate a figure, the counts behind the events and the operands of every
threshold test come out of the same division, and all the tests are one comparison
of that block with their bounds. A :class:`Plan` holds those index tensors for one
report layout (modalities, active objectives, scale, declared normalization), built
once on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.signals.loss.arguments import NORMALIZATIONS
from trainvitals.hooks.signals.loss.layout import SumsLayout

__all__ = ["MIN_LOG_LENGTH_VAR", "ROWS", "SHARES", "SQRT_TOLERANCE", "TESTS_PER_ROW", "Plan"]

MIN_LOG_LENGTH_VAR = 1e-6
"""Below this variance of log(label tokens per sample) there is no slope to fit."""

SQRT_TOLERANCE = 0.15
"""Undeclared, a fitted exponent within this of 0.5 is taken as a deliberate sqrt
normalization (it is 0 per sample, 1 per token: far from either)."""

ROWS = ("samples", "tokens", "sqrt_tokens", "loss", "weight")
"""The per-bin rows of the sums whose totals over bins a report divides by; the
layout keeps them end to end, in this order, from the start of the sums."""

SHARES = {0.0: "samples", 0.5: "sqrt_tokens", 1.0: "tokens"}
"""The bin row whose share each normalization's exponent intends."""

TESTS_PER_ROW = 4
"""Each verdict is the conjunction of this many ``value > bound`` tests (a verdict
that needs fewer repeats one)."""


class Plan:
    """The index tensors of one report layout (modalities, active objectives, scale,
    declared normalization): which pool entries each ratio divides. Built once per
    layout on the host; a report then costs a gather pair and one division per level.

    The pool is ``cat([sums, sqrt(sums), totals of the ROWS over bins, extremes
    (``SumsLayout.extremes``: wmax, -wmin, non-uniform), consts, products, fit])``:
    ``consts`` is ``[1, -1, scale or 1, declared weights...]``; ``products`` the
    exponent fit's ``[n sxy, n sxx, sx sy, n n, sx sy, sx sx, n sxy, n n]``, ``fit``
    its numerator, denominator, minus numerator and 0.

    Level 1 (``num1 / den1``) splits with ``sizes`` into parts, each attribute below
    naming its part's position: counts passed through (the non-finite counter, the
    mixed and unknown codes, zero-code's two blind counts); the figures (the loss; per
    modality its loss, sample and token shares; the weight shares; the exponent; the
    scale); the presence counts (label tokens, samples: a figure is sent where its
    count is > 0; a count is never negative), the weight's total per modality (present
    where nonzero, it may be negative); level 2's numerators and denominators, end to
    end, so level 2 is one division of two parts (per modality the dilution and the
    intended share over the weight share; per objective the mass over the scale; per
    modality the output gradient norm over the scale; per objective its spread, as
    ``(wmax / -wmin) / -1``); last the operands of the tests, compared with ``bounds``
    at once, then folded per verdict: ``verdict_sizes`` splits the verdicts into the
    fit (n >= 2 samples and var(log n) > MIN_LOG_LENGTH_VAR), the fit being sqrt-like,
    no label token, zero-code's gate (nothing blind), per objective its spread (every
    micro-batch uniform, unless per-sample weighting is declared; the smallest weight
    > 0, the largest finite), per modality
    its positions without label tokens."""

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
        sums_dtype: torch.dtype,
    ) -> None:
        k = len(slots)
        b = lay.bins
        if [getattr(lay, row) for row in ROWS] != [slice(i * b, (i + 1) * b) for i in range(len(ROWS))]:
            raise ValueError("loss plan: the layout's ROWS must lie end to end from the start of the sums")
        root0 = lay.size  # sqrt of the sums (the output sums' are read)
        at = {name: 2 * lay.size + i for i, name in enumerate(ROWS)}
        ext0 = 2 * lay.size + len(ROWS)
        wmax0, negmin0, nonuniform0 = (ext0 + r.start for r in (lay.wmax, lay.negmin, lay.nonuniform))
        one = ext0 + lay.extremes
        minus_one, scale_at, weights0 = one + 1, one + 2, one + 3
        prod0 = weights0 + k
        fit0 = prod0 + 8
        n, sx, sy, sxx, sxy = range(lay.fit.start, lay.fit.stop)

        def bins(row: str) -> list[int]:
            start = getattr(lay, row).start
            return list(range(start, start + m))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device)

        def floats(values: list[Any]) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        num1: list[int] = []
        den1: list[int] = []
        self.sizes: list[int] = []

        def part(nums: list[int], dens: list[int]) -> int:
            assert len(nums) == len(dens)
            num1.extend(nums)
            den1.extend(dens)
            self.sizes.append(len(nums))
            return len(self.sizes) - 1

        def shares(row: str) -> tuple[list[int], list[int]]:
            return bins(row), [at[row]] * m

        scale_num = at["tokens"] if scale is None else scale_at
        # counts passed through
        self.nonfinite = part([lay.nonfinite], [one])
        self.mixed = part([lay.mixed], [one])
        self.unknown = part([lay.unknown], [one])
        self.not_ce = part([lay.not_ce], [one]) if zero_code else -1
        self.overwritten = part([lay.overwritten], [one]) if zero_code else -1
        # the log-once warnings' counts, in LossReport._late_warnings' order
        blind_counts = [lay.not_ce, lay.overwritten] if zero_code else []
        warned = [lay.mixed, lay.unknown, *blind_counts, lay.nonfinite]
        self.warn_counts = part(warned, [one] * len(warned))
        # the figures
        self.loss = part([at["loss"]], [at["tokens"]])
        self.rows = part(
            bins("loss") + shares("samples")[0] + shares("tokens")[0],
            bins("tokens") + shares("samples")[1] + shares("tokens")[1],
        )
        self.share = part(*shares("weight"))
        self.exponent = part([fit0], [fit0 + 1])
        self.scale = part([scale_num], [one])
        # presence
        self.present_loss = part([at["tokens"]], [one])
        self.present_rows = part(bins("tokens") + [at["tokens"]] * (2 * m), [one] * (3 * m))
        self.present_samples = part(bins("samples"), [one] * m)
        self.present_mass = part([at["tokens"]] * k, [one] * k)
        self.weight_total = part([at["weight"]] * m, [one] * m)
        # level 2's operands
        intended = SHARES[NORMALIZATIONS[declared]] if declared is not None else "sqrt_tokens"
        root_output = [root0 + i for i in bins("output")]  # sqrt of the output sums
        self.num2 = part(
            shares("samples")[0]
            + shares(intended)[0]
            + [lay.mass.start + s for s in slots]
            + root_output
            + [wmax0 + s for s in slots],
            shares("samples")[1]
            + shares(intended)[1]
            + list(range(weights0, weights0 + k))
            + [one] * m
            + [negmin0 + s for s in slots],
        )
        self.den2 = part(
            shares("weight")[0] * 2 + [scale_num] * (k + m) + [minus_one] * k,
            shares("weight")[1] * 2 + [one] * (k + m + k),
        )
        # dilution; intended over weight share; mass over scale; output norm; spread
        self.second_sizes = [m, m, k, m, k]

        # the tests: rows of TESTS_PER_ROW (numerator, denominator, bound), value > bound
        tests: list[list[tuple[int, int, float]]] = []
        var = (fit0 + 1, prod0 + 3, MIN_LOG_LENGTH_VAR)  # var(log n) = (n sxx - sx sx) / n^2
        count = (n, one, 1.5)  # n >= 2 samples
        tests.append([var, count, var, count])
        tests.append([var, count, (fit0, fit0 + 1, 0.5 - SQRT_TOLERANCE), (fit0 + 2, fit0 + 1, -0.5 - SQRT_TOLERANCE)])
        tests.append([(at["tokens"], minus_one, -0.5)] * TESTS_PER_ROW)  # no label token: -tokens > -0.5
        if zero_code:
            blind = [(lay.not_ce, minus_one, -0.5), (lay.overwritten, minus_one, -0.5)]
            tests.append(blind * 2)
        for s in slots:
            # uniform: -nonuniform > -0.5; 0 < wmin (-wmin / -1); -inf < wmax < inf (then wmin < inf too).
            # Per-sample weighting declared: unequal token weights within a micro-batch are the
            # intent, so the spread is the step's max/min token weight (no uniformity test).
            tests.append(
                [
                    (negmin0 + s, minus_one, 0.0) if declared == "sample" else (nonuniform0 + s, minus_one, -0.5),
                    (negmin0 + s, minus_one, 0.0),
                    (wmax0 + s, one, float("-inf")),
                    (wmax0 + s, minus_one, float("-inf")),
                ]
            )
        for p, t in zip(bins("positions"), bins("tokens"), strict=True):
            tests.append([(p, one, 0.5), (t, minus_one, -0.5)] * 2)  # positions, no label token
        assert all(len(row) == TESTS_PER_ROW for row in tests)
        flat = [test for row in tests for test in row]
        self.tests = part([t[0] for t in flat], [t[1] for t in flat])
        self.bounds = floats([t[2] for t in flat])
        self.verdict_rows = len(tests)
        self.fit_ok, self.sqrt_ok, self.no_input = 0, 1, 2
        self.gate = 3 if zero_code else -1
        self.spread_ok = 4 if zero_code else 3
        self.flags = self.spread_ok + 1  # per modality, one part each
        self.flags_at = self.spread_ok + k  # where they start in the verdicts themselves
        self.verdict_sizes = [1] * self.spread_ok + [k] + [1] * m

        # products [[n sxy, n sxx, sx sy, n n], [sx sy, sx sx, n sxy, n n]]; their
        # difference [numerator, denominator, -numerator, 0]
        self.fit = tensor([n, sxy, n, sxx, sx, sy, n, n, sx, sy, sx, sx, n, sxy, n, n])
        # in the sums' dtype, as every other piece of the pool (one cat without conversions)
        consts = [1.0, -1.0, 1.0 if scale is None else scale, *declared_weights]
        self.consts = torch.tensor(consts, dtype=sums_dtype).to(device)
        self.num1, self.den1 = tensor(num1), tensor(den1)
        # Kept buffers the report writes with out= (their views made once, here): the
        # fit's gathered pairs and their products, the tests' outcomes. Only the report
        # reads them, at once (the pool's cat and the verdicts' all() copy them out).
        self.fit_in = torch.empty(16, dtype=sums_dtype, device=device)
        self.fit_pairs = self.fit_in.view(2, 4, 2)
        self.fit_out = torch.empty(2, 4, dtype=sums_dtype, device=device)
        self.above, self.below = self.fit_out.unbind()
        self.tested = torch.empty(len(flat), dtype=torch.bool, device=device)
        # The pool, in the figures' dtype (``dtype``): the sums (``sums_dtype``, wider on
        # one rank) are rounded to it once, as the cross-rank combine rounds them. Read
        # only by the report's two gathers.
        self.pool = torch.empty(fit0 + 4, dtype=dtype, device=device)
        # When the sums are wider: the cat fills this one in their dtype (a cat that
        # converts takes a slow path, 5x on a CPU), then one copy rounds it into the pool.
        self.pool_wide = None if sums_dtype == dtype else torch.empty(fit0 + 4, dtype=sums_dtype, device=device)
        self.tested_rows = self.tested.view(self.verdict_rows, TESTS_PER_ROW)
