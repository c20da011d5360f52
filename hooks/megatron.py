"""Megatron-core's model-parallel layout, read from the job's own process groups.

Megatron's shards are plain tensors, not DTensors: a tensor-parallel split is marked on
the parameter (``tensor_model_parallel=True``, ``partition_dim``) and the groups live in
``megatron.core.parallel_state``. This module turns that into what each rank's partial
sums of a parameter count for when every rank's are summed over the job
(:meth:`Monitor.weight_of`): every element counted once.

- a tensor-parallel split: distinct within its tensor-parallel group, the same on every
  data-parallel (and context-parallel) rank: ``1 / dp``;
- any other parameter (norms, sequence-parallel norms once Megatron has all-reduced their
  gradients, a bias of a row-parallel layer): the same on every rank of a tensor- and
  data-parallel group: ``1 / (tp * dp)``;
- the word embedding tied to the output layer across pipeline stages (``shared_embedding``
  on the first and the last stage): two copies, each half of that.

Layouts it does not combine (pipeline stages hold different parameters, so the ranks'
report vectors differ; expert parallelism; a job whose groups do not span the world) are
returned as a sentence naming them, and the figures are withheld. Megatron is read only
when the job has imported it: importing this module imports nothing of Megatron's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["MegatronLayout", "megatron_layout", "private_group", "vocab_shard_group"]


class MegatronLayout:
    """The sizes of the job's Megatron groups, and each parameter's share from them."""

    def __init__(self, tp: int, pp: int, dp: int, world: int, error: str | None = None) -> None:
        self.tp, self.pp, self.dp, self.world = tp, pp, dp, world
        self.error = error

    def describe(self) -> str:
        return f"Megatron tensor parallel {self.tp} x pipeline {self.pp} x data parallel {self.dp}"

    def problem(self) -> str | None:
        """The layout, named, when its sums cannot be combined here; else None."""
        if self.error is not None:
            return self.error
        if self.tp * self.pp * self.dp != self.world:
            return f"{self.describe()} does not span the job's {self.world} ranks (expert or other groups)"
        if self.pp > 1:
            return f"{self.describe()}: pipeline stages hold different parameters, not combined"
        return None

    def weight(self, p: torch.Tensor) -> float | str:
        """This rank's share of ``p``'s sums over the job, or a sentence why there is none."""
        if getattr(p, "allreduce", True) is False:
            return "an expert-parallel parameter (Megatron allreduce=False)"
        weight = 1.0 / self.dp
        if not getattr(p, "tensor_model_parallel", False) or getattr(p, "partition_dim", -1) < 0:
            weight /= self.tp
        if self.pp > 1 and getattr(p, "shared_embedding", False):
            weight /= 2  # the embedding tied to the output layer: a copy on the first and last stage
        return weight

    def numel(self, p: torch.Tensor) -> int:
        """The element count of the whole parameter: a split's piece times the group's size."""
        split = getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_dim", -1) >= 0
        return p.numel() * self.tp if split else p.numel()

    def weigh(self, named: Iterable[tuple[str, torch.Tensor]], clean: Callable[[str], str]) -> dict[int, float] | str:
        """Each parameter's weight by id, or the first parameter that has none, named."""
        out: dict[int, float] = {}
        for name, p in named:
            found = self.weight(p)
            if isinstance(found, str):
                return f"{clean(name)}: {found}"
            out[id(p)] = found
        return out


def megatron_layout(world: int) -> MegatronLayout | None:
    """The job's Megatron layout when it splits parameters over ranks (tensor or pipeline
    parallel size above 1), else None: plain data parallelism needs nothing combined."""
    module: Any = sys.modules.get("megatron.core.parallel_state")
    if module is None or world <= 1:
        return None
    try:
        if not module.model_parallel_is_initialized():
            return None
        tp = module.get_tensor_model_parallel_world_size()
        pp = module.get_pipeline_model_parallel_world_size()
        dp = module.get_data_parallel_world_size(with_context_parallel=True)
    except Exception as e:  # noqa: BLE001 - another Megatron version's API: withheld, said why
        return MegatronLayout(0, 0, 0, world, error=f"Megatron's parallel_state unreadable ({e!r})")
    if tp == 1 and pp == 1:
        return None
    return MegatronLayout(tp, pp, dp, world)


_PRIVATE: dict[tuple[int, ...], Any] = {}
"""This process's own copy of its tensor-parallel group, by the group's ranks (made once)."""


def vocab_shard_group(head: torch.nn.Module) -> Any:
    """A process group over the ranks among which ``head``'s outputs are split along the
    vocabulary (Megatron's ``ColumnParallelLinear`` output layer with ``tensor_model_parallel``
    rows), or None: a head whose logits are whole.

    The group is the monitor's own, not Megatron's: should the ranks ever disagree on one
    of the monitor's collectives, it can never pair with one of Megatron's and corrupt its
    tensors. It is made at attach, on every rank (``new_group`` is collective), for a
    layout without pipeline stages (where every rank holds the head)."""
    weight = getattr(head, "weight", None)
    if not (getattr(weight, "tensor_model_parallel", False) and getattr(weight, "partition_dim", -1) == 0):
        return None
    module: Any = sys.modules.get("megatron.core.parallel_state")
    if module is None or not module.model_parallel_is_initialized():
        return None
    if module.get_tensor_model_parallel_world_size() <= 1 or module.get_pipeline_model_parallel_world_size() > 1:
        return None
    import torch.distributed as dist

    return private_group(tuple(dist.get_process_group_ranks(module.get_tensor_model_parallel_group())))


def private_group(mine: tuple[int, ...]) -> Any:
    """This process's own copy of a process group over the ranks ``mine`` (this rank's
    group of a partition of the job, e.g. its tensor-parallel group), made once. Collective:
    every rank calls it, each with its own group's ranks; every group of the partition is
    made on every rank, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    if mine not in _PRIVATE:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for ranks in sorted({tuple(r) for r in everyone}):  # the same order on every rank
            group = dist.new_group(list(ranks))
            if ranks == mine:
                _PRIVATE[mine] = group
    return _PRIVATE[mine]
