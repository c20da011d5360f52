"""Table stakes around the optimizer step: gradient and parameter norms, the
update-to-weight ratio, non-finite gradients (docs/signals.md, "Optimizer step").

``grad_norm`` is the global gradient L2 norm before clipping, taken at the end of
every backward (:mod:`~trainvitals.hooks.signals.grad_norm.backward`), with
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

import math
from typing import Any

import torch

from trainvitals.hooks.grad_norms import GradNorms
from trainvitals.hooks.host_finish import RatioRootFinish
from trainvitals.hooks.sampling import TensorsSample
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.grad_norm.backward import BackwardGradNorms
from trainvitals.hooks.step import Labels, ReduceOp, StepContext
from trainvitals.hooks.tensors import NormPlan, RepeatedSum, flat, foreach_norm32, local
from trainvitals.wire.signals import SignalSpec


class _Layout:
    """One arrangement of the optimizer's parameters, made again only when the
    parameters, their storage or the sample size change: the update sample's buffers
    and the views every report reads (each view made per report would be an op of a
    few microseconds)."""

    def __init__(self, monitor: MonitorView, params: list[torch.Tensor], group_of: list[int]) -> None:
        dev = monitor.device
        self.n_groups = len(monitor.optimizer.param_groups)
        self.group_of = group_of
        self.group_by_id = {id(p): g for p, g in zip(params, group_of, strict=True)}
        self.tensors = [local(p).detach() for p in params]
        self.sample = TensorsSample([flat(t).numel() for t in self.tensors], monitor.config.update_sample)
        size = sum(self.sample.sizes)
        self.before = torch.empty(size, dtype=torch.float32, device=dev)
        self.after = torch.empty(size, dtype=torch.float32, device=dev)
        self.diff = torch.empty(size, dtype=torch.float32, device=dev)
        self.on_device = bool(self.tensors) and all(t.device == dev for t in self.tensors)
        # Views of the parameters kept while their storage is the same (the key of the
        # layout); a non-contiguous tensor's flat view would be a copy: made each time.
        self.kept = all(t.is_contiguous() or t.dim() <= 1 for t in self.tensors)
        self.sources = self.sample.sources(self.tensors) if self.on_device and self.kept else []
        self.before_dst = self.sample.destinations(self.before)
        self.after_dst = self.sample.destinations(self.after)
        # The sample's elements per group (parameters are listed group by group).
        per_group = [0] * self.n_groups
        for g, k in zip(group_of, self.sample.sizes, strict=True):
            per_group[g] += k
        self.diff_groups = list(self.diff.split(per_group))
        self.after_groups = list(self.after.split(per_group))
        # Small tensors of one shape normed together (NormPlan) when the model has them.
        plan = NormPlan(self.tensors, dev)
        self.param_plan = plan if plan.groups else None
        self.matrices: dict[tuple[Any, ...], _Matrix] = {}
        # Replicated pieces (tensor parallel): each parameter's share of the sums over
        # ranks, folded in before the one collective (None: every piece counts once).
        self.weights: list[float] | None = None
        self.sample_weight: torch.Tensor | None = None
        self.column_weights: dict[tuple[Any, ...], torch.Tensor] = {}
        if monitor.weighted:
            self.weights = [monitor.weight_of(p) for p in params]
            roots = torch.tensor([math.sqrt(w) for w in self.weights], dtype=torch.float32)
            sizes = torch.tensor(self.sample.sizes, dtype=torch.long)
            self.sample_weight = torch.repeat_interleave(roots, sizes).to(dev)

    def take(self, dst: list[torch.Tensor], buf: torch.Tensor, dev: torch.device) -> None:
        """The sample of the parameters now into ``buf`` (through its views ``dst``)."""
        if self.on_device:  # every tensor's sample in one call
            torch._foreach_copy_(dst, self.sources if self.kept else self.sample.sources(self.tensors))
        elif self.tensors:
            buf.copy_(self.sample.take(self.tensors, dev))

    def weigh(
        self, squares: torch.Tensor, monitor: MonitorView, grad_params: list[torch.Tensor] | None, upd: bool
    ) -> None:
        """Scale the squares (as :meth:`_Matrix.squares` lays them out) by each column's
        parameter share of the sums over ranks; the update sample is weighted per element."""
        if self.weights is None:
            return
        key = (tuple(map(id, grad_params)) if grad_params is not None else None, upd, squares.numel())
        w = self.column_weights.get(key)
        if w is None:
            grads = [monitor.weight_of(p) for p in grad_params] if grad_params is not None else []
            row = grads + self.weights + ([1.0] * (2 * self.n_groups) if upd else [])
            copies = squares.numel() // len(row)
            w = self.column_weights[key] = torch.tensor(row * copies, dtype=squares.dtype).to(squares.device)
        squares.mul_(w)

    def matrix(self, grad_groups: tuple[int, ...] | None, whole_grad: bool, upd: bool, dev: torch.device) -> _Matrix:
        """``M(x, bias)`` turns x, the squares of [gradient norms (of the
        parameters in ``grad_groups``; None: no gradient row), parameter norms, the
        sample's update and the sample per group], into the numerators then the
        denominators of the emitted values before their root: [whole model (unless
        ``whole_grad`` is False for the gradient), group 0, group 1, ...] per statistic;
        a norm's denominator is 1. The result goes into a kept buffer whose halves,
        numerators and denominators, are kept views."""
        key = (grad_groups, whole_grad, upd)
        if key not in self.matrices:
            g = self.n_groups
            n_g = len(grad_groups) if grad_groups is not None else 0
            n_p = len(self.group_of)
            rows: list[tuple[list[int], list[int] | None]] = []  # (numerator columns, denominator columns)

            def family(num: list[list[int]], den: list[list[int]] | None, whole: bool = True) -> None:
                if whole:
                    rows.append(([c for m in num for c in m], None if den is None else [c for d in den for c in d]))
                rows.extend((m, None if den is None else den[k]) for k, m in enumerate(num))

            if grad_groups is not None:
                family([[j for j, gg in enumerate(grad_groups) if gg == k] for k in range(g)], None, whole_grad)
            family([[n_g + j for j, gg in enumerate(self.group_of) if gg == k] for k in range(g)], None)
            if upd:
                base = n_g + n_p
                family([[base + k] for k in range(g)], [[base + g + k] for k in range(g)])
            k = len(rows)
            pairs: list[tuple[int, int]] = []
            bias = torch.zeros(2 * k + 1, dtype=torch.float32)  # and the scratch row
            for r, (num, den) in enumerate(rows):
                pairs += [(r, c) for c in num]
                if den is None:
                    bias[k + r] = 1.0
                else:
                    pairs += [(k + r, c) for c in den]
            columns = n_g + n_p + (2 * g if upd else 0)
            self.matrices[key] = _Matrix(RepeatedSum(2 * k, pairs, columns, dev, torch.float32), bias.to(dev))
        return self.matrices[key]


_ROOT_OF_RATIO = RatioRootFinish()


class _Matrix:
    """A layout's :class:`RepeatedSum` with its bias and kept output: numerators, then
    denominators (then the scratch row, not emitted)."""

    def __init__(self, sums: RepeatedSum, bias: torch.Tensor) -> None:
        self.sums, self.bias = sums, bias
        self._out = torch.empty_like(bias)
        self.out = self._out[: sums.rows]  # the view emitted, made once

    def squares(self, blocks: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """The blocks' and values' squares, copied as the sums read them (a kept buffer)."""
        return self.sums.fill(blocks, values).square_()

    def fractions(self, squares: torch.Tensor) -> torch.Tensor:
        """The numerators then the denominators of the emitted values (the kept output,
        read in this report): :class:`RatioRootFinish` takes the root of each ratio."""
        self.sums(squares, self.bias, out=self._out)
        return self.out


class OptimizerStats(Signal):
    spec = SignalSpec(
        name="optimizer",
        covers="gradient and parameter norms, update ratios",
        how_to_ask="signals= leaves out 'optimizer'",
        group="optimizer",
        title="Optimizer step",
        selectable=True,
        per_parameter_sums=True,
    )
    covers = spec.name
    uses_grad_norms = True

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._layout: _Layout | None = None
        self._before: _Layout | None = None  # the layout whose before buffer holds this step's sample
        self._nonfinite: torch.Tensor | None = None  # [1]
        self._history = BackwardGradNorms(self)
        self._series_key: tuple[Any, ...] | None = None
        self._series_of: list[tuple[str, list[Labels]]] = []
        self._flags: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._history.bind(monitor)
        return []

    def after_step(self, monitor: MonitorView, reporting: bool) -> None:
        self._history.end_step(monitor)

    def _current(self, monitor: MonitorView) -> _Layout:
        groups = monitor.optimizer.param_groups
        params = [p for g in groups for p in g["params"]]
        # the storage too: a parameter whose .data was replaced needs views of the new one
        key = (tuple(map(id, params)), tuple(local(p).data_ptr() for p in params), monitor.config.update_sample)
        if key != self._key or self._layout is None:
            group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
            self._key, self._layout = key, _Layout(monitor, params, group_of)
        return self._layout

    def _series(self, monitor: MonitorView, grad: bool, whole_grad: bool, upd: bool) -> list[tuple[str, list[Labels]]]:
        """The emitted series and labels, kept while the group labels and flags stay."""
        labels = tuple(str(g.get("name", i)) for i, g in enumerate(monitor.optimizer.param_groups))
        key = (labels, grad, whole_grad, upd)
        if key != self._series_key:
            group_labels: list[Labels] = [{"group": label} for label in labels]
            series: list[tuple[str, list[Labels]]] = []
            for name, present in (("grad_norm", grad), ("param_norm", True), ("update_ratio", upd)):
                if present:
                    if name != "grad_norm" or whole_grad:
                        series.append((name, [{}]))
                    series.append(("group_" + name, group_labels))
            self._series_key, self._series_of = key, series
        return self._series_of

    def _step_flags(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A kept [1, finite] vector, its finite element as a view, and the [1, -1] row
        that turns it into 1 - finite (rebuilt on another device)."""
        if self._flags is None or self._flags[0].device != dev:
            flags = torch.ones(2, device=dev)
            self._flags = (flags, flags[1:], torch.tensor([[1.0, -1.0]], device=dev))
        return self._flags

    def measured_grad_norms(self) -> GradNorms | None:
        fresh = self._history.fresh()  # taken at the end of the backward: no second pass
        if fresh is None:
            return None
        params, norms, shares = fresh
        return GradNorms(params, norms, "backward", _shares=shares)

    def before_step(self, monitor: MonitorView, reporting: bool) -> None:
        if reporting:
            layout = self._current(monitor)
            layout.take(layout.before_dst, layout.before, monitor.device)
            self._before = layout

    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        dev = monitor.device
        # The layout before_step of this report found: only optimizer.step() ran since
        # (it changes values, not which tensors or their storage), so no second look.
        layout = self._before if self._before is not None else self._current(monitor)
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(1, device=dev)
        self._nonfinite = self._nonfinite.to(dev)
        history = self._history.take()
        upd = self._before is layout and bool(layout.tensors)
        self._before = None
        step_norms = ctx.grad_norms
        problem = monitor.grad_layout_problem(step_norms.params) if step_norms is not None else None
        if problem is not None:  # never a figure from pieces that cannot be combined
            ctx.inactive_when("optimizer", None, "sharded", problem)
            return
        applied_bad: torch.Tensor | None = None
        if step_norms is not None and step_norms.measured == "applied":
            # The gradient the optimizer applies is not finite although the backward's was
            # (set or scaled by hand after the backward), or no backward was seen: count
            # the step here; the backward's non-finite steps are counted from the history.
            # (Norms from the backward are the history's last step: counted there.)
            # x - x is 0 exactly for a finite x and NaN for inf or NaN.
            gn = step_norms.norms
            applied_bad = (gn - gn).ne(0).any(0, keepdim=True)
            if history is not None:
                last = history[-1:]
                applied_bad = applied_bad & (last - last).eq(0)
        # One foreach norm: the parameters, the sample's update and the sample, per group.
        norm_inputs: list[torch.Tensor] = [] if layout.param_plan is not None else list(layout.tensors)
        if upd:
            layout.take(layout.after_dst, layout.after, dev)
            torch.sub(layout.after, layout.before, out=layout.diff)
            if layout.sample_weight is not None:  # squares weighted by each piece's share
                layout.diff.mul_(layout.sample_weight)
                layout.after.mul_(layout.sample_weight)
            norm_inputs += layout.diff_groups + layout.after_groups
        pieces = [step_norms.norms] if step_norms is not None else []
        if layout.param_plan is not None:
            pieces.append(layout.param_plan.norms(layout.tensors))
        norms = foreach_norm32(norm_inputs) if norm_inputs else []  # copied as they are: no stack
        grad_groups = None
        if step_norms is not None:
            grad_groups = tuple(layout.group_by_id.get(id(p), 0) for p in step_norms.params)
        matrix = layout.matrix(grad_groups, history is None, upd, dev)
        squares = matrix.squares(pieces, norms)
        layout.weigh(squares, monitor, step_norms.params if step_norms is not None else None, upd)
        series = self._series(monitor, step_norms is not None, history is None, upd)

        def finish(sq: torch.Tensor, *rest: torch.Tensor) -> None:
            # Each piece is its own emit, in the order of the report: the pack's one
            # concatenation joins them (no cat here, no expand of the presence flag).
            ctx.emit_block(series, matrix.fractions(sq), host=_ROOT_OF_RATIO)
            nonfinite = self._nonfinite
            assert nonfinite is not None  # set by collect above; nothing sets it back to None
            if applied_bad is not None:
                nonfinite = nonfinite + applied_bad
            if rest:  # the per-step squared norms since the previous report, combined across shards
                norms = rest[0].sqrt()
                if norms.numel() == 1:  # one step since the report before (every=1): its norm is max and mean
                    flags, finite, count = self._step_flags(norms.device)
                    # 1.0 when finite, 0.0 for inf and NaN (one op, unlike isfinite), written
                    # after a kept 1: one product [1, -1] . [1, finite] counts the step.
                    torch.lt(norms, float("inf"), out=finite)
                    last = top = mean = norms  # a non-finite step's max and mean are gated out
                    nonfinite = torch.addmv(nonfinite, count, flags)
                    present = finite
                else:
                    # non-finite steps as -1 (a finite norm is >= 0): left out of the max and the mean
                    marked = torch.nan_to_num(norms, nan=-1.0, posinf=-1.0)
                    count = marked.ge(0).sum(0, keepdim=True)
                    last, top = norms[-1:], marked.amax(0, keepdim=True)
                    mean = marked.clamp_min(0).sum(0, keepdim=True) / count
                    nonfinite = nonfinite + (norms.numel() - count)
                    present = count
                ctx.emit("grad_norm", last)
                ctx.emit("grad_norm_max", top, present=present)
                ctx.emit("grad_norm_mean", mean, present=present)
            self._nonfinite = nonfinite
            ctx.emit("nonfinite_total", nonfinite, {"what": "grad"})

        parts_to_combine: list[tuple[torch.Tensor, ReduceOp]] = [(squares, "sum")]
        if history is not None:
            parts_to_combine.append((history, "sum"))
        ctx.combine(parts_to_combine, finish, across_ranks=monitor.sharded)

    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite": self._nonfinite.reshape(()).cpu() if self._nonfinite is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("nonfinite") is not None:
            self._nonfinite = state["nonfinite"].reshape(1).clone()

    def reset(self) -> None:
        self._before = None
        self._history.reset()

    def close(self) -> None:
        self.reset()
        self._history.remove()
