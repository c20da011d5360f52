"""Adam's moments (docs/incidents.md, I4): how much of each parameter Adam's epsilon
dominates, how big its normalized steps are, the moment norms.

With the group's ``betas = (b1, b2)``, ``eps`` and the parameter's own step count t:

    m_hat = exp_avg / (1 - b1**t)        v_hat = v / (1 - b2**t)

where v is ``exp_avg_sq``, or ``max_exp_avg_sq`` with ``amsgrad`` (what torch's
Adam divides by). The bias corrections are tensor ops on the stacked step tensors
(CPU for plain/foreach, on the device for fused/capturable): no host sync.

- ``adam_eps_dominated_ratio``: share of elements with sqrt(v_hat) < eps, where
  Adam's step is about lr * m / eps instead of lr * sign-like.
- ``adam_normalized_update_rms``: RMS of m_hat / (sqrt(v_hat) + eps), the update
  over the learning rate; near 1 when steps are sign-like.
- ``adam_exp_avg_norm`` / ``adam_exp_avg_sq_norm``: L2 norms of exp_avg and
  exp_avg_sq.

Per parameter that has a ``param`` series (1D ones; with ``per_param=True`` also
ndim >= 2; see :mod:`~trainvitals.hooks.signals.param_series`), and per param group
(label ``group``) over the group's other parameters. The moment norms are exact.
The two ratios are exact for 1D parameters and for tensors of at most
``update_sample`` elements; larger tensors use a :class:`~trainvitals.hooks.sampling.BlockSample`
of that many elements, processed in batches of bounded size, so a report costs one
pass over the moments for the norms and little else.
"""

from __future__ import annotations

import torch

from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.sampling import BlockSample, owner_index
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.signals.optimizer_state import (
    AdamEntry,
    StateWalk,
    is_adam_group,
    stack_steps,
)
from trainvitals.hooks.signals.param_series import choose
from trainvitals.hooks.step import StepContext
from trainvitals.hooks.tensors import flat, foreach_norm32, local, real

BATCH = 1 << 18
"""Sampled elements per batch: bounds the temporaries to a few MB."""
_TINY = 1e-30


class _Batch:
    """One batch of samples: its segments ``(entry, first, last)`` and each element's entry."""

    def __init__(self, segments: list[tuple[int, int, int]], dev: torch.device):
        self.segments = segments
        self.lengths = [b - a for _, a, b in segments]
        self.size = sum(self.lengths)
        owners = [i for i, _, _ in segments]
        self.index = owner_index(self.lengths, dev, owners)
        self.owner = torch.tensor(owners, dtype=torch.long).to(dev)


