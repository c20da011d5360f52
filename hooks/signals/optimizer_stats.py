"""Table stakes around the optimizer step: gradient and parameter norms, the
update-to-weight ratio, non-finite gradients (docs/signals.md, "Optimizer step").

``grad_norm`` is the global gradient L2 norm before clipping, taken at the end of
every backward (:mod:`~trainvitals.hooks.signals.backward_grad_norm`), with
``grad_norm_max`` / ``grad_norm_mean`` over the steps since the previous report, and
``nonfinite_total{what="grad"}`` the steps whose gradient was not finite.
``group_grad_norm{group}`` is the L2 norm of one param group's gradients, from the
same measurement (before clipping, unscaled by a GradScaler); when no backward was
seen completing the step's gradient (gradients set by hand, the short last step of
an epoch), both are taken as the optimizer is about to use them.
``param_norm`` is taken after the step. ``update_ratio`` = RMS(p_after - p_before) /
RMS(p_after), on a sample of ``update_sample`` elements per tensor (evenly spaced
runs of 16 contiguous elements; exact for smaller tensors), so no copy of the model
is ever made. The whole model
and its groups are separate metrics, so a ``sum()`` over groups never adds the
total to its parts.
"""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.sampling import TensorsSample
from trainvitals.hooks.signals.backward_grad_norm import BackwardGradNorms, emit_norm_history
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.step import ReduceOp, StepContext
from trainvitals.hooks.tensors import flat, group_sum, local, norms


class OptimizerStats(Signal):
    def __init__(self) -> None:
        self._grad_norms: torch.Tensor | None = None
        self._grad_group: torch.Tensor | None = None
        self._before: torch.Tensor | None = None
        self._sample_key: tuple | None = None
        self._sample: TensorsSample | None = None
        self._sample_group: torch.Tensor | None = None
        self._nonfinite: torch.Tensor | None = None
        self._indices = IndexCache()
        self._history = BackwardGradNorms(self)

    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._history.bind(monitor)
        return []

    def after_step(self, monitor: MonitorView, reporting: bool) -> None:
        self._history.end_step(monitor)

    @staticmethod
    def _params(monitor: MonitorView) -> tuple[list[torch.Tensor], list[int]]:
        params, group_of = [], []
        for gi, (_, g) in enumerate(monitor.groups()):
            for p in g["params"]:
                params.append(p)
                group_of.append(gi)
        return params, group_of

    def _sampled(self, monitor: MonitorView, params: list[torch.Tensor], group_of: list[int]) -> torch.Tensor:
        key = tuple((id(p), p.numel()) for p in params)
        if key != self._sample_key:
            self._sample_key = key
            self._sample = TensorsSample([flat(local(p)).numel() for p in params], monitor.config.update_sample)
            self._sample_group = self._sample.owners(monitor.device, group_of)
        assert self._sample is not None
        return self._sample.take([local(p) for p in params], monitor.device)

    def before_step(self, monitor: MonitorView, reporting: bool) -> None:
        if not reporting:
            return
        params, group_of = self._params(monitor)
        fresh = self._history.fresh()
        if fresh is not None:  # taken at the end of the backward: no second pass
            monitor.offer_grad_norms(*fresh)
        _, self._grad_norms = monitor.grad_norms()  # same order: the groups' params with a grad
        self._grad_group = self._indices.get(
            [g for p, g in zip(params, group_of, strict=True) if p.grad is not None], monitor.device
        )
        self._before = self._sampled(monitor, params, group_of)

    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        dev = monitor.device
        groups = monitor.groups()
        n_groups = len(groups)
        params, group_of = self._params(monitor)
        group_labels = [{"group": label} for label, _ in groups]

        # Sums of squares, [whole model, g0, g1, ...]; summed across ranks when sharded.
        def with_total(per_group: torch.Tensor) -> torch.Tensor:
            return torch.cat([per_group.sum().reshape(1), per_group])

        if self._nonfinite is None:
            self._nonfinite = torch.zeros((), device=dev)
        self._nonfinite = self._nonfinite.to(dev)
        history = self._history.take()
        parts: list[torch.Tensor] = []
        if self._grad_norms is not None:
            gn, grad_group = self._grad_norms, self._grad_group
            assert grad_group is not None  # before_step sets it together with the norms
            # The gradient the optimizer applies is not finite although the backward's was
            # (set or scaled by hand after the backward), or no backward was seen: count
            # the step here; the backward's non-finite steps are counted from the history.
            applied_bad = (~torch.isfinite(gn)).any()
            if history is not None:
                applied_bad = applied_bad & torch.isfinite(history[-1])
            self._nonfinite = self._nonfinite + applied_bad
            parts.append(with_total(group_sum(gn.square(), grad_group, n_groups)))
        pn = norms([local(p) for p in params], dev)  # under no_grad: no detach needed
        parts.append(with_total(group_sum(pn.square(), self._indices.get(group_of, dev), n_groups)))
        upd = None
        if self._before is not None and self._sample_group is not None:
            after = self._sampled(monitor, params, group_of)
            if after.shape == self._before.shape:
                idx = self._sample_group
                upd = (
                    with_total(group_sum((after - self._before).square(), idx, n_groups)),
                    with_total(group_sum(after.square(), idx, n_groups)),
                )
        self._before = None
        sq = torch.stack(parts + list(upd or ()))
        has_grad = self._grad_norms is not None
        self._grad_norms = None

        def emit(name: str, values: torch.Tensor, whole: bool = True) -> None:
            if whole:
                ctx.emit(name, values[0])
            ctx.emit("group_" + name, values[1:], group_labels)

        def finish(total: torch.Tensor, *rest: torch.Tensor) -> None:
            total = total.view(-1, n_groups + 1)
            row = 0
            if has_grad:
                emit("grad_norm", total[row].sqrt(), whole=history is None)
                row += 1
            emit("param_norm", total[row].sqrt())
            row += 1
            if upd is not None:
                emit("update_ratio", (total[row] / total[row + 1]).sqrt())
            nonfinite = self._nonfinite
            assert nonfinite is not None  # set by collect above; nothing sets it back to None
            if rest:  # the per-step squared norms, combined across shards
                nonfinite = self._nonfinite = nonfinite + emit_norm_history(ctx, rest[0])
            ctx.emit("nonfinite_total", nonfinite, {"what": "grad"})

        parts_to_combine: list[tuple[torch.Tensor, ReduceOp]] = [(sq, "sum")]
        if history is not None:
            parts_to_combine.append((history, "sum"))
        ctx.combine(parts_to_combine, finish, across_ranks=monitor.sharded)

    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite": self._nonfinite.cpu() if self._nonfinite is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("nonfinite") is not None:
            self._nonfinite = state["nonfinite"].clone()

    def reset(self) -> None:
        self._grad_norms = self._before = None
        self._history.reset()

    def close(self) -> None:
        self.reset()
        self._history.remove()
