"""Loss accounting under DTensor tensor parallelism (``parallelize_module``).

- Per-token losses (and logits) that are ``Replicate`` DTensors: every rank holds all of
  the tensor, so the rank-local tensor is read as it is; the gradient that reaches them
  in the backward is a DTensor too, read the same way when it is replicated (a
  ``Partial`` gradient is a piece of a sum: withheld, named).
- Per-token losses sharded over the ranks (``Shard`` on a token dim, sequence parallel):
  each rank holds other tokens, which the user's mask and modality tags do not say:
  withheld, named, never read as all of the batch.
- Logits sharded on the vocabulary (``Shard(-1)``: a ``ColwiseParallel`` head with
  ``use_local_output=False``, its loss under ``loss_parallel()``): no rank's piece of a
  token's gradient gives its weight. :func:`vocab_group` makes, at attach, a process group
  of the monitor's own over the mesh dim the head's weight is split on (``new_group`` is
  collective: every rank makes it); on report steps the logits' hook gathers over it,
  per position, each shard's smallest and largest gradient entry with the logits there
  (:func:`recover_shards`), from which the weights are read exactly as on whole logits.
"""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.megatron import private_group
from trainvitals.hooks.signals.loss.binning import output_norms
from trainvitals.hooks.signals.loss.logits import BYTES_PER_CHECKED_LOGIT, Recovered, recovered
from trainvitals.hooks.signals.softmax.maths import subsample_stride
from trainvitals.hooks.tensors import is_dtensor

__all__ = ["VocabShards", "recover_shards", "token_layout_problem", "vocab_group", "vocab_split"]


def token_layout_problem(t: torch.Tensor, what: str) -> str:
    """Why a DTensor cannot be read on one rank as the whole tensor ("" when every mesh
    dim replicates it)."""
    placements: Any = getattr(t, "placements", ())
    if all(p.is_replicate() for p in placements):
        return ""
    return (
        f"{what} are a DTensor placed {tuple(placements)} (each rank holds another piece of them), "
        "not read; pass the replicated (or full_tensor()) losses"
    )


class VocabShards:
    """The head's vocabulary split: the mesh dim of its weight's ``Shard(0)`` and the
    monitor's own process group over that dim's ranks (this rank's)."""

    def __init__(self, mesh: Any, dim: int, group: Any) -> None:
        self.mesh, self.dim, self.group = mesh, dim, group
        import torch.distributed as dist

        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)


def vocab_group(head: torch.nn.Module) -> VocabShards | None:
    """The vocabulary split of a DTensor head (its weight ``[V, D]`` sharded on dim 0 along
    one mesh dim, as ``ColwiseParallel`` leaves it), with a group of the monitor's own
    made over that mesh dim (collective: called at attach on every rank), or None."""
    weight = getattr(head, "weight", None)
    if weight is None or not is_dtensor(weight):
        return None
    placements: Any = getattr(weight, "placements", ())
    dims = [d for d, p in enumerate(placements) if p.is_shard() and getattr(p, "dim", None) == 0]
    if len(dims) != 1 or any(p.is_shard() for d, p in enumerate(placements) if d != dims[0]):
        return None
    import torch.distributed as dist

    mesh: Any = getattr(weight, "device_mesh", None)
    if not dist.is_initialized() or mesh.size(dims[0]) <= 1:
        return None
    ranks = tuple(dist.get_process_group_ranks(mesh.get_group(dims[0])))
    return VocabShards(mesh, dims[0], private_group(ranks))


def vocab_split(logits: torch.Tensor, shards: VocabShards | None) -> str | bool:
    """How DTensor ``logits`` are placed: False when every rank holds them whole
    (``Replicate``), True when they are split on the vocabulary along ``shards``' mesh dim
    and whole on the others, else why they cannot be read (a sentence)."""
    placements: Any = getattr(logits, "placements", ())
    if all(p.is_replicate() for p in placements):
        return False
    last = logits.dim() - 1
    split = [d for d, p in enumerate(placements) if p.is_shard()]
    if (
        shards is not None
        and getattr(logits, "device_mesh", None) == shards.mesh
        and split == [shards.dim]
        and placements[shards.dim].dim in (-1, last)
        and all(p.is_replicate() for d, p in enumerate(placements) if d != shards.dim)
    ):
        return True
    return f"is a DTensor placed {tuple(placements)}, not split on the vocabulary by the head's weight"


