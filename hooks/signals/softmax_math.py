"""The arithmetic behind the softmax saturation signal (docs/incidents.md, I5).

Pure functions on tensors: no monitor, no state, no host sync. The signal
(``softmax.py``) feeds them row chunks of logits and sums what they return.

Units: a *gap* is ``u_j = (z_max - z_j) / tau`` for the logits ``z`` of one
position at the observed temperature ``tau``; gaps are >= 0 and the top-1 class
has gap 0. At an (absolute) temperature ``T`` the top-1 probability is
``1 / sum_j exp(-beta u_j)`` with ``beta = tau / T``.

Recommended temperature (why a histogram): the temperature whose mean top-1 over
all observed positions is the target needs that mean at many candidate
temperatures, and positions from every call of a step (micro-batches) count. Re-
reading the full vocabulary for each candidate (30 bisection passes over 150k
classes) is too slow, and keeping the top-k logits is wrong for a large
vocabulary: near the target the mass outside the top-1 sits in the *bulk* of the
vocabulary, not in its top 256. So each position's gaps are summarised once, in
the same pass as the other statistics, by a histogram on geometric bins: 16 per
octave (bin width <= 1/16 of the gap), from 2^-5 to 2^14, plus one bin for the
gaps below 2^-5 (the top-1 and near-ties). The bin is read off the float's bits
(exponent and 4 leading mantissa bits, as in a fast log2), and each bin keeps
the count, sum and sum of squares of ``d = gap - c`` around its centre ``c``, so
its share of the partition function at ``beta`` is the second-order expansion
``exp(-beta c) (count - beta sum d + beta^2 sum d^2 / 2)``: always positive, off
by at most ``(beta h)^3 / 48`` of the bin's mass for bin width ``h`` (the d^3
term). With geometric bins ``beta * h`` is the same at every scale: where a bin
matters, ``beta * gap`` is ~ ln V ~ 12, so ``beta h`` <~ 0.75 and the bound is
~1 %, reached only when all of a bin's gaps sit on its two edges. The histogram
becomes the top-1 probability at each temperature of a fixed grid
(``temperature_grid``) with three small matrix products, so what a step keeps
is one number per grid temperature summed over positions: bounded memory
whatever the number of calls, and additive. ``temperature_for_target``
interpolates the grid (logit of the mean top-1, linear in 1/T; exact when one
logit gap dominates). Measured against exact bisection on full logits (tests):
mean top-1 at the recommended temperature within 0.005 of the target, adversarial
two-point bins included. With at most ``EXACT_MAX_CLASSES`` classes the gaps
themselves are used (exact).

Scatter-adds into one bin form a dependency chain on a CPU (each add waits for
the previous), and a row's bulk falls into a handful of bins; so consecutive
classes go to ``LANES`` interleaved copies of the histogram, summed afterwards.
"""

from __future__ import annotations

import math

import torch

GAP_MIN_EXPONENT = -5
"""Gaps below 2^-5 (the top-1 and its near-ties) share bin 0 with [2^-5, 2^-5 * 17/16)."""
GAP_MAX_EXPONENT = 14
"""Geometric bins reach 2^14 > ``GAP_CLAMP``."""
_SUB_BITS = 4  # 16 bins per octave
_SHIFT = 23 - _SUB_BITS  # float32: 23 mantissa bits
_EDGE_MASK = -(1 << _SHIFT)  # int32 with the 19 low bits clear
_BASE = (127 + GAP_MIN_EXPONENT) << _SUB_BITS  # exponent bias 127
GAP_BINS = 1 + ((GAP_MAX_EXPONENT - GAP_MIN_EXPONENT) << _SUB_BITS)
"""Histogram bins per position (16 per octave from 2^-5 to 2^14)."""
GAP_CLAMP = 1.0e4
"""Gaps are clamped here: exp(-1e4 / 64) * 2^31 classes is ~1e-59 of the top-1."""
LANES = 4
"""Interleaved histogram copies per row (see above)."""
EXACT_MAX_CLASSES = 128
"""Up to this many classes the grid is computed from every gap (no histogram)."""

