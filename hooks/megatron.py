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

Pipeline stages hold different parameters, yet every rank's report vector must have one
layout: :class:`PipelineTable` agrees a job-wide parameter table at attach (one
``all_gather_object``), and each rank watches every parameter of the job, those of
other stages as empty stand-ins (no element: they add 0 to sums, nothing to minima and
maxima), so the report's one collective combines every stage's pieces and rank 0 labels
every parameter. Layer numbers in the names are Megatron's global ones (each stage
numbers its own ``layers.0``).

Layouts it does not combine (expert parallelism; a job whose groups do not span the
world; stages whose optimizers have different param groups) are returned as a sentence
naming them, and the figures are withheld. Megatron is read only
when the job has imported it: importing this module imports nothing of Megatron's.
"""

from __future__ import annotations

import collections
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "MegatronLayout",
    "PipelineTable",
    "WatchedOptimizer",
    "global_names",
    "megatron_layout",
    "private_group",
    "tensor_parallel_groups",
    "vocab_shard_group",
]


class MegatronLayout:
    """The sizes of the job's Megatron groups, and each parameter's share from them."""

    def __init__(
        self, tp: int, pp: int, dp: int, world: int, error: str | None = None, last_stage: bool = True
    ) -> None:
        self.tp, self.pp, self.dp, self.world = tp, pp, dp, world
        self.error = error
        self.last_stage = last_stage

    def describe(self) -> str:
        return f"Megatron tensor parallel {self.tp} x pipeline {self.pp} x data parallel {self.dp}"

    def problem(self) -> str | None:
        """The layout, named, when its sums cannot be combined here; else None."""
        if self.error is not None:
            return self.error
        if self.tp * self.pp * self.dp != self.world:
            return f"{self.describe()} does not span the job's {self.world} ranks (expert or other groups)"
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
        last = bool(module.is_pipeline_last_stage())
    except Exception as e:  # noqa: BLE001 - another Megatron version's API: withheld, said why
        return MegatronLayout(0, 0, 0, world, error=f"Megatron's parallel_state unreadable ({e!r})")
    if tp == 1 and pp == 1:
        return None
    return MegatronLayout(tp, pp, dp, world, last_stage=last)


_PRIVATE: dict[tuple[int, ...], Any] = {}
"""This process's own copy of its tensor-parallel group, by the group's ranks (made once)."""


def vocab_shard_group(head: torch.nn.Module) -> Any:
    """A process group over the ranks among which ``head``'s outputs are split along the
    vocabulary (Megatron's ``ColumnParallelLinear`` output layer with ``tensor_model_parallel``
    rows), or None: a head whose logits are whole.

    The group is the monitor's own, not Megatron's: should the ranks ever disagree on one
    of the monitor's collectives, it can never pair with one of Megatron's and corrupt its
    tensors. It is made at attach, on every rank (``new_group`` is collective): here
    where every rank holds the head, by :func:`tensor_parallel_groups` on every stage of
    a pipeline-parallel job (whose stages before the last hold no head)."""
    weight = getattr(head, "weight", None)
    if not (getattr(weight, "tensor_model_parallel", False) and getattr(weight, "partition_dim", -1) == 0):
        return None
    return tensor_parallel_groups()


def tensor_parallel_groups() -> Any:
    """This rank's private copy of its tensor-parallel group (see :func:`vocab_shard_group`),
    made on first call with every rank's (a collective: every rank calls it at once), or
    None without a tensor-parallel split."""
    module: Any = sys.modules.get("megatron.core.parallel_state")
    if module is None or not module.model_parallel_is_initialized():
        return None
    if module.get_tensor_model_parallel_world_size() <= 1:
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


_LAYERS = re.compile(r"(^|\.)layers\.(\d+)$")


def global_names(model: torch.nn.Module, clean: Callable[[str], str]) -> dict[int, str]:
    """Each parameter's clean name, by id, with Megatron's global layer numbers: a stage
    numbers its layers from 0 (``decoder.layers.0``), its ``TransformerLayer`` knows its
    place in the whole model (``layer_number``, from 1)."""
    renamed: dict[str, str] = {}
    for name, module in model.named_modules():
        number = getattr(module, "layer_number", None)
        found = _LAYERS.search(name)
        if found is not None and isinstance(number, int) and number >= 1:
            renamed[name] = name[: found.start(2)] + str(number - 1)
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        for prefix, new in renamed.items():
            if name.startswith(prefix + "."):
                name = new + name[len(prefix) :]
                break
        out[id(p)] = clean(name)
    return out


class _GroupView(collections.ChainMap):  # type: ignore[type-arg]
    """A param group as the monitor sees it: the job-wide ``params``, everything else the
    optimizer's own group (read live: a scheduler's lr, the weight decay)."""


class _StateView(Mapping[Any, Any]):
    """The optimizer's state; a stand-in's is empty moments with the step count of this
    stage's own parameters (the stages step together), present once theirs is."""

    def __init__(self, optimizer: Any, table: PipelineTable) -> None:
        self._optimizer, self._table = optimizer, table
        self._made: dict[int, tuple[Any, dict[str, Any]]] = {}

    def _clock(self) -> Any:
        state = self._optimizer.state
        for p in self._table.own:
            st = state.get(p)
            if st:
                return st.get("step")
        return None

    def get(self, p: Any, default: Any = None) -> Any:
        standin = self._table.standins.get(id(p))
        if standin is None:
            return self._optimizer.state.get(p, default)
        step = self._clock()
        if step is None:
            return default
        made = self._made.get(id(p))
        if made is None or made[0] is not step:
            empty = torch.zeros_like(standin)
            made = self._made[id(p)] = (step, {"step": step, "exp_avg": empty, "exp_avg_sq": empty.clone()})
        return made[1]

    def __getitem__(self, p: Any) -> Any:
        found = self.get(p)
        if found is None:
            raise KeyError(p)
        return found

    def __iter__(self) -> Iterator[Any]:
        return (p for g in self._table.groups for p in g if self.get(p) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class WatchedOptimizer:
    """The optimizer as the signals see it on a pipeline-parallel job: the job-wide param
    groups (:class:`PipelineTable`) and state; anything else is the optimizer's own."""

    def __init__(self, optimizer: Any, table: PipelineTable) -> None:
        self.watched_from = optimizer
        self.param_groups = [
            _GroupView({"params": params}, g) for params, g in zip(table.groups, optimizer.param_groups, strict=True)
        ]
        self.state = _StateView(optimizer, table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.watched_from, name)


class PipelineTable:
    """The job-wide parameter table of a pipeline-parallel job, agreed at attach: per param
    group, every stage's parameters in stage order, this stage's own and the others' as
    empty stand-ins of the same number of dimensions.

    ``make`` runs one ``all_gather_object`` (every rank must call it at attach). A sentence
    naming the problem instead when the stages cannot be laid out alike."""

    def __init__(self) -> None:
        self.groups: list[list[torch.Tensor]] = []
        self.own: list[torch.Tensor] = []
        self.standins: dict[int, torch.Tensor] = {}  # id -> the stand-in (its moments are like it)
        self.names: dict[int, str] = {}
        self.numels: dict[int, int] = {}
        self.everything: list[torch.Tensor] = []  # the job's parameters in group order

    @classmethod
    def make(
        cls, optimizer: Any, names: dict[int, str], layout: MegatronLayout, device: torch.device
    ) -> PipelineTable | str:
        import torch.distributed as dist

        module: Any = sys.modules["megatron.core.parallel_state"]
        stage = module.get_pipeline_model_parallel_rank()
        groups = optimizer.param_groups
        labels = [str(g.get("name", i)) for i, g in enumerate(groups)]
        rows = [
            [
                (names.get(id(p), f"{labels[gi]}.{j}"), p.dim(), tuple(p.shape[1:]), layout.numel(p))
                for j, p in enumerate(g["params"])
            ]
            for gi, g in enumerate(groups)
        ]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (stage, labels, rows))
        stages: dict[int, Any] = {}
        for s, theirs, their_rows in everyone:
            if theirs != labels:
                return f"{layout.describe()}: the stages' optimizers have different param groups ({theirs} vs {labels})"
            stages.setdefault(s, their_rows)
        if sorted(stages) != list(range(layout.pp)):
            return f"{layout.describe()}: stages {sorted(stages)} reported, not every stage"
        table = cls()
        seen: dict[str, int] = {}
        for gi, g in enumerate(groups):
            members: list[torch.Tensor] = []
            for s in range(layout.pp):
                if s == stage:
                    members += g["params"]
                    table.own += g["params"]
                    for p in g["params"]:
                        table.names[id(p)] = names.get(id(p), "")
                        table.numels[id(p)] = layout.numel(p)
                    continue
                for name, dim, tail, numel in stages[s][gi]:
                    shape = (0, *tail) if dim >= 1 else (0,)
                    standin = torch.zeros(shape, dtype=torch.float32, device=device)
                    table.standins[id(standin)] = standin
                    table.names[id(standin)] = name
                    table.numels[id(standin)] = numel
                    members.append(standin)
            table.groups.append(members)
        for p in (p for g in table.groups for p in g):
            name = table.names[id(p)]
            if name in seen:
                return f"{layout.describe()}: two stages name a parameter {name!r}"
            seen[name] = 1
        table.everything = [p for g in table.groups for p in g]
        return table
