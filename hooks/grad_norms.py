"""The step's gradient norms: one object per reported optimizer step, handed to the
signals that need it.

Per parameter of the optimizer that has a gradient (param-group order), the L2 norm
of its gradient as float32 on the monitor's device (rank-local shards when sharded).
It is taken once per step, by whichever comes first:

1. a signal that measured it already (:meth:`Signal.measured_grad_norms`): the
   optimizer signal takes it at the end of the backward that completes the step's
   gradient, before any clipping and unscaled by a GradScaler
   (:mod:`~trainvitals.hooks.signals.grad_norm.backward`);
2. otherwise one foreach norm of the gradients the optimizer is about to apply.

The step lifecycle (:mod:`~trainvitals.hooks.lifecycle`) makes the object before
``optimizer.step()`` of a report step, only when a running signal declares
``uses_grad_norms``, and hands it to every signal's ``collect`` as
``StepContext.grad_norms``. Nothing here reads a value on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from trainvitals.hooks.tensors import foreach_norm32, local, real, stack_on

__all__ = ["GradNorms"]


@dataclass(frozen=True, eq=False)
class GradNorms:
    """The gradient L2 norms of one optimizer step, per parameter."""

    params: list[torch.Tensor]
    """The optimizer's parameters that have a gradient, in param-group order."""
    norms: torch.Tensor
    """float32 ``[len(params)]`` on the monitor's device: each gradient's L2 norm."""
    measured: Literal["backward", "applied"]
    """Where: at the end of the backward (before clipping, unscaled), or as applied."""
    _positions: dict[int, int] = field(default_factory=dict, repr=False)
    _shares: torch.Tensor | None = field(default=None, repr=False)

    def shares(self, weight_of: Callable[[torch.Tensor], float]) -> torch.Tensor:
        """float32 ``[len(params)]`` on the norms' device: each parameter's share of the
        sums over ranks (``MonitorView.weight_of``: 1 / k for a piece k ranks hold alike);
        made once per step's norms, by whoever measured them or at the first ask."""
        if self._shares is None:
            w = torch.tensor([weight_of(p) for p in self.params], dtype=torch.float32)
            object.__setattr__(self, "_shares", w.to(self.norms.device))  # frozen: a cache, set once
        assert self._shares is not None
        return self._shares

    @classmethod
    def applied(cls, groups: Sequence[dict[str, Any]], device: torch.device) -> GradNorms:
        """The norms of the gradients the optimizer is about to apply (one foreach call)."""
        params = [p for g in groups for p in g["params"] if p.grad is not None]
        grads = [real(local(p.grad)) for p in params]
        norms = stack_on(foreach_norm32(grads), device) if grads else torch.zeros(0, device=device)
        return cls(params, norms, "applied")

    def position(self, param: torch.Tensor) -> int | None:
        """Where ``param`` is in :attr:`params` (None: it has no gradient this step)."""
        if not self._positions and self.params:
            self._positions.update((id(p), j) for j, p in enumerate(self.params))
        return self._positions.get(id(param))
