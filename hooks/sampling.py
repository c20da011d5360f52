"""Deterministic samples of large tensors, so no statistic ever copies a whole model.

Two shapes of sample, both fixed by the tensor's size alone (the same elements every
report, so changes between reports compare like with like):

- :class:`StridedSample`: every ``stride``-th element, at most ``cap`` per tensor
  (the sign ring of the 1D drift consistency, over values already gathered).
- :class:`BlockSample`: evenly spaced runs of ``width`` contiguous elements. A single
  strided element costs a cache miss each; a run of 16 float32 is one 64-byte line,
  so large tensors are sampled this way (Adam's moments; and, through
  :class:`TensorsSample`, the parameters behind ``update_ratio``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainvitals.hooks.tensors import flat

__all__ = ["BLOCK_WIDTH", "BlockSample", "StridedSample", "TensorsSample", "owner_index", "stride_for"]

BLOCK_WIDTH = 16
"""Elements per sampled run: one 64-byte cache line of float32."""


def stride_for(numel: int, cap: int) -> int:
    """Stride of a deterministic sample of at most ``cap`` elements out of ``numel``."""
    return max(1, -(-numel // cap))


def owner_index(sizes: Sequence[int], device: torch.device, owner_of: Sequence[int] | None = None) -> torch.Tensor:
    """For tensors of ``sizes`` elements laid end to end: element -> the index of its
    tensor (or ``owner_of[tensor]``)."""
    owner = torch.tensor(list(owner_of) if owner_of is not None else range(len(sizes)), dtype=torch.long)
    return torch.repeat_interleave(owner, torch.tensor(list(sizes), dtype=torch.long)).to(device)


class StridedSample:
    """Every ``stride``-th element of each of several tensors, at most ``cap`` each,
    laid end to end. ``counts`` are the tensors' element counts (complex as pairs)."""

    def __init__(self, counts: Sequence[int], cap: int) -> None:
        self.counts = list(counts)
        self.strides = [stride_for(c, cap) for c in self.counts]
        self.sizes = [-(-c // s) for c, s in zip(self.counts, self.strides, strict=True)]
        self.dense = all(s == 1 for s in self.strides)
        """True when every element is kept (the sample is the tensors themselves)."""

    def take(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The sampled elements of ``tensors``, end to end, as float32 on ``device``."""
        if not tensors:
            return torch.zeros(0, device=device)
        return torch.cat(
            [
                flat(t.detach())[::s].to(device, torch.float32, non_blocking=True)
                for t, s in zip(tensors, self.strides, strict=True)
            ]
        )

    def take_from(self, values: torch.Tensor) -> torch.Tensor:
        """The sample of tensors already laid end to end in ``values`` (1-D)."""
        if self.dense:
            return values
        parts, start = [], 0
        for n, s in zip(self.counts, self.strides, strict=True):
            parts.append(values[start : start + n : s])
            start += n
        return torch.cat(parts)

    def owners(self, device: torch.device, owner_of: Sequence[int] | None = None) -> torch.Tensor:
        """Sampled element -> the index of the tensor it came from (or ``owner_of[tensor]``)."""
        return owner_index(self.sizes, device, owner_of)


class BlockSample:
    """``blocks`` runs of ``width`` contiguous elements, ``spacing`` apart, out of one tensor."""

    def __init__(self, numel: int, cap: int, width: int = BLOCK_WIDTH) -> None:
        self.width = min(width, cap)
        self.blocks = cap // self.width
        self.spacing = numel // self.blocks
        self.size = self.blocks * self.width

    @staticmethod
    def plan(numel: int, cap: int) -> BlockSample | None:
        """A block sample for a tensor of ``numel`` elements, or None to take every element."""
        return None if numel <= cap else BlockSample(numel, cap)


class TensorsSample:
    """A sample of each of several tensors, laid end to end: every element of a tensor
    of at most ``cap`` elements, a :class:`BlockSample` of ``cap`` elements of a larger
    one. ``counts`` are the tensors' element counts (complex as pairs)."""

    def __init__(self, counts: Sequence[int], cap: int) -> None:
        self.blocks = [BlockSample.plan(c, cap) for c in counts]
        self.sizes = [c if b is None else b.size for c, b in zip(counts, self.blocks, strict=True)]

    def views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's sample as a view (no copy): ``[n]`` whole, or ``[blocks, width]``."""
        out = []
        for t, b in zip(tensors, self.blocks, strict=True):
            x = flat(t)  # callers run under no_grad (the report path)
            out.append(x if b is None else x.as_strided((b.blocks, b.width), (b.spacing, 1), x.storage_offset()))
        return out

    def take(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The sampled elements, end to end, as float32 on ``device`` (one copy)."""
        if not tensors:
            return torch.zeros(0, device=device)
        flat_views = [v.reshape(-1) for v in self.views(tensors)]
        return torch.cat(flat_views).to(device, torch.float32, non_blocking=True)

    def owners(self, device: torch.device, owner_of: Sequence[int] | None = None) -> torch.Tensor:
        """Sampled element -> the index of the tensor it came from (or ``owner_of[tensor]``)."""
        return owner_index(self.sizes, device, owner_of)

    def destinations(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``out`` (1-D, ``sum(sizes)`` elements) shaped like each tensor's
        :meth:`views`, for :meth:`take_into`; made once per buffer."""
        parts = out.split(self.sizes)
        return [p if b is None else p.view(b.blocks, b.width) for p, b in zip(parts, self.blocks, strict=True)]

    def sources(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``tensors`` shaped like :meth:`destinations`: what :meth:`take_into`
        copies. They stay valid while each tensor keeps its storage (a caller may keep
        them; a view of a non-contiguous tensor is a copy, so only contiguous ones are kept
        fresh that way)."""
        sources = []
        for t, b in zip(tensors, self.blocks, strict=True):
            if b is None:
                sources.append(flat(t))
            else:  # the block view straight from the tensor when its storage is its layout
                x = t if t.is_contiguous() and not t.is_complex() else flat(t)
                sources.append(x.as_strided((b.blocks, b.width), (b.spacing, 1), x.storage_offset()))
        return sources

    def take_into(self, tensors: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
        """Copy the sampled elements of ``tensors`` into ``destinations`` (from
        :meth:`destinations`) with one foreach call: no temporary per tensor."""
        torch._foreach_copy_(list(destinations), self.sources(tensors))
