"""Data-parallel plumbing: who we are, and the one packed collective per report."""

from __future__ import annotations

import torch

from trainvitals.hooks.step import StepContext


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def combine(ctx: StepContext) -> None:
    """Run the context's cross-rank reductions, then their callbacks.

    All partials of one report are packed into a single vector and exchanged with
    one all-gather; sum, max and min are then taken locally from
    the gathered ``[world, n]`` matrix, so the three ops cost one collective.
    """
    reduces, ctx.reduces = ctx.reduces, []
    if not reduces:
        return
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        for r in reduces:
            r.then(r.tensor)
        return
    device = ctx.device
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    packed = torch.cat([r.tensor.to(device, torch.float64) for r in reduces])
    world = dist.get_world_size()
    gathered = torch.empty(world * packed.numel(), dtype=packed.dtype, device=device)
    # all_gather_single is the newer name (torch 2.13 warns on the old one).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, packed)
    gathered = gathered.view(world, -1)
    offset = 0
    for r in reduces:
        block = gathered[:, offset : offset + r.tensor.numel()]
        offset += r.tensor.numel()
        if r.op == "sum":
            out = block.sum(0)
        elif r.op == "max":
            out = block.amax(0)
        else:
            out = block.amin(0)
        r.then(out.to(ctx.device, torch.float32))
