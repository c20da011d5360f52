"""The arithmetic behind the softmax saturation signal (docs/incidents.md, I5).

Pure functions on tensors: no monitor, no state, no host sync. The signal
(``softmax.py``) feeds them row chunks of logits and combines what they return.

Units: for the logits ``z`` of one position, ``u_j = z_max - z_j`` (>= 0; the
top-1 class has 0) is a class's *gap*. At a temperature ``T`` (``beta = 1 / T``)
the partition function relative to the top-1 is ``Z(beta) = sum_j exp(-beta u_j)``
and the top-1 probability is ``1 / Z``. Work is in base 2 (``exp2`` costs half of
``exp`` on a CPU): ``g_j = -u_j beta log2(e)``, ``exp(-beta u_j) = 2^g_j``.

Cost (why the module looks like this): on a CPU every elementwise pass is paid per
logit. Measured on one thread of the development machine: ``exp2`` ~0.53 ns per
logit, ``exp`` ~1.0, a subtraction, multiplication, division or sum ~0.1-0.2, and
anything that finds or uses a class index (``argmax``, ``max`` with indices, a
comparison into a bool mask, a scatter-add) ~1 ns. So the statistics take one
``exp2`` pass and eight cheap ones and never look for the top-1's index; the
per-logit histogram of gaps this module used before (a scatter-add per logit per
moment, ~20 passes) cost ~12 ns per logit.

Statistics (``saturation_chunk``, every kept position): ``g`` at the observed
``tau``, ``e = 2^g``, ``Z = sum e`` and ``D = sum e g`` (the top-1 adds 0 to D).
``q = 1 / Z``, ``1 - q = (Z - 1) / Z`` and the entropy ``H = ln Z - D ln 2 / Z``.
``Z`` is a float32 sum that holds the top-1's exact 1.0, so on its own ``Z - 1``
is good to ~5e-7 absolute only (measured): the mass outside the top-1 is summed
apart, as ``(e g) / g`` (``e`` again, and ``0 / 0 = NaN`` at the top-1 and its
ties, which ``nansum`` skips; 0.3 ns per logit, less than a float64 sum), and
``Z`` only counts the ties. So ``1 - q`` and ``ln Z`` keep float32's relative
precision down to 1.2e-38 (the tangent below needs it as much as the statistics).

Recommended temperature (``temperature_chunk``, ``knot_logs``, ``top1_on_grid``):
the temperature whose mean top-1 over the positions of a step is
``softmax_target`` needs ``Z(beta)`` at many ``beta``, pooled over every call of
the step, in bounded memory. Per position, the mass outside the top-1 is computed
exactly at 20 *knots* ``beta = k / 64``, ``k`` in ``CHAIN_POWERS`` (T = 64, 32,
21.3, 16, 12.8, ..., 1.14, 1; neighbours at most 1.5x apart, 1.14-1.33x below
T = 16): one ``exp2`` pass gives ``r = 2^(g / 64)``, and ``r^k`` follows by
multiplication (``r^2, r^3, r^4, r^5, r^7``) and squaring (four chains side by
side: ``r^2^j``, ``3 2^j``, ``5 2^j``, ``7 2^j``), 19 multiplications, each
summed. Going up from the smallest ``beta`` keeps every small value that matters
at high T (going down from ``exp(-u)`` would lose the ones that underflowed).
Between knots, ``h(beta) = ln(Z(beta) - 1)`` (convex and decreasing in beta;
linear when one logit gap dominates) is interpolated per position by a
shape-preserving cubic (PCHIP: monotone, exact on lines) and turned into the top-1
probability on the fixed grid of ``temperature_grid`` (64 temperatures
log-spaced on [1, 64]). A step keeps one number per grid temperature summed over
positions (bounded and additive), and ``temperature_for_target`` interpolates the
crossing. Against exact bisection on full logits (tests: Gaussian, one-hot
margins, mixed margins, Gumbel, Zipf-like power laws of several sharpnesses, a
runner-up close to the top over a far bulk, two scales, masked classes; 50 to
8192 classes) the mean top-1 at the recommended temperature is within 0.002 of the
target. Coarser knots were measured and rejected: the 7 octaves alone (squaring
only) were off by up to 0.1 on Zipf-like rows, 12 knots (``r^2^j``, ``3 2^j``) by
0.009 when a runner-up 3 nats below the top sits over a bulk 30 nats below.

The knots cost ~5 ns per logit, 3x the statistics, so they are taken on a
sub-sample of the kept positions (every ``sub``-th, at least
``temperature_positions(cap)`` of them: 32, or 1 in 8 above a cap of 256), and
the other kept positions still count through a control variate: from its
statistics pass, every kept position has ``h`` and its slope at
``beta_s = 1 / tau`` (``dh/dbeta = -E[u]`` over the classes outside the top-1,
``D`` over ``Z - 1``), hence a tangent line ``h(beta_s) + h'(beta_s) (beta -
beta_s)`` and a first-order top-1 curve ``x(beta)`` (exact for one dominant gap,
``covariate_on_grid``). The mean top-1 at each grid temperature is estimated as
``mean_all x + mean_sub (q - x)``: exactly ``mean q`` when the sub-sample is every
kept position (at most 32 kept), and otherwise only the residual ``q - x`` is
sampled. Measured with 29 knot positions of 86 kept (Gaussian bulk and margins):
the mean top-1 over all 86 at the recommended temperature within 0.002 of the
target for tau = 1 and 2 (bisection on the 29 alone: up to 0.06 off), 0.015 for
tau = 0.5 (a tangent taken at beta 2, far from the crossing); on heterogeneous
Zipf-like rows at tau = 1, 0.01 rms (0.016 at most; 0.0004 at tau = 2, whose
tangent sits near the crossing).
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32 (1.2e-38)

TEMPERATURE_MAX = 64.0
"""Top of the temperature grid; a mean top-1 still above the target there reports this."""
TEMPERATURE_POINTS = 64
"""Grid points, log-spaced on [1, TEMPERATURE_MAX]: consecutive temperatures 6.8 % apart."""

CHAIN_POWERS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
"""Knots of the per-position temperature summary: ``beta = k / CHAIN_BASE`` (T = 64 / k)."""
CHAIN_BASE = 64

TEMPERATURE_POSITIONS = 32
"""Fewest kept positions per call that the knots are computed on (all when fewer; the
stride is ``subsample_stride`` over the kept positions, coprime with T)."""
TEMPERATURE_SHARE = 8
"""With a larger position cap, the knots are computed on 1 in this many kept positions."""

STATS = ("top1", "saturated_099", "saturated_0999", "jacobian", "entropy")
"""Per-position statistics of ``saturation_stats``, in column order (then the tangent,
``h(beta_s)`` and ``h'(beta_s)``, and the tie count)."""
SATURATION_THRESHOLDS = (0.99, 0.999)

BYTES_PER_LOGIT = 8
"""Extra bytes per logit a chunk holds at once: two float32 buffers (gaps and
exponentials; or, for half the chunk's rows, the four power chains; or, for
distillation, the student's and the teacher's probabilities), and never less than
one position's four chains (``workspace_bytes``). Add the logits' own item size for a
gathered copy of rows that are not a view."""
CPU_CHUNK_BYTES = 4 * 1024 * 1024
"""Chunk bound on a CPU (cache-sized), when below ``softmax_chunk_bytes``."""


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


def temperature_grid(
    device: torch.device | str = "cpu", *, t_max: float = TEMPERATURE_MAX, points: int = TEMPERATURE_POINTS
) -> torch.Tensor:
    """Candidate temperatures, log-spaced from 1 to ``t_max`` (float32, ``[points]``)."""
    return torch.logspace(0.0, math.log10(t_max), points, dtype=torch.float64).to(device, torch.float32)


def knot_betas() -> tuple[float, ...]:
    """Inverse temperatures of the knots, ascending (``k / 64``)."""
    return tuple(k / CHAIN_BASE for k in CHAIN_POWERS)


def subsample_stride(positions: int, cap: int, period: int = 1) -> int:
    """Row stride that keeps at most ``cap`` of ``positions``; for [B, T] positions
    (``period`` = T) it is made coprime with T, so the sample walks through every
    position in the sequence instead of repeating one phase."""
    stride = max(1, -(-positions // cap))
    if stride > 1 and period > 1:
        while math.gcd(stride, period) != 1:
            stride += 1
    return stride


def temperature_positions(cap: int) -> int:
    """How many of a call's kept positions (at most ``cap``) the knots are computed on."""
    return max(TEMPERATURE_POSITIONS, cap // TEMPERATURE_SHARE)


def rows_per_chunk(
    vocab: int, chunk_bytes: int, *, copies: int = 0, itemsize: int = 4, device: torch.device | str = "cpu"
) -> int:
    """Positions processed at once so that the extra buffers stay within
    ``chunk_bytes`` (at least one row). ``copies``: row copies of ``itemsize`` bytes
    per logit made when the selected positions are not a view of the input. On a
    CPU, chunks are kept to ``CPU_CHUNK_BYTES`` so that the passes over a chunk run
    from cache; an accelerator gets the whole bound (fewer, larger kernels)."""
    if torch.device(device).type == "cpu":
        chunk_bytes = min(chunk_bytes, CPU_CHUNK_BYTES)
    per_row = (BYTES_PER_LOGIT + copies * itemsize) * vocab
    return max(1, chunk_bytes // per_row)


def workspace_bytes(rows: int, vocab: int) -> int:
    """Bytes of the ``Workspace`` for chunks of ``rows`` positions."""
    return max(2 * rows, 4) * vocab * 4


class Workspace:
    """Float32 buffers for ``rows`` positions of ``vocab`` classes at 8 bytes per
    logit (at least four rows' worth), allocated once per observe call and reused by
    every chunk (the CPU allocator would otherwise page-fault fresh buffers in on
    each chunk)."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str):
        self.rows, self.vocab = rows, vocab
        self.storage = torch.empty(max(2 * rows, 4) * vocab, dtype=torch.float32, device=device)

    def take(self, rows: int) -> torch.Tensor:
        """``[2, rows, vocab]`` (rows <= the workspace's rows)."""
        return self.storage[: 2 * rows * self.vocab].view(2, rows, self.vocab)

    def chains(self, rows: int) -> torch.Tensor:
        """``[4, rows, vocab]`` (rows <= ``chain_rows``)."""
        return self.storage[: 4 * rows * self.vocab].view(4, rows, self.vocab)

    @property
    def chain_rows(self) -> int:
        """Positions ``temperature_chunk`` takes at once: half the chunk, at least one."""
        return max(1, self.rows // 2)


def _log2_gaps(rows: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``(z - z_max) * scale`` per row into the float32 buffer ``out`` (<= 0; exactly 0
    at the top-1 and its ties; -inf for -inf logits; NaN rows stay NaN). The
    difference is taken before scaling, so it is exact whatever the logits' offset."""
    if rows.dtype == torch.float32:
        torch.sub(rows, rows.amax(-1, keepdim=True), out=out)
    else:  # half types: converting first is faster than mixed-dtype passes (and exact)
        out.copy_(rows)
        out.sub_(out.amax(-1, keepdim=True))
    return out.mul_(scale)


def saturation_chunk(
    rows: torch.Tensor, inv_temperature: float, workspace: Workspace, out: torch.Tensor
) -> torch.Tensor:
    """Per-position sums of one chunk into ``out`` (``[3, r]``, float32): ``Z``, ``D``
    and the mass outside the top-1 and its ties (see the module docstring), at
    ``beta_s = inv_temperature``. ``rows``: ``[r, V]`` logits, any float dtype
    (computed in float32). ``saturation_stats`` turns them into statistics."""
    r = rows.shape[0]
    e, g = workspace.take(r)
    _log2_gaps(rows, inv_temperature * LOG2E, out=g)
    torch.exp2(g, out=e)
    torch.sum(e, -1, out=out[0])  # holds the top-1's 1.0: Z - 1 to ~5e-7 only
    # D = sum e g: the top-1 adds 0; -inf classes add 0 * -inf = NaN (skipped)
    torch.nansum(e.mul_(g), -1, out=out[1])
    # (e g) / g gives e back, and 0/0 = NaN at the top-1 and its ties: the rest exactly
    torch.nansum(e.div_(g), -1, out=out[2])
    return out


def saturation_stats(sums: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """Per position ``[n, len(STATS) + 3]`` from ``saturation_chunk``'s sums ``[3, n]``:
    the top-1 probability at the observed temperature, whether it is above 0.99 and
    0.999, ``q (1 - q)``, entropy in nats; then the tangent of
    ``h(beta) = ln(Z(beta) - 1)`` at ``beta_s = inv_temperature`` (absolute beta,
    nats): ``h(beta_s)`` and ``dh/dbeta`` there (``covariate_on_grid``); then the
    number of classes tied with the top-1 besides it."""
    z, d, rest = sums
    # ties: Z - 1 - rest rounded (Z alone is good to ~5e-7, enough to count them)
    ties = torch.sub(z, rest).sub_(1.0).round_().clamp_(min=0.0)
    outside = ties + rest  # Z - 1, exact when tiny
    top1 = outside.add(1.0).reciprocal_()
    not_top1 = outside * top1
    entropy = torch.addcmul(torch.log1p(outside), d, top1, value=-LN2)  # H = ln Z + beta_s E_p[u]
    floor = outside.clamp(min=_TINY)
    # tangent: dh/dbeta = -E[u | outside the top-1] = D ln2 / (beta_s (Z - 1))
    slope = torch.div(d, floor).mul_(LN2 / inv_temperature)
    return torch.stack(
        [
            top1,
            top1 > SATURATION_THRESHOLDS[0],
            top1 > SATURATION_THRESHOLDS[1],
            top1 * not_top1,
            entropy,
            floor.log_(),
            slope,
            ties,
        ],
        dim=1,
    )


def temperature_chunk(rows: torch.Tensor, workspace: Workspace, out: torch.Tensor) -> torch.Tensor:
    """The mass outside the top-1 and its ties at each knot, ``sum r^k`` over the
    other classes, for ``[r, V]`` raw logits (absolute temperature) into ``out``
    (``[len(CHAIN_POWERS), r]``, in ``SUM_POWERS`` order; ``knot_logs`` sorts them).
    ``r`` rows take four ``[r, V]`` float32 buffers (``Workspace.chains``)."""
    w = workspace.chains(rows.shape[0])
    a, b, c, d = w
    g = _log2_gaps(rows, LOG2E / CHAIN_BASE, out=d)
    torch.exp2(g, out=a)  # r = 2^(g / 64)
    a.mul_(g).div_(g)  # r again, but 0/0 = NaN at the top-1 and its ties: they drop out
    torch.mul(a, a, out=b)  # r^2
    torch.mul(b, a, out=c)  # r^3
    torch.mul(b, b, out=d)  # r^4
    torch.nansum(w, -1, out=out[0:4])  # 1, 2, 3, 4
    a.mul_(d)  # r^5
    b.mul_(a)  # r^7
    torch.nansum(w[:2], -1, out=out[4:6])  # 5, 7
    for j in range(3):  # (10, 14, 6, 8) ... (40, 56, 24, 32)
        w.square_()
        torch.nansum(w, -1, out=out[6 + 4 * j : 10 + 4 * j])
    w[2:].square_()  # 48, 64
    torch.nansum(w[2:], -1, out=out[18:20])
    return out


SUM_POWERS = (1, 2, 3, 4, 5, 7, 10, 14, 6, 8, 20, 28, 12, 16, 40, 56, 24, 32, 48, 64)
"""Order of ``temperature_chunk``'s sums (four chains side by side)."""
_KNOT_ORDER = tuple(SUM_POWERS.index(k) for k in CHAIN_POWERS)


def knot_logs(sums: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """``h = ln(Z - 1)`` at the knots, ``[n, len(CHAIN_POWERS)]`` ascending in beta,
    from ``temperature_chunk``'s sums ``[knots, n]`` and the number of classes tied
    with each position's top-1 besides it (``[n]``, ``saturation_stats``' last column;
    1 each at every knot). Nats, at least ``ln(1.2e-38)`` (float32's smallest normal: below it, or when
    everything outside the top-1 underflowed, the position counts as saturated there)."""
    outside = sums.index_select(0, _knot_order(sums.device)).t() + ties.unsqueeze(1)
    return outside.clamp_(min=_TINY).log_()


_KNOT_INDEX: dict[torch.device, torch.Tensor] = {}


def _knot_order(device: torch.device) -> torch.Tensor:
    """``_KNOT_ORDER`` as an index on ``device``, made once per device: indexing a GPU
    tensor with a Python list copies the list to the device on every call, and that copy
    waits for the device."""
    index = _KNOT_INDEX.get(device)
    if index is None:
        index = _KNOT_INDEX[device] = torch.tensor(_KNOT_ORDER, dtype=torch.long).to(device)
    return index


class TemperatureGrid:
    """What every call on one device shares: the grid temperatures ``[K]`` and the
    linear maps that turn knots into top-1 curves on the grid (``top1_on_grid``)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.temperatures = temperature_grid(device)
        x = torch.tensor(knot_betas(), dtype=torch.float64)
        n = len(x)
        beta = temperature_grid("cpu").double().reciprocal()  # [K], descending
        self.betas = beta.to(device, torch.float32)
        steps = x.diff()
        # secants of h between knots: h @ secant, [n, n - 1]
        secant = torch.zeros(n, n - 1, dtype=torch.float64)
        secant[:-1].diagonal().copy_(-1 / steps)
        secant[1:].diagonal().copy_(1 / steps)
        self.secant = secant.to(device, torch.float32)
        # PCHIP weights of the two secants around each interior knot
        self.w_left = (2 * steps[1:] + steps[:-1]).to(device, torch.float32)
        self.w_right = (steps[1:] + 2 * steps[:-1]).to(device, torch.float32)
        # cubic Hermite on each grid point's knot interval, as one matrix applied to
        # [h (n), slopes (n)] -> [K]
        hi = torch.searchsorted(x, beta).clamp_(1, n - 1)
        lo = hi - 1
        width = x[hi] - x[lo]
        t = (beta - x[lo]) / width
        hermite = torch.zeros(2 * n, len(beta), dtype=torch.float64)
        cols = torch.arange(len(beta))
        hermite[lo, cols] = 2 * t**3 - 3 * t**2 + 1
        hermite[n + lo, cols] = (t**3 - 2 * t**2 + t) * width
        hermite[hi, cols] = -2 * t**3 + 3 * t**2
        hermite[n + hi, cols] = (t**3 - t**2) * width
        self.hermite = hermite.to(device, torch.float32)
        self._lines: dict[float, torch.Tensor] = {}

    def tangent_map(self, beta_s: float) -> torch.Tensor:
        """``[2, K]``: [h_s, h'_s] -> the tangent line's value at each grid beta."""
        if beta_s not in self._lines:
            self._lines[beta_s] = torch.stack([torch.ones_like(self.betas), self.betas - beta_s])
        return self._lines[beta_s]


def top1_on_grid(h: torch.Tensor, grid: TemperatureGrid) -> torch.Tensor:
    """Top-1 probability at each grid temperature (``[r, K]``) from ``h`` at the knots
    (``[r, knots]``), by a monotone piecewise-cubic (PCHIP) interpolation of ``h`` in beta."""
    secant = h @ grid.secant  # [r, knots - 1]
    left, right = secant[:, :-1], secant[:, 1:]
    harmonic = (grid.w_left + grid.w_right) / (grid.w_left / left + grid.w_right / right)
    inner = torch.where(left * right > 0, harmonic, 0.0)  # 0 at a local extremum (flat h)
    interpolated = torch.cat([h, secant[:, :1], inner, secant[:, -1:]], dim=1) @ grid.hermite
    return torch.sigmoid(interpolated.neg_())  # q = 1 / (1 + e^h)


def covariate_on_grid(tangent: torch.Tensor, grid: TemperatureGrid, beta_s: float) -> torch.Tensor:
    """First-order top-1 curve ``[r, K]`` from the tangent of ``h`` at ``beta_s``
    (``saturation_stats``' ``h(beta_s)`` and ``h'(beta_s)`` columns):
    ``1 / (1 + exp(h_s + h'_s (beta - beta_s)))``."""
    return torch.sigmoid((tangent @ grid.tangent_map(beta_s)).neg_())


def distillation_chunk(
    student_rows: torch.Tensor, teacher_rows: torch.Tensor, inv_temperature: float, workspace: Workspace
) -> torch.Tensor:
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
    p, teacher = workspace.take(r)
    scale = inv_temperature * LOG2E
    _log2_gaps(teacher_rows, scale, out=teacher)
    top_index = teacher.argmax(-1, keepdim=True)  # gap 0: the teacher's top-1 (the first of ties)
    teacher.exp2_()  # the top-1 is exactly 2^0 = 1
    # 1 - p_T,t from the other classes' sum (the top-1 zeroed, then put back): exact when tiny
    rest = teacher.scatter_(1, top_index, 0.0).sum(-1)
    teacher.scatter_(1, top_index, 1.0)
    z = rest + 1.0
    dark = rest / z
    teacher.div_(z.unsqueeze(-1))
    _log2_gaps(student_rows, scale, out=p).exp2_()
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
