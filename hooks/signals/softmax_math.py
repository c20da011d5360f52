"""The arithmetic behind the softmax saturation signal (INCIDENTS.md, I5).

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
the same pass as the other statistics, by a histogram on geometric bins (bin 0 is
``[0, GAP_FIRST_EDGE)``, bin ``b >= 1`` is ``[e * r^(b-1), e * r^b)``) holding
the count, mean and variance of the gaps in each bin; a bin's share of the
partition function at ``beta`` is then ``count * exp(-beta mean + beta^2 var / 2)``,
which is exact up to the third cumulant of the gaps inside the bin. Geometric
bins keep ``beta * width`` (the only thing the error depends on) the same at
every scale: at the temperature where a bin matters, ``beta * gap`` is ~ ln V, so
a bin's relative width ``r - 1`` = 10 % makes the third-cumulant error well under
1 % of that bin's mass. The histogram is turned at once into the top-1
probability at each temperature of a fixed grid (``temperature_grid``), so what a
step keeps is one number per grid temperature, summed over positions: bounded
memory whatever the number of calls, and additive. ``temperature_for_target``
interpolates the grid (logit of the mean top-1, linear in 1/T; exact when one
logit gap dominates). Measured against exact bisection on full logits (tests):
mean top-1 at the recommended temperature within 0.005 of the target. When the
vocabulary has at most ``GAP_BINS`` classes the gaps themselves are used (exact).
"""

from __future__ import annotations

import math

import torch

GAP_FIRST_EDGE = 0.05
"""Width of histogram bin 0, in gap units (nats of logit difference at tau)."""
GAP_RATIO = 1.1
"""Ratio between consecutive geometric bin edges (relative bin width 10 %)."""
GAP_BINS = 128
"""Histogram bins; the last one starts at 0.05 * 1.1^126 ~ 8200 and holds everything beyond."""
GAP_CLAMP = 1.0e4
"""Gaps are clamped here: exp(-1e4 / 128) * 2^31 classes is still ~1e-25 of the top-1."""

TEMPERATURE_MAX = 128.0
"""Top of the temperature grid; a mean top-1 still above the target there reports this."""
TEMPERATURE_POINTS = 113
"""Grid points, log-spaced on [1, TEMPERATURE_MAX]: consecutive temperatures 4.4 % apart."""

STATS = ("top1", "saturated_099", "saturated_0999", "jacobian", "entropy")
"""Per-position statistics returned by ``saturation_chunk``, in column order."""
SATURATION_THRESHOLDS = (0.99, 0.999)

# Extra bytes per logit a chunk holds at once: gaps and a scratch buffer (float32,
# 4 + 4) and bin indices (int64, 8); or, with few classes, the per-gap count and
# variance (4 + 4); or, for distillation, two float32 probability buffers. Add the
# logits' own item size for a gathered copy of rows that are not a view.
BYTES_PER_LOGIT = 16
# Bytes per (row, bin, grid temperature) while evaluating the grid: the log-terms
# and logsumexp's exp buffer, float32.
BYTES_PER_GRID_TERM = 8


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


