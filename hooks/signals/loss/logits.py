"""Zero-code loss accounting: every token's loss weight read from the gradient at the logits.

For a cross-entropy loss ``L = sum_t w_t * CE(z_t, y_t)`` the gradient that reaches
token t's logits during the user's own backward is ``g_t = w_t (p_t - e_{y_t})``
(``p_t = softmax(z_t)``). So, with no labels and no change to the loss:

- the label is the one negative entry: ``y_t = argmin_j g_tj``; positions the loss
  ignores have ``g_t = 0`` and drop out (no negative entry: not a label token);
- the weight is ``w_t = ||g_t||_1 / (2 (1 - p_{t,y_t}))``. Evaluating it that way
  needs the softmax over the whole vocabulary at every position. Instead, with
  ``k = argmax_j g_tj`` (any class other than the label: ``g_tk = w_t p_tk``),
  ``w_t p_{t,y} = g_tk * exp(z_ty - z_tk)``, so ``w_t = g_tk exp(z_ty - z_tk) - g_ty``:
  two reductions over the gradient (min and max with their indices) and four
  gathers, no exponential over the vocabulary, and no cancellation (both terms are
  positive; accurate when ``p_y`` is close to 1, where ``1 - p_y`` is not);
- the per-token loss is ``-log p_{t,y} = log w_t - log(w_t p_{t,y})``.

These feed the same per-step sums as ``track_loss`` (:mod:`loss_binning`), so the two
give equal figures on the same job by construction.

The formulas hold for a plain cross-entropy gradient only. A label-smoothed loss,
a distillation term on the same logits or a soft-capping between the hooked tensor
and the loss (Gemma 2) give another gradient; :func:`cross_entropy_residual` tells
them apart on a subsample of positions (at most ``logits_max_positions``, a fixed
stride as the softmax signal takes them): it rebuilds ``w_t (p_t - e_{y_t})`` with the
full softmax and compares it with the gradient in L1. A z-loss (``c * lse(z)^2``)
leaves the recovered weights exact (its gradient ``2 c lse p`` is proportional to
``p``: ``w`` is still read right) and is flagged only when it is large enough to show
against the rounding of the gradient's dtype.

Pure tensor functions; no host sync, no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainvitals.hooks.signals.softmax.maths import subsample_stride

__all__ = [
    "CE_RTOL",
    "Recovered",
    "cross_entropy_residual",
    "recover",
    "recovered",
    "residual_tolerance",
    "uniform_tolerance",
]

CE_RTOL = 1e-4
"""Relative L1 residual below which a float32 gradient counts as plain cross-entropy:
the rebuilt ``w (p - e_y)`` differs from the autograd one by a few float32 roundings
per entry (~1e-6 relative); label smoothing 0.1 leaves ~5e-2, a distillation term
more."""

BYTES_PER_CHECKED_LOGIT = 16
"""Work buffers of the residual check per logit: float32 logits, gradient, softmax
and difference."""


def residual_tolerance(dtype: torch.dtype) -> float:
    """Relative L1 residual tolerated for a gradient of ``dtype``: a bfloat16 gradient is
    rounded to 2^-9 relative per entry, so the residual of a true cross-entropy
    gradient is ~0.2% of its L1 norm; 4 machine epsilons (3.1% for bfloat16, 0.4% for
    float16) keep it from reading as another loss."""
    return max(CE_RTOL, 4 * torch.finfo(dtype).eps)


def uniform_tolerance(dtype: torch.dtype, base: float) -> float:
    """Relative spread within which recovered weights count as equal: ``base`` (the
    track_loss tolerance) or, for a low-precision gradient, 4 epsilons of its dtype
    (each recovered weight carries two roundings of 2^-9 in bfloat16)."""
    return max(base, 4 * torch.finfo(dtype).eps)


@dataclass
class Recovered:
    """Per position of one micro-batch's logits [N, V], in ``dtype``."""

    weight: torch.Tensor  # [N] w_t, 0 where the position is not a label token
    loss: torch.Tensor  # [N] -log p_{t,y_t}, 0 where not a label token
    label: torch.Tensor  # [N] bool: the gradient has a negative entry (a label token)
    target: torch.Tensor  # [N] long: argmin_j g_tj


def recover(grad: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype) -> Recovered:
    """Weights, losses and label tokens from the gradient ``grad`` [N, V] at ``logits``
    [N, V] (see the module docstring); two passes over the gradient."""
    g_min, target = grad.min(dim=1)
    g_max, other = grad.max(dim=1)
    z_y = logits.gather(1, target[:, None])[:, 0]
    z_k = logits.gather(1, other[:, None])[:, 0]
    return recovered(g_min, z_y, g_max, z_k, target, dtype)


def recovered(
    g_y: torch.Tensor, z_y: torch.Tensor, g_k: torch.Tensor, z_k: torch.Tensor, target: torch.Tensor, dtype: torch.dtype
) -> Recovered:
    """:func:`recover` from each position's smallest gradient entry ``g_y`` (the label's
    when negative) and largest ``g_k``, with the logits ``z_y``, ``z_k`` there."""
    label = g_y < 0
    z_y, z_k, g_y, g_k = z_y.to(dtype), z_k.to(dtype), g_y.to(dtype), g_k.to(dtype)
    w_py = g_k * torch.exp(z_y - z_k)  # w_t * p_{t,y}
    weight = torch.where(label, w_py - g_y, 0.0)
    loss = torch.where(
        label, torch.log(torch.where(label, weight, 1.0)) - torch.log(torch.where(label, w_py, 1.0)), 0.0
    )
    return Recovered(weight=weight, loss=loss, label=label, target=target)


def cross_entropy_residual(
    grad: torch.Tensor, logits: torch.Tensor, rec: Recovered, *, cap: int, period: int, chunk_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """L1 distance between ``grad`` [N, V] and the cross-entropy gradient rebuilt from
    the recovered weights and labels, and the gradient's own L1 norm, both summed over
    at most ``cap`` positions (a fixed stride, coprime with ``period``: the sequence
    length). A position without a label token rebuilds to 0, so any gradient there
    counts as residual. Rows are processed in chunks of ``chunk_bytes``."""
    n, vocab = grad.shape
    stride = subsample_stride(n, cap, period)
    g_rows, z_rows = grad[::stride], logits[::stride]
    w_rows = rec.weight[::stride].float()
    y_rows = rec.target[::stride]
    count = g_rows.shape[0]
    step = max(1, chunk_bytes // (BYTES_PER_CHECKED_LOGIT * vocab))
    residual = torch.zeros((), dtype=torch.float32, device=grad.device)
    scale = torch.zeros((), dtype=torch.float32, device=grad.device)
    for start in range(0, count, step):
        stop = min(start + step, count)
        g = g_rows[start:stop].float()
        w = w_rows[start:stop, None]
        rebuilt = torch.softmax(z_rows[start:stop].float(), dim=1).mul_(w)
        rebuilt.scatter_add_(1, y_rows[start:stop, None], -w)
        residual += rebuilt.sub_(g).abs_().sum()
        scale += g.abs().sum()
    return residual, scale
