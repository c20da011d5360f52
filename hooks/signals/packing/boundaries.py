"""Where the samples of packed rows begin and end, read from what the job already
passes its model: no tag, no change to the job.

A packed micro-batch holds several samples in one row. The job tells the model where
they are in one of these ways, and the first found wins:

1. a segment-id tensor ``seq_idx`` / ``segment_ids`` [B, T] (``DataCollatorWithFlattening(
   return_seq_idx=True)``, Mamba-style kernels): one id per sample;
2. Megatron's ``packed_seq_params`` (``PackedSeqParams``, THD layout): its
   ``cu_seqlens_q`` over the flattened tokens;
3. cumulative lengths ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (Hugging Face's flash
   kwargs), ``cu_seqlens_q`` / ``cu_seqlens``: sample ``i`` holds the tokens
   ``cu[i]:cu[i + 1]`` of the flattened batch (one row);
4. restarting ``position_ids`` [B, T] (or [T]): a sample starts wherever a position is
   not its predecessor's plus one, the rule transformers uses to build its
   block-diagonal mask (``find_packed_sequence_indices``); a row of plain
   ``0..T-1`` positions is one sample, pads that repeat a position are samples
   without label tokens (they count nowhere). Multimodal rotary positions (Qwen2-VL):
   [4, B, T] lead with the text positions (the same rule); [3, B, T] with the
   temporal ones, which never decrease within a sample: a sample starts where they
   drop.

What cannot be read is said, never guessed: cumulative lengths over a batch of several
rows, or position ids of another shape, give a reason the per-sample figures are
withheld for, instead of figures per row.

Pure tensor functions of the forward's arguments: nothing here reads a value on the
host (no sync); the ids come back on the tensors' device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

__all__ = [
    "CU_FIELDS",
    "SEGMENT_FIELDS",
    "Boundaries",
    "media_codes_per_sample",
    "packed_segments",
    "read_boundaries",
    "segments_from_cu",
    "segments_from_positions",
]

SEGMENT_FIELDS = ("seq_idx", "segment_ids")
"""Forward keywords holding one sample id per position [B, T]."""

CU_FIELDS = ("cu_seq_lens_q", "cu_seqlens_q", "cu_seq_lens_k", "cu_seqlens_k", "cu_seqlens")
"""Forward keywords holding cumulative sample lengths over the flattened batch [n + 1]."""


@dataclass(frozen=True)
class Boundaries:
    """The samples of one forward's rows: ``segments`` [B, T], an id per position (equal
    ids within a row: one sample), read from ``source`` (the keyword); or ``withheld``,
    why they cannot be read (``segments`` is then None)."""

    segments: torch.Tensor | None
    source: str
    withheld: str = ""


def _integer(t: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Sample ids [B, T] from position ids [B, T]: a new sample wherever a position is not
    its predecessor's plus one (transformers' rule for packed rows)."""
    pos = position_ids.long()
    step = torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1)
    return (step != 1).cumsum(-1)


def segments_from_cu(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    """Sample ids [1, tokens] from cumulative lengths ``cu`` [n + 1] (``cu[0] = 0``):
    token ``t`` belongs to sample ``i`` where ``cu[i] <= t < cu[i + 1]``; tokens past
    ``cu[-1]`` (padding) form one more sample."""
    bounds = cu.reshape(-1)[1:].long()
    return torch.searchsorted(bounds, torch.arange(tokens, device=cu.device), right=True)[None]


def read_boundaries(kwargs: dict[str, Any], shape: tuple[int, int] | None) -> Boundaries | None:
    """The samples of a forward of input ids ``shape`` [B, T] from its keyword arguments
    (see the module docstring); None when nothing says where samples are (every row is
    one sample)."""
    for name in SEGMENT_FIELDS:
        seg = kwargs.get(name)
        if _integer(seg) and shape is not None:
            if seg.dim() == 1 and shape[0] == 1:
                seg = seg[None]
            if tuple(seg.shape) == shape:
                return Boundaries(seg, name)
            return Boundaries(None, name, f"{name} has shape {tuple(seg.shape)}, the input ids {shape}")
    params = kwargs.get("packed_seq_params")
    cu_from_params = getattr(params, "cu_seqlens_q", None) if params is not None else None
    found = [("packed_seq_params", cu_from_params)] if cu_from_params is not None else []
    found += [(n, kwargs.get(n)) for n in CU_FIELDS if kwargs.get(n) is not None]
    for name, cu in found:
        if not _integer(cu) or cu.dim() != 1 or shape is None:
            continue
        rows, cols = shape
        if rows != 1:
            return Boundaries(
                None,
                name,
                f"{name} gives cumulative lengths over {rows} rows of {cols} positions: which row a sample "
                "lies in is not said",
            )
        return Boundaries(segments_from_cu(cu, cols), name)
    pos = kwargs.get("position_ids")
    if _integer(pos) and shape is not None:
        if pos.dim() == 3 and pos.shape[0] in (3, 4) and tuple(pos.shape[1:]) in ((1, shape[1]), shape):
            # multimodal rotary positions: [4, B, T] leads with the text positions (the
            # restart rule); [3, B, T] with the temporal ones, which never decrease within
            # a sample (an image's tokens share one): a sample starts where they drop
            first = pos[0].expand(shape[0], -1)
            if pos.shape[0] == 4:
                return Boundaries(segments_from_positions(first), "position_ids")
            drop = torch.diff(first.long(), dim=-1, prepend=first[:, :1].long()) < 0
            return Boundaries(drop.cumsum(-1), "position_ids")
        if pos.dim() == 3:
            return Boundaries(
                None,
                "position_ids",
                f"position_ids of shape {tuple(pos.shape)} for input ids {shape}: where one sample ends is "
                "not read from them",
            )
        if pos.dim() == 1:
            pos = pos[None]
        if pos.dim() == 2 and pos.shape[-1] == shape[1] and pos.shape[0] in (1, shape[0]):
            return Boundaries(segments_from_positions(pos.expand(shape[0], -1)), "position_ids")
    return None


def media_codes_per_sample(ids: torch.Tensor, media: list[tuple[int, int]], segments: torch.Tensor) -> torch.Tensor:
    """Per position [B, T], the modality code of the sample it belongs to: the last media
    modality of ``media`` (``[(text code, -1), (code, token id), ...]``) whose token the
    sample's input ids hold, else text's. A packed row's samples are classed one by one,
    never the row as a whole."""
    from trainvitals.hooks.signals.loss.binning import packed_sample_ids

    sid = packed_sample_ids(segments)  # [B * T], ids in [0, B * T)
    flat = ids.reshape(-1)
    codes = torch.full_like(flat, media[0][0], dtype=torch.long)
    for code, token in media[1:]:
        hits = torch.zeros(flat.shape[0], dtype=torch.int32, device=flat.device)
        hits.index_add_(0, sid, (flat == token).to(torch.int32))
        codes = torch.where(hits[sid] > 0, code, codes)
    return codes.view(ids.shape)


def packed_segments(bounds: Boundaries | None, shape: tuple[int, ...]) -> tuple[torch.Tensor | None, str]:
    """The sample ids for logits over positions ``shape`` and, when the samples cannot
    be known, why (the per-sample figures are then withheld, never made per row)."""
    if bounds is None:
        return None, ""
    if bounds.withheld:
        return None, bounds.withheld
    seg = bounds.segments
    assert seg is not None
    if tuple(seg.shape) != tuple(shape):
        return None, (
            f"the samples read from {bounds.source} cover positions {tuple(seg.shape)}, the logits {tuple(shape)}"
        )
    return seg, ""
