"""Small batched-tensor helpers shared by the signals (no host syncs here)."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2), else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    """True for a DTensor whose placements shard it across ranks."""
    placements = getattr(t, "placements", None) or ()
    return any(splits(p) for p in placements)


def splits(placement: Any) -> bool:
    """A DTensor placement that splits the tensor into distinct pieces over its mesh dim:
    ``Shard``, and FSDP2's ``_StridedShard`` (a dim already split by tensor parallelism,
    sharded again in strides: each rank still holds elements no other rank of that dim
    does), which does not call itself ``is_shard()`` (torch 2.13)."""
    if placement.is_shard():
        return True
    strided = getattr(placement, "split_factor", None) is not None and getattr(placement, "dim", None) is not None
    return strided and not placement.is_replicate() and not placement.is_partial()


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a DTensor (it has a device mesh and placements)."""
    return getattr(t, "device_mesh", None) is not None and getattr(t, "placements", None) is not None


def rank_weight(t: torch.Tensor, world_size: int, spanning: Sequence[Any] = ()) -> float | str:
    """What one rank's partial sums of ``t`` (sums of squares, element counts) count for
    when every rank's are summed over the whole job (``world_size`` ranks): 1 for a
    piece no other rank holds, ``1 / k`` for a piece ``k`` ranks hold alike, so the sum
    over ranks counts every element once. A DTensor: each ``Shard`` mesh dim splits it
    (its pieces add up), each ``Replicate`` one copies it (divides by that dim's size).
    A plain tensor, in a job where others are DTensors, is replicated on every rank
    (``1 / world_size``).

    A DTensor on a mesh smaller than the job: its pieces count ``size / world_size``
    besides (each of the ``world_size / size`` meshes like it holds a copy) only where
    that is known: its mesh is a slice, by dim names, of one of ``spanning`` (meshes the
    model's other parameters span the job on, :func:`spanning_meshes`). The dims it
    leaves out are then dims the model is laid out along, every rank along them holding
    the same modules: FSDP2 puts a tensor-parallel model's plain tensors on the ``dp``
    slice of its ``(dp, tp)`` mesh, and each ``tp`` rank holds a copy. A dim no
    parameter spans (pipeline stages, holding different layers) or an unnamed mesh is
    not reasoned about.

    A layout the sums cannot be combined for (a ``Partial`` placement: the norm of a sum
    of pieces is not the sum of their norms; a mesh not known to be copied over the
    ranks outside it) is returned as a sentence, not a weight."""
    if not is_dtensor(t):
        return 1.0 / world_size
    mesh: Any = getattr(t, "device_mesh", None)
    placements: Any = getattr(t, "placements", ())
    size = mesh.size()
    weight = 1.0
    if size != world_size:
        if not any(_is_slice(mesh, full) for full in spanning):
            names = "/".join(getattr(mesh, "mesh_dim_names", None) or ()) or "unnamed"
            return (
                f"a DTensor on a mesh of {size} ranks in a job of {world_size} (dims {names}), "
                "not a slice of a mesh the model's parameters span the job on"
            )
        weight = size / world_size
    for dim, placement in enumerate(placements):
        if splits(placement):
            continue
        if placement.is_replicate():
            weight /= mesh.size(dim)
            continue
        return f"a DTensor placement {placement!r} on mesh dim {dim}"
    return weight


def spanning_meshes(tensors: Iterable[torch.Tensor], world_size: int) -> list[Any]:
    """The distinct device meshes with named dims that DTensors among ``tensors`` span
    the job on (``world_size`` ranks): what :func:`rank_weight` reads smaller meshes as
    slices of."""
    found: dict[int, Any] = {}
    for t in tensors:
        mesh: Any = getattr(t, "device_mesh", None)
        if is_dtensor(t) and mesh.size() == world_size and getattr(mesh, "mesh_dim_names", None):
            found.setdefault(id(mesh), mesh)
    return list(found.values())