def bin_lower_edges(device: torch.device | str = "cpu") -> torch.Tensor:
    """Lower gap edge of each histogram bin (``[GAP_BINS]``, float32)."""
    b = torch.arange(GAP_BINS - 1, dtype=torch.float64)
    edges = torch.cat([torch.zeros(1, dtype=torch.float64), GAP_FIRST_EDGE * GAP_RATIO ** b])
    return edges.to(device, torch.float32)


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
                   points: int = TEMPERATURE_POINTS) -> int:
    """Positions processed at once so that the extra buffers stay within
    ``chunk_bytes`` (at least one row). ``copies``: row copies of ``itemsize`` bytes
    per logit made when the selected positions are not a view of the input."""
    per_row = ((BYTES_PER_LOGIT + copies * itemsize) * vocab
               + BYTES_PER_GRID_TERM * min(vocab, GAP_BINS) * points)
    return max(1, chunk_bytes // per_row)


class Workspace:
    """Float32 and int64 buffers for up to ``rows`` positions of ``vocab`` classes,
    allocated once per observe call and reused by every chunk (the CPU allocator
    would otherwise page-fault fresh buffers in on each chunk)."""

    def __init__(self, rows: int, vocab: int, device: torch.device, *, index: bool = True):
        self.gaps = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        self.scratch = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        self.index = torch.empty((rows, vocab), dtype=torch.long, device=device) if index else None

    def take(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The buffers' first ``rows`` rows (contiguous views)."""
        return self.gaps[:rows], self.scratch[:rows], None if self.index is None else self.index[:rows]


def gaps(rows: torch.Tensor, inv_temperature: float, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z_max - z) / tau`` per row into the float32 buffer ``out``, clamped to
    ``GAP_CLAMP`` (so masked ``-inf`` logits contribute exactly 0); and the index of
    each row's top-1 (``[r, 1]``)."""
    out.copy_(rows)
    top, top_index = out.max(-1, keepdim=True)
    return out.sub_(top).mul_(-inv_temperature).clamp_(max=GAP_CLAMP), top_index


def exp_outside_top1(u: torch.Tensor, top_index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``exp(-gap)`` into ``out`` and its row sum without the top-1's own ``exp(0) = 1``
    (``[r]``): the mass outside the top-1, kept at full float32 precision even when
    it is 1e-12 (``1 - q`` computed as ``1 - 1/Z`` would round to 0)."""
    torch.neg(u, out=out).exp_()
    out.scatter_(1, top_index, 0.0)
    rest = out.sum(-1)
    out.scatter_(1, top_index, 1.0)
    return rest


def gap_histogram(u: torch.Tensor, scratch: torch.Tensor,
                  index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and variance of the gaps in each geometric bin (each ``[r, GAP_BINS]``).

    ``scratch`` (float32) and ``index`` (int64), shaped like ``u``, are overwritten.
    Variances are accumulated from offsets to the bin's lower edge, so float32
    keeps them.
    """
    r, v = u.shape
    inv_log_ratio = 1.0 / math.log(GAP_RATIO)
    b = torch.log(u, out=scratch).mul_(inv_log_ratio).add_(1.0 - math.log(GAP_FIRST_EDGE) * inv_log_ratio)
    # gap 0 -> log 0 = -inf -> bin 0 after the clamp; NaN gaps (NaN logits) -> bin 0.
    b.floor_().clamp_(0.0, GAP_BINS - 1).nan_to_num_(0.0)
    idx = index.copy_(b)
    edges = bin_lower_edges(u.device)
    offset = torch.index_select(edges, 0, idx.view(-1), out=scratch.view(-1)).view(r, v)
    offset = torch.sub(u, offset, out=scratch)
    count = u.new_zeros(r, GAP_BINS).scatter_add_(1, idx, u.new_ones(1, 1).expand(r, v))
    first = u.new_zeros(r, GAP_BINS).scatter_add_(1, idx, offset)
    second = u.new_zeros(r, GAP_BINS).scatter_add_(1, idx, offset.square_())
    n = count.clamp(min=1.0)
    mean_offset = first / n
    var = (second / n).sub_(mean_offset.square()).clamp_(min=0.0)
    return count, mean_offset.add_(edges), var


def top1_on_grid(count: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                 betas: torch.Tensor) -> torch.Tensor:
    """Top-1 probability at each ``beta`` (``[r, K]``) from binned gaps ``[r, bins]``:
    ``1 / sum_b count_b exp(-beta mean_b + beta^2 var_b / 2)``. Exact when every bin
    holds one gap (count 1, variance 0)."""
    terms = mean.unsqueeze(-1) * betas.neg()
    terms.addcmul_(var.unsqueeze(-1), betas.square() / 2)
    terms.add_(count.log().unsqueeze(-1))
    return torch.logsumexp(terms, dim=1).neg_().exp_()


def saturation_chunk(rows: torch.Tensor, inv_temperature: float, betas: torch.Tensor,
                     workspace: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics of one chunk of positions.

    ``rows``: ``[r, V]`` logits, any float dtype (computed in float32 in
    ``workspace``). ``betas``: ``tau / T`` for each grid temperature ``T``.
    Returns ``([r, len(STATS)], [r, K])``: top-1 probability, whether it is above
    0.99 and 0.999, ``q (1 - q)``, entropy in nats; top-1 probability at each grid
    temperature.
    """
    u, e, index = workspace.take(rows.shape[0])
    _, top_index = gaps(rows, inv_temperature, out=u)
    rest = exp_outside_top1(u, top_index, out=e)  # Z = 1 + rest
    top1 = (1.0 + rest).reciprocal()
    not_top1 = rest * top1                        # 1 - q, exact for tiny rest
    entropy = torch.log1p(rest) + e.mul_(u).sum(-1) * top1  # H = log Z + E_p[gap]
    stats = torch.stack([top1, *((top1 > t).float() for t in SATURATION_THRESHOLDS),
                         top1 * not_top1, entropy], dim=1)
    if index is None:  # few classes: every gap is its own bin (exact)
        grid = top1_on_grid(torch.ones_like(u), u, torch.zeros_like(u), betas)
    else:
        grid = top1_on_grid(*gap_histogram(u, e, index), betas)
    return stats, grid


def saturation_workspace(rows: int, vocab: int, device: torch.device) -> Workspace:
    """The buffers ``saturation_chunk`` needs (no index buffer when every gap is its own bin)."""
    return Workspace(rows, vocab, device, index=vocab > GAP_BINS)


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
    p, teacher, _ = workspace.take(student_rows.shape[0])
    gaps(student_rows, inv_temperature, out=p)[0].neg_().exp_()
    p.div_(p.sum(-1, keepdim=True))
    teacher_gaps, top_index = gaps(teacher_rows, inv_temperature, out=teacher)
    rest = exp_outside_top1(teacher_gaps, top_index, out=teacher)
    teacher.div_((1.0 + rest).unsqueeze(-1))
    dark = rest / (1.0 + rest)
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
