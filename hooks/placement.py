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

from trainvitals.hooks.grad_norms import GradNorms
from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.megatron import (
    MegatronLayout,
    PipelineTable,
    WatchedOptimizer,
    global_names,
    megatron_layout,
    tensor_parallel_groups,
)
from trainvitals.hooks.naming import clean_name
from trainvitals.hooks.tensors import is_dtensor, is_sharded, rank_weight, spanning_meshes

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
        self._model, self._optimizer = model, optimizer
        self._grad_index: tuple[tuple[int, ...], list[int]] | None = None  # params with a gradient, their rows
        self._indices = IndexCache()
        self.param_names: dict[int, str] = {id(p): clean_name(n) for n, p in model.named_parameters()}
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.sharded = any(is_sharded(p) for p in model.parameters())
        self._weights: dict[int, float] = {}
        self._grad_checked: tuple[tuple[int, ...], str | None] | None = None
        self._megatron: MegatronLayout | None = None
        self._spanning: list[Any] = []  # the named meshes DTensor parameters span the job on
        self._pipeline: PipelineTable | None = None
        self.data_parallel_size = world_size
        """The ranks that see different data: Megatron's data-parallel group; under
        DTensor, FSDP2's mesh (``fully_shard``; ``mesh["dp"]`` beside tensor parallelism)
        or 1 for tensor parallelism alone on a 1-D mesh spanning the job (its ranks see
        the same tokens); the world otherwise."""
        self.pipeline_stages = 1
        """Megatron's pipeline-parallel size: the stages hold different parameters."""
        self.pipeline_last = True
        """This rank is on the last pipeline stage (the one with the LM head)."""
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
        self._spanning = spanning_meshes((p for _, p in named), self.world_size)
        self.data_parallel_size = dtensor_data_parallel_size(model, named, self.world_size)
        for name, p in named:
            weight = rank_weight(p, self.world_size, self._spanning)
            if isinstance(weight, str):
                return f"{clean_name(name)}: {weight}; optimizer, parameter and Adam figures withheld"
            self._weights[id(p)] = weight
        return None

    def _megatron_placements(self, named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
        """Megatron's tensor-parallel shards (plain tensors marked by Megatron): each
        parameter's share from the job's Megatron groups (:mod:`trainvitals.hooks.megatron`);
        with pipeline stages, the job-wide parameter table the signals watch (collectives at
        attach, made on every rank before any can return)."""
        layout = megatron_layout(self.world_size)
        if layout is None:
            return None
        self.sharded = True  # combined over the job by each parameter's share
        self._megatron = layout
        if layout.tp * layout.pp * layout.dp == self.world_size:
            self.data_parallel_size = layout.dp
        problem = layout.problem()
        if layout.pp > 1:  # the collectives first, on every rank alike (none returns before them)
            self.pipeline_stages, self.pipeline_last = layout.pp, layout.last_stage
            tensor_parallel_groups()  # the last stage's vocab-parallel head needs it; the others hold none
            if problem is None:  # every stage's parameters, the others' as empty stand-ins
                self.param_names.update(global_names(self._model, clean_name))
                table = PipelineTable.make(self._optimizer, self.param_names, layout, self.device)
                if isinstance(table, str):
                    problem = table
                else:
                    self._pipeline = table
                    self.param_names.update(table.names)
        weights = layout.weigh(named, clean_name) if problem is None else problem
        if isinstance(weights, str):
            self._pipeline = None
            return f"{weights}; optimizer, parameter and Adam figures withheld"
        self._weights.update(weights)
        return None

    def watched(self, optimizer: torch.optim.Optimizer) -> Any:
        """The optimizer as the signals see it: on a pipeline-parallel job every stage's
        parameters (:class:`~trainvitals.hooks.megatron.WatchedOptimizer`), else itself."""
        return WatchedOptimizer(optimizer, self._pipeline) if self._pipeline is not None else optimizer

    def job_grad_norms(self, norms: GradNorms) -> GradNorms:
        """``norms`` over the job's parameters on a pipeline-parallel job (0 for the other
        stages' stand-ins and a parameter of this stage without a gradient), so that every
        rank's per-parameter rows have the same layout; else ``norms`` itself."""
        table = self._pipeline
        if table is None:
            return norms
        key = tuple(map(id, norms.params))
        if self._grad_index is None or self._grad_index[0] != key:
            position = {id(p): j for j, p in enumerate(table.everything)}
            self._grad_index = (key, [position[id(p)] for p in norms.params])
        # made on the device once per set of parameters with a gradient (not at every
        # report where the set alternates: a blocking copy on a GPU)
        index = self._indices.get(self._grad_index[1], norms.norms.device)
        out = norms.norms.new_zeros(len(table.everything))
        out.index_copy_(0, index, norms.norms)
        return GradNorms(list(table.everything), out, norms.measured)

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
            found = (
                self._megatron.weight(p)
                if self._megatron is not None
                else rank_weight(p, self.world_size, self._spanning)
            )
            if isinstance(found, str):  # cannot be combined: told, and counted as one piece
                self._warn_once(f"layout:{id(p)}", "%s: %s; its figures may be wrong", self.name_of(p), found)
                found = 1.0
            weight = self._weights[id(p)] = found
        return weight

    def numel_of(self, p: torch.Tensor) -> int:
        """The element count of the whole of ``p``: a DTensor's is global already; a
        Megatron tensor-parallel split's is its piece's times the group's size."""
        if self._pipeline is not None and id(p) in self._pipeline.numels:
            return self._pipeline.numels[id(p)]
        return self._megatron.numel(p) if self._megatron is not None else p.numel()

    def name_of(self, p: torch.Tensor, fallback: str = "") -> str:
        return self.param_names.get(id(p), fallback)


def _fsdp_data_parallel_size(model: nn.Module) -> int | None:
    """The ranks FSDP2 (``fully_shard``) shards and averages the model's gradients over:
    the size of the mesh it was given (``mesh["dp"]`` beside tensor parallelism; both
    dims of an HSDP mesh), the largest over its modules; None where no module is
    ``fully_shard``-ed or its mesh cannot be read (another torch)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    sizes: list[int] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        # FSDP2 keeps its mesh in its state's param groups (no public accessor)
        get_state = getattr(module, "_get_fsdp_state", None)
        groups = getattr(get_state(), "_fsdp_param_groups", None) if callable(get_state) else None
        if groups is None:  # a torch that keeps it elsewhere
            return None
        for group in groups:
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            if mesh is None:
                return None
            sizes.append(int(mesh.size()))
    return max(sizes) if sizes else None


def dtensor_data_parallel_size(model: nn.Module, named: Sequence[tuple[str, torch.Tensor]], world_size: int) -> int:
    """The ranks of a DTensor job that see different data. FSDP2 (``fully_shard``): its
    data-parallel mesh (:func:`_fsdp_data_parallel_size`); no FSDP and every DTensor
    parameter on a 1-D mesh spanning the job: tensor parallelism alone, whose ranks all
    see the same tokens, so 1; else the world (read as data-parallel, as before)."""
    fsdp = _fsdp_data_parallel_size(model)
    if fsdp is not None:
        return fsdp
    meshes: list[Any] = [getattr(p, "device_mesh", None) for _, p in named if is_dtensor(p)]
    if meshes and all(m is not None and m.ndim == 1 and m.size() == world_size for m in meshes):
        return 1
    return world_size
