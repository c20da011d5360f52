"""Small batched-tensor helpers shared by the signals (no host syncs here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2), else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    """True for a DTensor whose placements shard it across ranks."""
    placements = getattr(t, "placements", None) or ()
    return any(p.is_shard() for p in placements)


def real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as (real, imaginary) pairs, as Adam treats it; others as they are."""
    return torch.view_as_real(t) if t.is_complex() else t


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``t`` (a copy only when ``t`` is not contiguous); complex as real pairs."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dim() == 1:
        return t
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def float_dtype(device: torch.device) -> torch.dtype:
    """The widest float the device computes in: float64, float32 on MPS (no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def stack_on(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Stack 0-d tensors that may live on several devices onto ``device`` (float32)."""
    if not tensors:
        return torch.zeros(0, device=device)
    if all(t.device == device for t in tensors):
        return torch.stack(list(tensors)).float()
    return torch.stack([t.to(device, non_blocking=True) for t in tensors]).float()


def foreach_norm32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norm of each tensor, accumulated in float32 at least. ``torch._foreach_norm``
    with ``dtype=`` takes a slow path (2.5x on the CPU here), so it is asked only when a
    tensor is in a narrower dtype (bf16/fp16)."""
    tensors = list(tensors)
    if all(t.dtype in (torch.float32, torch.float64) for t in tensors):
        return list(torch._foreach_norm(tensors))
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def norms(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of each tensor, as one float32 vector on ``device``; one foreach call."""
    if not tensors:
        return torch.zeros(0, device=device)
    return stack_on(foreach_norm32(tensors), device)


def group_sum(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum ``values`` into ``groups`` bins by ``index`` (both 1-D, same device)."""
    out = torch.zeros(groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)


def group_amax(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """Largest value per bin (-inf for an empty bin)."""
    out = torch.full((groups,), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, index, values, reduce="amax", include_self=True)


def group_amin(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """Smallest value per bin (+inf for an empty bin)."""
    out = torch.full((groups,), float("inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, index, values, reduce="amin", include_self=True)