def _is_slice(mesh: Any, full: Any) -> bool:
    """``mesh`` is ``full`` cut down to some of its named dims at this rank's coordinates
    on the others (``full["dp"]`` of a ``(dp, tp)`` mesh): the same ranks, in order."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    full_names = tuple(getattr(full, "mesh_dim_names", None) or ())
    coordinate = full.get_coordinate()
    if not names or coordinate is None or not set(names) < set(full_names) or len(set(names)) != len(names):
        return False
    kept = [n for n in full_names if n in names]
    index = tuple(slice(None) if n in names else coordinate[i] for i, n in enumerate(full_names))
    ranks = full.mesh[index].permute([kept.index(n) for n in names])
    return tuple(ranks.shape) == tuple(mesh.mesh.shape) and bool(torch.equal(ranks, mesh.mesh))


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


def norms(tensors: Sequence[torch.Tensor], device: torch.device, plan: NormPlan | None = None) -> torch.Tensor:
    """L2 norm of each tensor, as one float32 vector on ``device``. ``plan``: a
    :class:`NormPlan` built for tensors of these shapes (cheaper for many small tensors
    on a CPU); without it, one foreach call."""
    if not tensors:
        return torch.zeros(0, device=device)
    if plan is not None:
        return plan.norms(tensors)
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


SMALL_NUMEL = 4096
"""Tensors of at most this many elements are normed by shape groups in :class:`NormPlan`."""
_GROUP_MIN = 8  # fewer tensors of one shape than this: the foreach call is as cheap


class NormPlan:
    """Per-tensor L2 norms of a fixed list of tensor shapes, at a bounded cost per tensor.

    ``torch._foreach_norm`` runs one norm kernel per tensor on a CPU (a fused kernel
    on CUDA), and stacking its 0-d results is another per-tensor step: about 5-7 us a
    tensor measured here whatever its size, so at thousands of small tensors
    (biases, norm scales, the pieces of a sharded model) the count, not the size, is
    the cost. Models repeat their layers, so their small tensors come in few
    shapes: the tensors of at most ``SMALL_NUMEL`` elements that share a shape with
    at least ``_GROUP_MIN - 1`` others are concatenated along their first
    dimension (one ``torch.cat``, which makes no per-tensor Python object: about
    0.5 us a tensor) and normed row-wise in one ``linalg.vector_norm``; the rest
    keep the foreach norm, whose per-tensor cost on a large tensor is below one
    pass over its elements. Float32 results (accumulated in float32 at least, like
    ``foreach_norm32``), in the tensors' order, on ``device``; NaN and inf
    propagate as in the foreach norm.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device):
        self.device = device
        self.count = len(tensors)
        by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
        for i, t in enumerate(tensors):
            if 0 < t.ndim and t.numel() <= SMALL_NUMEL and t.device == device and t.layout == torch.strided:
                by_shape.setdefault((tuple(t.shape), t.dtype), []).append(i)
        self.groups: list[tuple[list[int], torch.Tensor, torch.dtype | None, int]] = []
        grouped: set[int] = set()
        for (shape, dtype), members in by_shape.items():
            if len(members) >= _GROUP_MIN:
                accumulate = None if dtype in (torch.float32, torch.float64) else torch.float32
                total = len(members) * math.prod(shape)
                self.groups.append((members, torch.tensor(members, device=device), accumulate, total))
                grouped.update(members)
        self.rest = [i for i in range(self.count) if i not in grouped]
        self.rest_index = torch.tensor(self.rest, dtype=torch.long, device=device)

    @classmethod
    def cached(cls, slot: list[Any], key: Any, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """``norms`` through a plan kept in ``slot`` (a one-element list the caller owns)
        for as long as ``key`` (what fixes the tensors' shapes, e.g. their parameters'
        ids) stays the same; rebuilt when it changes or the shapes do not fit."""
        entry = slot[0]
        if entry is None or entry[0] != key:
            entry = slot[0] = (key, cls(tensors, device))
        try:
            plan: NormPlan = entry[1]
            return plan.norms(tensors)
        except ValueError:
            entry = slot[0] = (key, cls(tensors, device))
            return entry[1].norms(tensors)

    def norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not self.groups:
            return stack_on(foreach_norm32(tensors), self.device)
        if len(tensors) != self.count:
            raise ValueError(f"NormPlan built for {self.count} tensors, given {len(tensors)}")
        out = torch.empty(self.count, device=self.device)
        for members, index, accumulate, total in self.groups:
            try:
                rows = torch.cat([tensors[i] for i in members])
            except RuntimeError:  # shapes that no longer concatenate
                rows = None
            if rows is None or rows.numel() != total:
                raise ValueError("NormPlan given tensors of other shapes than it was built for")
            rows = rows.view(len(members), -1)
            out.index_copy_(0, index, torch.linalg.vector_norm(rows, dim=1, dtype=accumulate).float())
        if self.rest:
            rest = stack_on(foreach_norm32([tensors[i] for i in self.rest]), self.device)
            out.index_copy_(0, self.rest_index, rest)
        return out


class SparseSum:
    """``out[r] = sum of x[c]`` over given (r, c) pairs: one gather of the pairs'
    columns and one ``index_add`` into their rows (two ops, memory linear in the pairs).
    A non-finite entry reaches only the rows it is summed into: a 0/1 matrix product
    (one op) would multiply every entry by every row's 0 or 1, and 0 x inf is NaN, so
    one infinite gradient would turn every group's figures into NaN."""

    def __init__(self, rows: int, pairs: Sequence[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> None:
        self.rows = rows
        self.dst = torch.tensor([r for r, _ in pairs], dtype=torch.long).to(device)
        columns = [c for _, c in pairs]  # the gathered columns, in order
        self.src = torch.tensor(columns, dtype=torch.long).to(device)
        # picks them from a list of values at C speed (``take``); a tuple even for one
        self._pick = operator.itemgetter(*columns, columns[0]) if columns else None
        self.zeros = torch.zeros(rows, dtype=dtype).to(device)  # the base without a bias, never written

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The sums (plus ``bias``, a tensor of ``rows`` elements, when given), written
        into ``out`` when given (a kept buffer whose views need no op per call)."""
        base = self.zeros if bias is None else bias
        taken = x.index_select(0, self.src)
        if out is None:
            return torch.index_add(base, 0, self.dst, taken)
        return torch.index_add(base, 0, self.dst, taken, out=out)

    def take(self, values: Sequence[Any]) -> list[Any]:
        """The pairs' columns picked from ``values`` (one per column, e.g. the 0-d norms
        of a foreach call), in pair order: what :meth:`add_taken` sums once stacked."""
        return list(self._pick(values)[:-1]) if self._pick is not None else []

    def add_taken(self, taken: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The sums from the pairs' values already gathered (``taken`` stacked from
        :meth:`take`), into ``out``: one op."""
        return torch.index_add(self.zeros, 0, self.dst, taken, out=out)


class RepeatedSum:
    """:class:`SparseSum` for values copied, not gathered: the values ``x`` ([C]) are
    written ``copies`` times end to end into a kept buffer ([copies * C], by one foreach
    copy from the pieces they come from), the k-th use of a column reading its k-th copy,
    so one ``index_add`` of the whole buffer (unused copies into a scratch row) is the sum.
    A stack, a concatenation and a gather fewer than building ``x`` and gathering it."""

    def __init__(
        self, rows: int, pairs: Sequence[tuple[int, int]], columns: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        uses = [0] * columns
        at: list[tuple[int, int]] = []  # (position, row) per pair
        for r, c in pairs:
            at.append((uses[c] * columns + c, r))
            uses[c] += 1
        self.copies = max(uses, default=1) or 1
        self.columns = columns
        dst = [rows] * (self.copies * columns)  # the scratch row, past the sums
        for position, r in at:
            dst[position] = r
        self.dst = torch.tensor(dst, dtype=torch.long).to(device)
        self.rows = rows
        self.buffer = torch.empty(self.copies * columns, dtype=dtype, device=device)
        self._items: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def fill(self, blocks: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy ``blocks`` (1-D) then ``values`` (0-d, one per column: a foreach call's
        norms), ``columns`` elements in all, on the buffer's device, ``copies`` times into
        the buffer with one op; return it. The destinations are made once per block
        widths and value count (no Python work per value per call)."""
        widths = (*(b.numel() for b in blocks), len(values))
        items = self._items.get(widths)
        if items is None:
            width = sum(widths)
            if width != self.columns:
                raise ValueError(f"RepeatedSum: pieces of {width} values for {self.columns} columns")
            items = []
            for k in range(self.copies):
                at = k * self.columns
                for w in widths[:-1]:
                    items.append(self.buffer[at : at + w])
                    at += w
                items += self.buffer[at : at + len(values)].unbind()
            if len(self._items) >= 8:
                self._items.clear()
            self._items[widths] = items
        torch._foreach_copy_(items, [*blocks, *values] * self.copies)
        return self.buffer

    def __call__(self, taken: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The sums of ``taken`` (what :meth:`fill` gave, transformed elementwise) plus
        ``base`` ([rows + 1], its last element the scratch row), into ``out`` ([rows + 1])."""
        return torch.index_add(base, 0, self.dst, taken, out=out)