TEMPERATURE_MAX = 64.0
"""Top of the temperature grid; a mean top-1 still above the target there reports this."""
TEMPERATURE_POINTS = 64
"""Grid points, log-spaced on [1, TEMPERATURE_MAX]: consecutive temperatures 6.8 % apart."""

STATS = ("top1", "saturated_099", "saturated_0999", "jacobian", "entropy")
"""Per-position statistics returned by ``saturation_chunk``, in column order."""
SATURATION_THRESHOLDS = (0.99, 0.999)

# Extra bytes per logit a chunk holds at once: gaps and exponentials (float32,
# 4 + 4) and bin indices (int64, 8, first used as a float32 scratch buffer); or,
# for distillation, two float32 probability buffers. Add the logits' own item size for a gathered copy of rows that are not
# a view.
BYTES_PER_LOGIT = 16
CPU_CHUNK_BYTES = 8 * 1024 * 1024
"""Chunk bound on a CPU (cache-sized), when below ``softmax_chunk_bytes``."""
# Bytes per row for the grid: three [LANES * GAP_BINS] accumulators, their sums,
# and [K] results; or, with few classes, [V, K] terms and an exp buffer.
GRID_BYTES_PER_ROW = 4 * max(3 * LANES * GAP_BINS + 4 * TEMPERATURE_POINTS,
                             2 * EXACT_MAX_CLASSES * TEMPERATURE_POINTS)


def jacobian(q: torch.Tensor | float) -> torch.Tensor | float:
    """Diagonal softmax Jacobian of the top class, ``q (1 - q)``."""
    return q * (1 - q)


def logit_gap_for_prob(q: float, classes: int = 2) -> float:
    """Logit margin of the top class over ``classes - 1`` equal others that gives it
    probability ``q``: ``ln(q (classes - 1) / (1 - q))`` (2 classes: ``logit(q)``)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    if classes < 2:
        raise ValueError(f"classes must be >= 2, got {classes!r}")
    return math.log(q * (classes - 1) / (1.0 - q))


def logit_change(q_from: float, q_to: float, classes: int = 2) -> float:
    """How far the top logit must move to take its probability from ``q_from`` to
    ``q_to``; 0.95 -> 0.99 is 1.65 nats, 0.99 -> 0.999 is 2.31 (I5)."""
    return logit_gap_for_prob(q_to, classes) - logit_gap_for_prob(q_from, classes)


def temperature_grid(device: torch.device | str = "cpu", *, t_max: float = TEMPERATURE_MAX,
                     points: int = TEMPERATURE_POINTS) -> torch.Tensor:
    """Candidate temperatures, log-spaced from 1 to ``t_max`` (float32, ``[points]``)."""
    return torch.logspace(0.0, math.log10(t_max), points, dtype=torch.float64).to(device, torch.float32)


def _bits_to_float(codes: torch.Tensor) -> torch.Tensor:
    return (codes << _SHIFT).to(torch.int32).view(torch.float32)


def bin_edges(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Per histogram bin (``[GAP_BINS]`` each, float32): the point its offsets are
    accumulated from (its lower edge; 2^-5 for bin 0, which also holds every gap
    below) and the point its partition-function share is expanded around (its
    middle; for bin 0 the middle of ``[0, upper edge)``)."""
    codes = torch.arange(GAP_BINS + 1, dtype=torch.int64) + _BASE
    edges = _bits_to_float(codes)  # exact: the floats with exactly those bits
    lower = edges[:-1]
    centre = (torch.cat([edges.new_zeros(1), lower[1:]]) + edges[1:]) / 2
    return lower.to(device), centre.to(device)


