"""What loss accounting gathers over a reported step, and what its report reads of the
monitor: :class:`Accumulated`, capture's sums and counts handed to the report
(:class:`~trainvitals.hooks.signals.loss.report.LossReport`), and :class:`Snapshot`,
the monitor's settings taken on the training thread for an emission on the sender
thread. Plain data, no ops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainvitals.hooks.signals.loss.arguments import MAX_OBJECTIVES
from trainvitals.hooks.signals.loss.deferred import Deferred

__all__ = ["Accumulated", "Snapshot"]


@dataclass(frozen=True)
class Accumulated:
    """What capture gathered over a reported step; the defaults are a step without
    any (a rank that tracked nothing still joins the cross-rank sum)."""

    sums: torch.Tensor | None = None  # [layout.size]; None when no hook was placed
    extremes: torch.Tensor | None = None  # [layout.extremes]: per objective wmax, -wmin, non-uniform
    counter: torch.Tensor | None = None  # sums[layout.nonfinite] as a view made once (0-d)
    rows: torch.Tensor | None = None  # sums' ROWS as [len(ROWS), bins], a view made once
    calls: list[int] = field(default_factory=lambda: [0] * MAX_OBJECTIVES)  # micro-batches per objective
    weights: dict[int, float] = field(default_factory=dict)  # declared weight per objective slot
    normalization: str | None = None  # declared by a track_loss call of the step
    fired: bool = False  # weights arrived (a per-token loss or logits hook ran)
    output: bool = False  # an output (or logits) gradient was summed
    later: Deferred | None = None  # micro-batch results the hooks left to the report (loss_deferred)
    withheld: str = ""  # why the samples cannot be known (packed rows): the per-sample figures are left out


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the emission reads of the monitor, taken on the training thread for an
    emission on the sender thread (a live setting replaces ``config``, never writes it)."""

    modalities: tuple[str, ...]
    config: Any
    world_size: int
    warn_once: Any
    optimizer: Any
    data_parallel_size: int = 1  # made on one rank only
