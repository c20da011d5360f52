"""Table stakes around the optimizer step: gradient and parameter norms, the
update-to-weight ratio, non-finite gradients (INCIDENTS.md, "Table stakes").

grad_norm (and group_grad_norm{group} per param group) is the L2 norm of the gradients the optimizer is about to use
(after unscaling by a GradScaler, which unscales before ``step``), the same value
``torch.nn.utils.clip_grad_norm_`` returns. param_norm is taken after the
step. update_ratio = RMS(p_after - p_before) / RMS(p_after), on a strided
sample of at most ``update_sample`` elements per tensor (exact for smaller tensors),
so no copy of the model is ever made.
"""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.signals.base import Signal, StepContext
from trainvitals.hooks.tensors import group_sum, local, norms


class OptimizerStats(Signal):
    def __init__(self) -> None:
        self._grad_norms: torch.Tensor | None = None
        self._grad_gidx: torch.Tensor | None = None
        self._before: torch.Tensor | None = None
        self._layout_key: tuple | None = None
        self._elem_gidx: torch.Tensor | None = None
        self._strides: list[int] = []
        self._nonfinite: torch.Tensor | None = None
        self._indices: dict[tuple, torch.Tensor] = {}

    def _index(self, values: list[int], device: torch.device) -> torch.Tensor:
        """A cached device index tensor: making one from Python ints each report would
        be a blocking host-to-device copy."""
        key = (tuple(values), device)
        cached = self._indices.get(key)
        if cached is None:
            if len(self._indices) > 8:
                self._indices.clear()
            cached = self._indices[key] = torch.tensor(values, dtype=torch.long).to(device)
        return cached

    def _params(self, monitor: Any) -> tuple[list[torch.Tensor], list[int]]:
        params, gidx = [], []
        for gi, (_, g) in enumerate(monitor.groups()):
            for p in g["params"]:
                params.append(p)
                gidx.append(gi)
        return params, gidx

    def _sample(self, monitor: Any, params: list[torch.Tensor], gidx: list[int]) -> torch.Tensor:
        key = tuple((id(p), p.numel()) for p in params)
        cap = monitor.config.update_sample
        if key != self._layout_key:
            self._layout_key = key
            self._strides = [max(1, -(-local(p).numel() // cap)) for p in params]
            counts = [-(-local(p).numel() // s) for p, s in zip(params, self._strides)]
            self._elem_gidx = torch.repeat_interleave(
                torch.tensor(gidx, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
            ).to(monitor.device)
        views = [local(p).detach().reshape(-1)[::s] for p, s in zip(params, self._strides)]
        return torch.cat([v.to(monitor.device, torch.float32) for v in views]) if views else torch.zeros(0)

    def before_step(self, monitor: Any, reporting: bool) -> None:
        if not reporting:
            return
        params, gidx = self._params(monitor)
        dev = monitor.device
        _, self._grad_norms = monitor.grad_norms()  # same order: the groups' params with a grad
        self._grad_gidx = self._index([g for p, g in zip(params, gidx) if p.grad is not None], dev)
        self._before = self._sample(monitor, params, gidx)

    def after_step(self, monitor: Any, reporting: bool) -> None:
        pass

    def collect(self, monitor: Any, ctx: StepContext) -> None:
        dev = monitor.device
        groups = monitor.groups()
        n_groups = len(groups)
        params, gidx = self._params(monitor)
        group_labels = [{"group": label} for label, _ in groups]

        # Sums of squares per group, [all, g0, g1, ...]; summed across ranks when sharded.
        def with_all(per_group: torch.Tensor) -> torch.Tensor:
            return torch.cat([per_group.sum().reshape(1), per_group])

        parts: list[torch.Tensor] = []
        if self._grad_norms is not None:
            gn = self._grad_norms
            if self._nonfinite is None:
                self._nonfinite = torch.zeros((), device=dev)
            self._nonfinite = self._nonfinite + (~torch.isfinite(gn)).sum()
            parts.append(with_all(group_sum(gn.square(), self._grad_gidx, n_groups)))
        pn = norms([local(p).detach() for p in params], dev)
        parts.append(with_all(group_sum(pn.square(), self._index(gidx, dev), n_groups)))
        upd = None
        if self._before is not None and self._elem_gidx is not None:
            after = self._sample(monitor, params, gidx)
            if after.shape == self._before.shape:
                upd = (with_all(group_sum((after - self._before).square(), self._elem_gidx, n_groups)),
                       with_all(group_sum(after.square(), self._elem_gidx, n_groups)))
        self._before = None
        sq = torch.stack(parts + list(upd or ()))
        has_grad = self._grad_norms is not None
        self._grad_norms = None
        nonfinite = self._nonfinite

        def emit(name: str, values: torch.Tensor) -> None:
            # The whole model and its groups are separate metrics, so a sum() over
            # the groups never adds the total to its parts.
            ctx.emit(name, values[0])
            ctx.emit("group_" + name, values[1:], group_labels)

        def finish(total: torch.Tensor) -> None:
            total = total.view(-1, n_groups + 1)
            row = 0
            if has_grad:
                emit("grad_norm", total[row].sqrt())
                row += 1
            emit("param_norm", total[row].sqrt())
            row += 1
            if upd is not None:
                emit("update_ratio", (total[row] / total[row + 1]).sqrt())
            if nonfinite is not None:
                ctx.emit("nonfinite_total", nonfinite, {"what": "grad"})

        if monitor.sharded:
            ctx.reduce(sq, "sum", finish)
        else:
            finish(sq)