class MomentPlan:
    """One arrangement of Adam entries: how each is sampled, the batches of samples,
    which series and group each entry feeds."""

    def __init__(
        self,
        monitor: MonitorView,
        entries: list[AdamEntry],
        series_of: dict[int, tuple[int, bool]],
        series_labels: list[dict[str, str]],
    ):
        dev = monitor.device
        cap = monitor.config.update_sample
        groups = monitor.groups()
        self.samples: list[BlockSample | None] = []  # None: every element
        sizes: list[int] = []
        series_entries, series_bins, group_entries, group_bins = [], [], [], []
        group_slot: dict[int, int] = {}
        for i, e in enumerate(entries):
            n = local(e.param).numel() * (2 if e.param.is_complex() else 1)
            pos, one_d = series_of.get(id(e.param), (-1, False))
            sample = None if one_d else BlockSample.plan(n, cap)
            self.samples.append(sample)
            sizes.append(n if sample is None else sample.size)
            if pos >= 0:
                series_entries.append(i)
                series_bins.append(pos)
            if not one_d:
                group_entries.append(i)
                group_bins.append(group_slot.setdefault(e.group, len(group_slot)))
        self.sampled = torch.tensor(sizes, dtype=torch.float64).to(dev)
        self.batches = self._batches(sizes, dev)
        width = max((b.size for b in self.batches), default=0)
        self.m_buf = torch.empty(width, dtype=torch.float32, device=dev)
        self.v_buf = torch.empty(width, dtype=torch.float32, device=dev)
        self.n_series = len(series_labels)
        self.series_entries = torch.tensor(series_entries, dtype=torch.long).to(dev)
        self.series_bins = torch.tensor(series_bins, dtype=torch.long).to(dev)
        self.group_entries = torch.tensor(group_entries, dtype=torch.long).to(dev)
        self.group_bins = torch.tensor(group_bins, dtype=torch.long).to(dev)
        self.n_groups = len(group_slot)
        present = sorted(set(series_bins))
        self.series_keep = torch.tensor(present, dtype=torch.long).to(dev)
        self.labels = [series_labels[b] for b in present] + [
            {"group": groups[g][0]} for g, _ in sorted(group_slot.items(), key=lambda kv: kv[1])
        ]
        self.all_series_present = len(present) == self.n_series

    def _batches(self, sizes: list[int], dev: torch.device) -> list[_Batch]:
        """Batches of at most BATCH sampled elements; a sample larger than a batch (a huge
        1D parameter) is split, a block sample only between whole runs."""
        batches: list[_Batch] = []
        segments: list[tuple[int, int, int]] = []
        room = BATCH
        for i, k in enumerate(sizes):
            start = 0
            sample = self.samples[i]
            while start < k:
                take = min(k - start, room)
                if sample is not None:
                    take -= take % sample.width
                if take == 0:
                    batches.append(_Batch(segments, dev))
                    segments, room = [], BATCH
                    continue
                segments.append((i, start, start + take))
                room -= take
                start += take
                if room == 0:
                    batches.append(_Batch(segments, dev))
                    segments, room = [], BATCH
        if segments:
            batches.append(_Batch(segments, dev))
        return batches

    def pair(
        self, t: torch.Tensor, entry: int, first: int, last: int, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination, source) views of the same shape for elements ``first:last`` of
        entry ``entry``'s sample of ``t``, to copy with one foreach call per batch."""
        sample = self.samples[entry]
        if sample is None:
            return out, flat(t)[first:last]
        x = t if t.is_contiguous() and not t.is_complex() else flat(t)
        view = x.as_strided((sample.blocks, sample.width), (sample.spacing, 1), x.storage_offset())
        return out.view(-1, sample.width), view[first // sample.width : last // sample.width]


class AdamMoments:
    """Emits the moment statistics of the Adam-family entries of one state walk."""

    def __init__(self) -> None:
        self._plan_key: tuple | None = None
        self._plan: MomentPlan | None = None
        self._series_key: tuple | None = None
        self._series: tuple[dict[int, tuple[int, bool]], list[dict[str, str]]] = ({}, [])
        self._indices = IndexCache()

    def _series_map(self, monitor: MonitorView, key: tuple) -> tuple[dict[int, tuple[int, bool]], list[dict[str, str]]]:
        if key != self._series_key:
            self._series_key = key
            series = choose(monitor)
            self._series = (
                {id(s.param): (i, s.param.ndim <= 1) for i, s in enumerate(series)},
                [{"param": s.name} for s in series],
            )
        return self._series

    def _hyperparameters(self, monitor: MonitorView, entries: list[AdamEntry]) -> torch.Tensor:
        """[3, E] float64: beta1, beta2, eps of each entry's group."""
        groups = monitor.optimizer.param_groups
        per_group = [(g["betas"][0], g["betas"][1], g["eps"]) if is_adam_group(g) else (0.0, 0.0, 0.0) for g in groups]
        dev = monitor.device
        if any(isinstance(x, torch.Tensor) for row in per_group for x in row):
            return torch.stack(
                [
                    torch.stack(
                        [torch.as_tensor(x, dtype=torch.float64).to(dev).reshape(()) for x in per_group[e.group]]
                    )
                    for e in entries
                ],
                1,
            )
        flat_values = [float(x) for e in entries for x in per_group[e.group]]
        return self._indices.get(flat_values, dev, torch.float64).view(-1, 3).t()

    def collect(self, monitor: MonitorView, ctx: StepContext, key: tuple, walk: StateWalk, now: torch.Tensor) -> None:
        dev = monitor.device
        entries = walk.entries
        series_of, series_labels = self._series_map(monitor, key)
        plan_key = (key, tuple(id(e.param) for e in entries), monitor.config.update_sample)
        if plan_key != self._plan_key:
            self._plan_key = plan_key
            self._plan = MomentPlan(monitor, entries, series_of, series_labels)
        plan = self._plan
        assert plan is not None

        if len(walk.entry_steps) == len(walk.steps):
            steps = now.to(torch.float64)
        else:
            steps = now.to(torch.float64).index_select(0, self._indices.get(walk.entry_steps, dev))
        b1, b2, eps = self._hyperparameters(monitor, entries)
        bc1 = (1 - b1**steps).clamp_min(_TINY)
        bc2 = (1 - b2**steps).clamp_min(_TINY)

        sharded = monitor.sharded
        ms = [e.state["exp_avg"] for e in entries]
        vs = [e.v for e in entries]
        raw = vs if all(e.v is e.state["exp_avg_sq"] for e in entries) else [e.state["exp_avg_sq"] for e in entries]
        if sharded:
            ms, vs, raw = [local(t) for t in ms], [local(t) for t in vs], [local(t) for t in raw]
        both = foreach_norm32([real(t) for t in ms] + [real(t) for t in raw])
        sq = stack_steps(list(both), dev).to(torch.float64).square().view(2, -1)
        m_sq, v_sq = sq[0], sq[1]

        # Per element only c = eps * sqrt(1 - b2^t) is needed:
        #   sqrt(v_hat) < eps  <=>  sqrt(v) < c
        #   (m_hat / (sqrt(v_hat) + eps))^2 = m^2 / (sqrt(v) + c)^2 * (1 - b2^t) / (1 - b1^t)^2
        # the last factor is applied per entry, after the sums.
        c = (eps * bc2.sqrt()).to(torch.float32)
        dominated = torch.zeros(len(entries), dtype=torch.float64, device=dev)
        update_sq = torch.zeros(len(entries), dtype=torch.float64, device=dev)
        for batch in plan.batches:
            m, v = plan.m_buf[: batch.size], plan.v_buf[: batch.size]
            dst, src = [], []
            for (i, a, b), mo, vo in zip(batch.segments, m.split(batch.lengths), v.split(batch.lengths), strict=True):
                for out, t in ((mo, ms[i]), (vo, vs[i])):
                    d, s = plan.pair(t, i, a, b, out)
                    dst.append(d)
                    src.append(s)
            torch._foreach_copy_(dst, src)  # every segment of the batch in one call
            ce = c.index_select(0, batch.index)
            v.sqrt_()
            below = (v < ce).to(torch.float32)
            m.div_(v.add_(ce))
            # Per-segment sums of squares (of 0/1 for the count) in one foreach call.
            sums = (
                stack_steps(list(torch._foreach_norm([*m.split(batch.lengths), *below.split(batch.lengths)])), dev)
                .to(torch.float64)
                .square()
            )
            k = len(batch.lengths)
            update_sq.index_add_(0, batch.owner, sums[:k])
            dominated.index_add_(0, batch.owner, sums[k:].round())
        update_sq = update_sq * bc2 / bc1.square()

        per_entry = torch.stack([m_sq, v_sq, dominated, update_sq, plan.sampled])  # [5, E]
        parts = []
        if plan.n_series:
            s = torch.zeros(5, plan.n_series, dtype=torch.float64, device=dev).index_add_(
                1, plan.series_bins, per_entry.index_select(1, plan.series_entries)
            )
            parts.append(s if plan.all_series_present else s.index_select(1, plan.series_keep))
        if plan.n_groups:
            parts.append(
                torch.zeros(5, plan.n_groups, dtype=torch.float64, device=dev).index_add_(
                    1, plan.group_bins, per_entry.index_select(1, plan.group_entries)
                )
            )
        if not parts:
            return
        labels = plan.labels

        def finish(t: torch.Tensor) -> None:
            t = t.view(5, -1)
            ctx.emit("adam_eps_dominated_ratio", t[2] / t[4].clamp_min(1), labels)
            ctx.emit("adam_normalized_update_rms", (t[3] / t[4].clamp_min(1)).sqrt(), labels)
            ctx.emit("adam_exp_avg_norm", t[0].sqrt(), labels)
            ctx.emit("adam_exp_avg_sq_norm", t[1].sqrt(), labels)

        ctx.combine([(torch.cat(parts, 1), "sum")], finish, across_ranks=sharded)

    def close(self) -> None:
        self._plan = None