def subsample_stride(positions: int, cap: int, period: int = 1) -> int:
    """Row stride that keeps at most ``cap`` of ``positions``; for [B, T] positions
    (``period`` = T) it is made coprime with T, so the sample walks through every
    position in the sequence instead of repeating one phase."""
    stride = max(1, -(-positions // cap))
    if stride > 1 and period > 1:
        while math.gcd(stride, period) != 1:
            stride += 1
    return stride


def rows_per_chunk(vocab: int, chunk_bytes: int, *, copies: int = 0, itemsize: int = 4,
                   device: torch.device | str = "cpu") -> int:
    """Positions processed at once so that the extra buffers stay within
    ``chunk_bytes`` (at least one row). ``copies``: row copies of ``itemsize`` bytes
    per logit made when the selected positions are not a view of the input. On a
    CPU, chunks are kept to ``CPU_CHUNK_BYTES`` so that the ~20 passes over a chunk
    run from cache; an accelerator gets the whole bound (fewer, larger kernels)."""
    if torch.device(device).type == "cpu":
        chunk_bytes = min(chunk_bytes, CPU_CHUNK_BYTES)
    per_row = (BYTES_PER_LOGIT + copies * itemsize) * vocab + GRID_BYTES_PER_ROW
    return max(1, chunk_bytes // per_row)


class Workspace:
    """Buffers for up to ``rows`` positions of ``vocab`` classes, allocated once per
    observe call and reused by every chunk (the CPU allocator would otherwise
    page-fault fresh buffers in on each chunk), with what every chunk of the call
    shares: ``betas`` and, for the histogram, each bin's ``exp(-beta c_b)``."""

    def __init__(self, rows: int, vocab: int, device: torch.device, *,
                 betas: torch.Tensor | None = None, histogram: bool = False):
        self.gaps = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        self.scratch = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        self.betas = betas
        self.index = self._spare = None
        if histogram and betas is not None:
            self.index = torch.empty((rows, vocab), dtype=torch.long, device=device)
            # class j goes to lane j % LANES; histogram column = lane * GAP_BINS + bin,
            # bin = (edge bits >> 19) - _BASE
            lanes = torch.arange(vocab, device=device) % LANES
            self.lane_offset = lanes * GAP_BINS - _BASE
            lower, centre = bin_edges(device)
            self.shift = centre - lower                                # [bins]
            self.decay = torch.exp(centre.unsqueeze(1) * betas.neg())  # [bins, K]

    def take(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The buffers' first ``rows`` rows (contiguous views)."""
        return self.gaps[:rows], self.scratch[:rows], None if self.index is None else self.index[:rows]

    def spare(self, rows: int) -> torch.Tensor:
        """A third float32 ``[rows, vocab]`` buffer: the start of the index buffer,
        free until the histogram (or a buffer of its own when there is none)."""
        vocab = self.gaps.shape[1]
        if self.index is None:
            if self._spare is None:
                self._spare = torch.empty_like(self.gaps)
            return self._spare[:rows]
        return self.index.view(-1).view(torch.float32)[: rows * vocab].view(rows, vocab)


def gaps(rows: torch.Tensor, inv_temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``(z_max - z) / tau`` per row into the float32 buffer ``out`` (never -0.0),
    clamped to ``GAP_CLAMP`` (so masked ``-inf`` logits contribute exactly 0)."""
    out.copy_(rows)
    torch.sub(out.amax(-1, keepdim=True), out, out=out)
    if inv_temperature != 1.0:
        out.mul_(inv_temperature)
    return out.clamp_(max=GAP_CLAMP)


def partition(u: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(-gap)`` into ``out`` (which may be ``u``), and per row the number of
    classes tied at the top and the sum of the rest: ``Z = ties + rest``. Kept
    apart, ``1 - q = (ties - 1 + rest) / Z`` stays exact when ``rest`` is 1e-12
    (``1 - 1/Z`` would round to 0). ``scratch`` is overwritten."""
    sign = torch.sign(u, out=scratch)  # 0 at the top-1 and its ties, 1 elsewhere
    e = torch.neg(u, out=out).exp_()
    total = e.sum(-1)
    rest = sign.mul_(e).sum(-1)
    return (total - rest).round_().clamp_(min=1.0), rest


def gap_histogram(u: torch.Tensor, workspace: Workspace) -> torch.Tensor:
    """Per row and bin: count, sum and sum of squares of ``gap - centre`` (``[3, r, GAP_BINS]``).

    Overwrites the workspace's scratch and index buffers; ``u`` is kept.
    """
    r, v = u.shape
    _, scratch, index = workspace.take(r)
    # The bin's lower edge is the gap with its 19 low mantissa bits cleared
    # (exponent and 4 leading mantissa bits kept); gaps below 2^-5 all get 2^-5;
    # NaN gaps (NaN logits) land in the last bin, which no clamped gap reaches.
    edge = torch.bitwise_and(u.view(torch.int32), _EDGE_MASK, out=scratch.view(torch.int32))
    edge.clamp_(_BASE << _SHIFT, (_BASE + GAP_BINS - 1) << _SHIFT)
    idx = torch.bitwise_right_shift(edge, _SHIFT, out=index).add_(workspace.lane_offset)
    d = torch.sub(u, edge.view(torch.float32), out=scratch)
    sums = u.new_zeros(3, r, GAP_BINS * LANES)
    sums[0].scatter_add_(1, idx, u.new_ones(1, 1).expand(r, v))
    sums[1].scatter_add_(1, idx, d)
    sums[2].scatter_add_(1, idx, d.square_())
    n, s1, s2 = sums.view(3, r, LANES, GAP_BINS).sum(2)
    # re-centre the offsets: from the lower edge to the middle of the bin
    shift = workspace.shift
    return torch.stack([n, s1 - n * shift, s2 - 2 * shift * s1 + n * shift.square()])


def top1_on_grid(sums: torch.Tensor, workspace: Workspace) -> torch.Tensor:
    """Top-1 probability at each ``beta`` (``[r, K]``) from ``gap_histogram`` sums:
    ``1 / sum_b exp(-beta c_b) (count_b - beta sum_b d + beta^2 sum_b d^2 / 2)``."""
    betas = workspace.betas
    count, first, second = (x @ workspace.decay for x in sums)
    return (count - first * betas + second * (betas.square() / 2)).reciprocal()


def top1_on_grid_exact(u: torch.Tensor, betas: torch.Tensor) -> torch.Tensor:
    """Top-1 probability at each ``beta`` (``[r, K]``) from every gap ``[r, V]``."""
    return torch.exp(u.unsqueeze(-1) * betas.neg()).sum(1).reciprocal()


def saturation_chunk(rows: torch.Tensor, inv_temperature: float,
                     workspace: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics of one chunk of positions.

    ``rows``: ``[r, V]`` logits, any float dtype (computed in float32 in
    ``workspace``, whose ``betas`` are ``tau / T`` for each grid temperature ``T``).
    Returns ``([r, len(STATS)], [r, K])``: top-1 probability, whether it is above
    0.99 and 0.999, ``q (1 - q)``, entropy in nats; top-1 probability at each grid
    temperature.
    """
    r = rows.shape[0]
    u, e, index = workspace.take(r)
    gaps(rows, inv_temperature, out=u)
    spare = workspace.spare(r)
    ties, rest = partition(u, e, scratch=spare)
    z = ties + rest
    top1 = z.reciprocal()
    not_top1 = (ties - 1.0 + rest) * top1                   # 1 - q, exact for tiny rest
    entropy = torch.log(z) + e.mul_(u).sum(-1) * top1       # H = log Z + E_p[gap]
    stats = torch.stack([top1, *((top1 > t).float() for t in SATURATION_THRESHOLDS),
                         top1 * not_top1, entropy], dim=1)
    if index is None:
        grid = top1_on_grid_exact(u, workspace.betas)
    else:
        grid = top1_on_grid(gap_histogram(u, workspace), workspace)
    return stats, grid


def saturation_workspace(rows: int, vocab: int, betas: torch.Tensor) -> Workspace:
    """The buffers ``saturation_chunk`` needs (no histogram with few classes)."""
    return Workspace(rows, vocab, betas.device, betas=betas, histogram=vocab > EXACT_MAX_CLASSES)


def distillation_chunk(student_rows: torch.Tensor, teacher_rows: torch.Tensor,
                       inv_temperature: float, workspace: Workspace) -> torch.Tensor:
    """Per position ``[r, 3]``: how much the KL gradient raises the teacher's top-1
    logit, half the gradient's L1 norm, and the teacher's mass outside its top-1.

    With ``p_S``, ``p_T`` at temperature ``tau``, the gradient of KL(p_T || p_S)
    with respect to the student's logits is ``g = p_S - p_T`` up to the factor
    1/tau (tau^2 with Hinton's scaling), which a share cancels. ``sum_j g_j = 0``,
    so a descent step raises some logits by ``||g||_1 / 2`` in all and lowers
    others by as much; the first column is the part of the raising that goes to
    the teacher's top-1 ``t``: ``max(p_T,t - p_S,t, 0)``.
    """
    r = student_rows.shape[0]
    p, teacher, _ = workspace.take(r)
    gaps(teacher_rows, inv_temperature, out=teacher)
    top_index = teacher.argmin(-1, keepdim=True)  # gap 0: the teacher's top-1 (the first of ties)
    ties, rest = partition(teacher, teacher, scratch=p)
    z = ties + rest
    teacher.div_(z.unsqueeze(-1))
    dark = (ties - 1.0 + rest) / z
    torch.neg(gaps(student_rows, inv_temperature, out=p), out=p).exp_()
    p.div_(p.sum(-1, keepdim=True))
    g = p.sub_(teacher)
    raise_top = g.gather(1, top_index).neg_().clamp_(min=0.0).squeeze(-1)
    return torch.stack([raise_top, g.abs_().sum(-1) / 2, dark], dim=1)


def temperature_for_target(temperatures: torch.Tensor, top1: torch.Tensor, target: float) -> torch.Tensor:
    """The temperature at which the mean top-1 probability falls to ``target``.

    ``top1``: ``[n, K]`` mean top-1 at each grid temperature (``[K]``, ascending
    from 1). Between the two grid points around the crossing, logit(top1) is
    interpolated linearly in 1/T. 1.0 when already at or below the target at
    T = 1; the top of the grid when still above it there; NaN when ``top1`` is.
    Tensor ops only (no host sync).
    """
    k_max = temperatures.numel() - 1
    f = torch.cummin(top1, dim=-1).values.clamp(1e-6, 1.0 - 1e-6)  # monotone in T
    above = (f > target).sum(-1, keepdim=True)
    hi = above.clamp(1, k_max)
    lo = hi - 1
    logit = torch.logit(f)
    l_lo, l_hi = logit.gather(-1, lo), logit.gather(-1, hi)
    beta = temperatures.reciprocal().expand_as(f)
    b_lo, b_hi = beta.gather(-1, lo), beta.gather(-1, hi)
    frac = ((math.log(target / (1.0 - target)) - l_lo) / (l_hi - l_lo)).nan_to_num_(1.0).clamp_(0.0, 1.0)
    t = (b_lo + frac * (b_hi - b_lo)).reciprocal()
    t = torch.where(above == 0, torch.ones_like(t), t)
    t = torch.where(above > k_max, temperatures[-1].expand_as(t), t)
    return torch.where(top1[:, :1].isnan(), top1[:, :1], t).squeeze(-1)
