"""Where the watched parameters live: their names, the device, and how much each
rank's piece of a parameter counts in a sum over ranks (tensor and FSDP sharding).

A parameter layout whose per-rank sums cannot be combined is named once, at attach
(:attr:`Placement.layout_problem`), and the figures resting on such sums are withheld
with that reason, never sent wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from trainvitals.hooks.megatron import MegatronLayout, megatron_layout
from trainvitals.hooks.naming import clean_name
from trainvitals.hooks.tensors import is_dtensor, is_sharded, rank_weight

__all__ = ["Placement"]


class Placement:
    """The parameters of one model and optimizer as the ranks hold them."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        world_size: int,
        warn_once: Callable[..., bool],
    ) -> None:
        self.world_size = world_size
        self._warn_once = warn_once
        self.param_names: dict[int, str] = {id(p): clean_name(n) for n, p in model.named_parameters()}
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.sharded = any(is_sharded(p) for p in model.parameters())
        self._weights: dict[int, float] = {}
        self._grad_checked: tuple[tuple[int, ...], str | None] | None = None
        self._megatron: MegatronLayout | None = None
        self.data_parallel_size = world_size
        """The ranks that see different data: Megatron's data-parallel group; under
        DTensor, FSDP2's mesh (``fully_shard``) or 1 for tensor parallelism alone on a
        1-D mesh spanning the job (its ranks see the same tokens); the world otherwise."""
        self.layout_problem = self._placements(model, optimizer)
        """A parameter layout whose per-rank sums cannot be combined (named), or None."""
        self.weighted = self.sharded and any(w != 1.0 for w in self._weights.values())
        """Some parameter's per-rank sums count for less than 1 (:meth:`weight_of`)."""

    def _placements(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
        """Each parameter's :func:`rank_weight` (when any is a DTensor); the first layout
        that cannot be combined, as a sentence naming it."""
        named = list(model.named_parameters())
        listed = {id(p) for _, p in named}
        named += [
            (f"param_group {i} #{j}", p)
            for i, g in enumerate(optimizer.param_groups)
            for j, p in enumerate(g["params"])
            if id(p) not in listed
        ]
        if not any(is_dtensor(p) for _, p in named):
            return self._megatron_placements(named)
        self.data_parallel_size = dtensor_data_parallel_size(model, named, self.world_size)
        for name, p in named:
            weight = rank_weight(p, self.world_size)
            if isinstance(weight, str):
                return f"{clean_name(name)}: {weight}; optimizer, parameter and Adam figures withheld"
            self._weights[id(p)] = weight
        return None

    def _megatron_placements(self, named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
        """Megatron's tensor-parallel shards (plain tensors marked by Megatron): each
        parameter's share from the job's Megatron groups (:mod:`trainvitals.hooks.megatron`)."""
        layout = megatron_layout(self.world_size)
        if layout is None:
            return None
        self.sharded = True  # combined over the job by each parameter's share
        self._megatron = layout
        if layout.tp * layout.pp * layout.dp == self.world_size and layout.pp == 1:
            self.data_parallel_size = layout.dp
        problem = layout.problem()
        weights = layout.weigh(named, clean_name) if problem is None else problem
        if isinstance(weights, str):
            return f"{weights}; optimizer, parameter and Adam figures withheld"
        self._weights.update(weights)
        return None

    def grad_layout_problem(self, params: list[torch.Tensor]) -> str | None:
        """A DTensor parameter among ``params`` whose gradient is placed otherwise than
        the parameter (SequenceParallel norms: ``Partial`` gradients of ``Replicate``
        weights, summed later): its norm cannot be had from the ranks' pieces. Named,
        or None; judged once per set of parameters (the placements follow the plan)."""
        if not self._weights:
            return None
        key = tuple(map(id, params))
        if self._grad_checked is None or self._grad_checked[0] != key:
            problem = None
            for p in params:
                grad = p.grad
                placements: Any = getattr(p, "placements", ())
                if grad is not None and is_dtensor(p) and tuple(getattr(grad, "placements", ())) != tuple(placements):
                    placed = tuple(getattr(grad, "placements", ()))
                    problem = (
                        f"{self.name_of(p, 'a parameter')}: gradient placed {placed} unlike the parameter "
                        f"{tuple(placements)}; gradient figures withheld"
                    )
                    break
            self._grad_checked = (key, problem)
        return self._grad_checked[1]

    def weight_of(self, p: torch.Tensor) -> float:
        """What this rank's partial sums of ``p`` count for in the sum over ranks (1: a
        piece no other rank holds; 1 / k: one of k copies). 1 when nothing is combined."""
        if not self.sharded:
            return 1.0
        weight = self._weights.get(id(p))
        if weight is None:  # a parameter added to the optimizer after attach
            found = self._megatron.weight(p) if self._megatron is not None else rank_weight(p, self.world_size)
            if isinstance(found, str):  # cannot be combined: told, and counted as one piece
                self._warn_once(f"layout:{id(p)}", "%s: %s; its figures may be wrong", self.name_of(p), found)
                found = 1.0
            weight = self._weights[id(p)] = found
        return weight

    def numel_of(self, p: torch.Tensor) -> int:
        """The element count of the whole of ``p``: a DTensor's is global already; a
        Megatron tensor-parallel split's is its piece's times the group's size."""
        return self._megatron.numel(p) if self._megatron is not None else p.numel()

    def name_of(self, p: torch.Tensor, fallback: str = "") -> str:
        return self.param_names.get(id(p), fallback)


def dtensor_data_parallel_size(model: nn.Module, named: Sequence[tuple[str, torch.Tensor]], world_size: int) -> int:
    """The ranks of a DTensor job that see different data. FSDP2 (``fully_shard``): its
    data-parallel mesh (sharded and replicated dims, a submesh of a 2-D mesh with tensor
    parallelism); no FSDP and every DTensor parameter on a 1-D mesh spanning the job:
    tensor parallelism alone, whose ranks all see the same tokens, so 1; else the world
    (read as data-parallel, as before)."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        try:  # FSDP2's state (torch internals, read like DTensor's _local_tensor: by name, defensively)
            mesh = getattr(getattr(getattr(state(), "_fsdp_param_group", None), "mesh_info", None), "mesh", None)
        except Exception:  # noqa: BLE001 - another torch's FSDP internals: the world, as before
            return world_size
        if mesh is not None:
            return int(mesh.size())
    meshes: list[Any] = [getattr(p, "device_mesh", None) for _, p in named if is_dtensor(p)]
    if meshes and all(m.ndim == 1 and m.size() == world_size for m in meshes):
        return 1
    return world_size
