"""Table stakes around the optimizer step: gradient and parameter norms, the
update-to-weight ratio, non-finite gradients (docs/signals.md, "Optimizer step").

``grad_norm`` is the global gradient L2 norm before clipping, taken at the end of
every backward (:mod:`~trainvitals.hooks.signals.backward_grad_norm`), with
``grad_norm_max`` / ``grad_norm_mean`` over the steps since the previous report, and
``nonfinite_total{what="grad"}`` the steps whose gradient was not finite.
``group_grad_norm{group}`` is the L2 norm of one param group's gradients, from the
step's per-parameter norms (:mod:`~trainvitals.hooks.grad_norms`: the same
measurement, before clipping, unscaled by a GradScaler); when no backward was seen
completing the step's gradient (gradients set by hand, the short last step of an
epoch), both are taken as the optimizer is about to use them. Every ``grad_norm``
series is emitted here.
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

from trainvitals.hooks.grad_norms import GradNorms
from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.sampling import TensorsSample
from trainvitals.hooks.signals.backward_grad_norm import BackwardGradNorms
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.step import ReduceOp, StepContext
from trainvitals.hooks.tensors import NormPlan, flat, local


class OptimizerStats(Signal):
    covers = "optimizer"
    uses_grad_norms = True

    def __init__(self) -> None:
        self._param_norms: list[Any] = [None]  # NormPlan.cached's slot, for the parameters' norms
        self._before: torch.Tensor | None = None
        self._sample_key: tuple | None = None
        self._sample: TensorsSample | None = None
        self._sample_group: torch.Tensor | None = None
        # Two buffers for the sample (before and after the step) and their views, per sample layout.
        self._sample_bufs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._sample_dst: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._bins: tuple[int, tuple[torch.Tensor | None, ...], torch.Tensor] | None = None
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

    def _sampled(
        self, monitor: MonitorView, params: list[torch.Tensor], group_of: list[int], after: bool
    ) -> torch.Tensor:
        """The sample of ``params`` as float32 on the device, in the before (or after)
        buffer: copied by one foreach call into views made once per layout."""
        dev = monitor.device
        key = tuple((id(p), p.numel()) for p in params)
        if key != self._sample_key:
            self._sample_key = key
            self._sample = TensorsSample([flat(local(p)).numel() for p in params], monitor.config.update_sample)
            self._sample_group = self._sample.owners(dev, group_of)
            bufs = [torch.empty(sum(self._sample.sizes), dtype=torch.float32, device=dev) for _ in range(2)]
            self._sample_bufs = ([bufs[0]], [bufs[1]])
            self._sample_dst = (self._sample.destinations(bufs[0]), self._sample.destinations(bufs[1]))
        assert self._sample is not None
        tensors = [local(p) for p in params]
        if not tensors or any(t.device != dev for t in tensors):
            return self._sample.take(tensors, dev)  # a non-blocking copy to the device per tensor
        self._sample.take_into(tensors, self._sample_dst[after])
        return self._sample_bufs[after][0]

    def measured_grad_norms(self) -> GradNorms | None:
        fresh = self._history.fresh()  # taken at the end of the backward: no second pass
        return GradNorms(*fresh, "backward") if fresh is not None else None

    def before_step(self, monitor: MonitorView, reporting: bool) -> None:
        if reporting:
            params, group_of = self._params(monitor)
            self._before = self._sampled(monitor, params, group_of, after=False)

    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        dev = monitor.device
        groups = monitor.groups()
        n_groups = len(groups)
        params, group_of = self._params(monitor)
        group_labels = [{"group": label} for label, _ in groups]

        if self._nonfinite is None:
            self._nonfinite = torch.zeros((), device=dev)
        self._nonfinite = self._nonfinite.to(dev)
        history = self._history.take()
        # Per-element values whose squares are summed per group, and their group bins:
        # all rows go through one square and one index_add.
        values: list[torch.Tensor] = []
        bins: list[torch.Tensor | None] = []
        step_norms = ctx.grad_norms
        if step_norms is not None:
            gn = step_norms.norms
            group_by_id = {id(p): g for p, g in zip(params, group_of, strict=True)}
            grad_group = self._indices.get([group_by_id.get(id(p), 0) for p in step_norms.params], dev)
            # The gradient the optimizer applies is not finite although the backward's was
            # (set or scaled by hand after the backward), or no backward was seen: count
            # the step here; the backward's non-finite steps are counted from the history.
            # x - x is 0 exactly for a finite x and NaN for inf or NaN: isfinite in two
            # ops where torch.isfinite takes four.
            applied_bad = (gn - gn).ne(0).any()
            if history is not None:
                last = history[-1]
                applied_bad = applied_bad & (last - last).eq(0)
            self._nonfinite = self._nonfinite + applied_bad
            values.append(gn)
            bins.append(grad_group)
        # under no_grad: no detach needed; by shape groups (NormPlan), the plan kept per params
        values.append(NormPlan.cached(self._param_norms, tuple(map(id, params)), [local(p) for p in params], dev))
        bins.append(self._indices.get(group_of, dev))
        upd = False
        if self._before is not None and self._sample_group is not None:
            after = self._sampled(monitor, params, group_of, after=True)
            if after.shape == self._before.shape:
                upd = True
                values += [after - self._before, after]
                bins += [self._sample_group, None]  # None: the same bins as the row before
        self._before = None
        # Sums of squares, rows of [whole model, g0, g1, ...]; summed across ranks when sharded.
        rows = len(values)
        per_group = (
            torch.zeros(rows * n_groups, dtype=torch.float32, device=dev)
            .index_add_(0, self._row_bins(bins, n_groups), torch.cat(values).square())
            .view(rows, n_groups)
        )
        sq = torch.cat([per_group.sum(1, keepdim=True), per_group], 1)
        has_grad = step_norms is not None

        def emit(name: str, values: torch.Tensor, whole: bool = True) -> None:
            if whole:
                ctx.emit(name, values[0])
            ctx.emit("group_" + name, values[1:], group_labels)

        def finish(total: torch.Tensor, *rest: torch.Tensor) -> None:
            total = total.view(-1, n_groups + 1)
            row = 0
            roots = total[: 1 + int(has_grad)].sqrt()  # the norms: grad (when seen), param
            if has_grad:
                emit("grad_norm", roots[row], whole=history is None)
                row += 1
            emit("param_norm", roots[row])
            row += 1
            if upd:
                emit("update_ratio", (total[row] / total[row + 1]).sqrt())
            nonfinite = self._nonfinite
            assert nonfinite is not None  # set by collect above; nothing sets it back to None
            if rest:  # the per-step squared norms, combined across shards
                nonfinite = self._nonfinite = nonfinite + _emit_history(ctx, rest[0])
            ctx.emit("nonfinite_total", nonfinite, {"what": "grad"})

        parts_to_combine: list[tuple[torch.Tensor, ReduceOp]] = [(sq, "sum")]
        if history is not None:
            parts_to_combine.append((history, "sum"))
        ctx.combine(parts_to_combine, finish, across_ranks=monitor.sharded)

    def _row_bins(self, bins: list[torch.Tensor | None], n_groups: int) -> torch.Tensor:
        """Group bins of the rows laid end to end (row r's bins offset by r * n_groups);
        made again only when a row's bins are other tensors (their content is cached)."""
        cached = self._bins
        if (
            cached is None
            or cached[0] != n_groups
            or len(cached[1]) != len(bins)
            or any(a is not b for a, b in zip(cached[1], bins, strict=True))
        ):
            parts, last = [], None
            for r, b in enumerate(bins):
                last = b if b is not None else last
                assert last is not None  # the first row always has its bins
                parts.append(last + r * n_groups)
            cached = self._bins = (n_groups, tuple(bins), torch.cat(parts))
        return cached[2]

    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite": self._nonfinite.cpu() if self._nonfinite is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("nonfinite") is not None:
            self._nonfinite = state["nonfinite"].clone()

    def reset(self) -> None:
        self._before = None
        self._history.reset()

    def close(self) -> None:
        self.reset()
        self._history.remove()


def _emit_history(ctx: StepContext, sq: torch.Tensor) -> torch.Tensor:
    """Emit ``grad_norm`` (the last step), ``grad_norm_max`` / ``grad_norm_mean`` (over the
    finite steps of ``sq``, the squared norms since the previous report, absent when
    none); return the number of non-finite steps."""
    norms = sq.sqrt()
    finite = torch.isfinite(norms)
    count = finite.sum()
    ctx.emit("grad_norm", norms[-1])
    ctx.emit("grad_norm_max", torch.where(finite, norms, float("-inf")).amax(), present=(count > 0).float())
    ctx.emit("grad_norm_mean", torch.where(finite, norms, 0.0).sum() / count, present=(count > 0).float())
    return (~finite).sum()