def recover_shards(
    grad: torch.Tensor,
    logits: torch.Tensor,
    shards: VocabShards,
    dtype: torch.dtype,
    *,
    cap: int,
    period: int,
    chunk_bytes: int,
) -> tuple[Recovered, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~trainvitals.hooks.signals.loss.logits.recover` and
    :func:`~trainvitals.hooks.signals.loss.logits.cross_entropy_residual` on logits split
    on the vocabulary: ``grad`` and ``logits`` [N, V / W] are this rank's shard. Gathered
    over ``shards``' group (one all-gather of ``5 N + C`` values): per position each
    shard's smallest and largest gradient entry with the logit there and its squared
    gradient norm, and per checked position (at most ``cap``, the same stride) its
    log-sum-exp; the label is the smallest entry over the whole vocabulary, the other
    class the largest, so the weights and losses are exactly those of whole logits. The
    residual check rebuilds each shard's part of ``w (p - e_y)`` (the softmax from the
    whole log-sum-exp) and sums it over the group (an all-reduce of 2 values), so every
    rank judges the same. Returns the recovered weights (``target``: -1, never read), the
    residual and the gradient's L1 norm over the checked positions, and each position's
    gradient L2 norm over the vocabulary ([N, 1], for the per-modality output norms)."""
    import torch.distributed as dist

    n, width = grad.shape
    stride = subsample_stride(n, cap, period)
    c = len(range(0, n, stride))
    # The other shards wait in both collectives: a failure here joins them, then raises.
    failure: Exception | None = None
    try:
        g_min, i_min = grad.min(dim=1)
        g_max, i_max = grad.max(dim=1)
        z_min = logits.gather(1, i_min[:, None])[:, 0]
        z_max = logits.gather(1, i_max[:, None])[:, 0]
        square = output_norms(grad, 1).to(dtype).square()  # one fused reduction, no [N, V] temporary
        lse = torch.logsumexp(logits[::stride].float(), dim=1).to(dtype)
        mine = torch.cat([g_min.to(dtype), z_min.to(dtype), g_max.to(dtype), z_max.to(dtype), square, lse])
    except Exception as exc:  # noqa: BLE001
        failure, mine = exc, torch.zeros(5 * n + c, dtype=dtype, device=grad.device)
    everyone = [torch.empty_like(mine) for _ in range(shards.size)]
    dist.all_gather(everyone, mine, group=shards.group)
    sums = torch.zeros(2, dtype=torch.float32, device=grad.device)  # residual, L1 norm
    if failure is None:
        try:
            table = torch.stack(everyone)  # [W, 5 N + C]
            g_y, at_y = table[:, :n].min(dim=0)
            z_y = table[:, n : 2 * n].gather(0, at_y[None])[0]
            g_k, at_k = table[:, 2 * n : 3 * n].max(dim=0)
            z_k = table[:, 3 * n : 4 * n].gather(0, at_k[None])[0]
            norm = table[:, 4 * n : 5 * n].sum(dim=0).sqrt()[:, None].float()
            lse_all = torch.logsumexp(table[:, 5 * n :], dim=0)
            rec = recovered(g_y, z_y, g_k, z_k, torch.full_like(at_y, -1), dtype)
            # the residual of this shard's part of the checked positions
            here = (at_y[::stride] == shards.rank) & rec.label[::stride]  # the label's column is in this shard
            w_rows = rec.weight[::stride]
            step = max(1, chunk_bytes // (BYTES_PER_CHECKED_LOGIT * width))
            # in float32, as on whole logits (cross_entropy_residual): a few roundings per entry
            w_rows, lse_rows = w_rows.float(), lse_all.float()
            for start in range(0, c, step):
                stop = min(start + step, c)
                at = slice(start * stride, (stop - 1) * stride + 1, stride)
                g = grad[at].float()
                w = w_rows[start:stop, None]
                rebuilt = torch.exp(logits[at].float() - lse_rows[start:stop, None]).mul_(w)
                label_w = torch.where(here[start:stop], w_rows[start:stop], 0.0)
                rebuilt.scatter_add_(1, i_min[at][:, None], -label_w[:, None])
                sums[0] += rebuilt.sub_(g).abs_().sum()
                sums[1] += g.abs().sum()
        except Exception as exc:  # noqa: BLE001
            failure = exc
            sums.zero_()
    dist.all_reduce(sums, group=shards.group)
    if failure is not None:
        raise failure
    return rec, sums[0], sums[1], norm
