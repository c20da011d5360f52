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

from typing import Any

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
from trainvitals.hooks.tensors import NormPlan, flat, local, real

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
        # Views of the plan's buffers, made on the first report (see MomentPlan.views).
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.below: torch.Tensor | None = None
        self.dst: list[torch.Tensor] = []
        self.parts: list[torch.Tensor] = []


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
        self.sampled = torch.tensor(sizes, dtype=torch.float64).to(dev).view(1, -1)
        self.batches = self._batches(sizes, dev)
        width = max((b.size for b in self.batches), default=0)
        self.m_buf = torch.empty(width, dtype=torch.float32, device=dev)
        self.v_buf = torch.empty(width, dtype=torch.float32, device=dev)
        self.below_buf = torch.empty(width, dtype=torch.float32, device=dev)
        self.n_series = len(series_labels)
        self.n_groups = len(group_slot)
        present = sorted(set(series_bins))
        # Series and groups binned by one index_add: group bins follow the series bins.
        n_bins = self.n_series + self.n_groups
        self.n_bins = n_bins
        bin_entries = series_entries + group_entries
        self.bin_entries = (
            None if bin_entries == list(range(len(entries))) else torch.tensor(bin_entries, dtype=torch.long).to(dev)
        )
        self.bins = torch.tensor(series_bins + [self.n_series + g for g in group_bins], dtype=torch.long).to(dev)
        keep = present + list(range(self.n_series, n_bins))
        self.keep = None if keep == list(range(n_bins)) else torch.tensor(keep, dtype=torch.long).to(dev)
        self.labels = [series_labels[b] for b in present] + [
            {"group": groups[g][0]} for g, _ in sorted(group_slot.items(), key=lambda kv: kv[1])
        ]

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

    def views(self, batch: _Batch) -> None:
        """Make ``batch``'s views of the plan's buffers once: the copy destinations (m
        segments then v segments, shaped like :meth:`source`'s views) and the segments
        of m and of the below-eps flags, whose norms are taken (each view is an op of a
        few microseconds at every report otherwise)."""
        if batch.m is not None:
            return
        batch.m, batch.v = self.m_buf[: batch.size], self.v_buf[: batch.size]
        batch.below = self.below_buf[: batch.size]
        ms, vs = batch.m.split(batch.lengths), batch.v.split(batch.lengths)
        batch.parts = [*ms, *batch.below.split(batch.lengths)]
        batch.dst = []
        for outs in (ms, vs):
            for (i, _, _), out in zip(batch.segments, outs, strict=True):
                sample = self.samples[i]
                batch.dst.append(out if sample is None else out.view(-1, sample.width))

    def source(self, t: torch.Tensor, entry: int, first: int, last: int) -> torch.Tensor:
        """A view of elements ``first:last`` of entry ``entry``'s sample of ``t``, shaped
        like its destination in :meth:`views`, to copy with one foreach call per batch."""
        sample = self.samples[entry]
        if sample is None:
            x = flat(t)
            return x if first == 0 and last == x.numel() else x[first:last]
        x = t if t.is_contiguous() and not t.is_complex() else flat(t)
        w = sample.width
        # Blocks first // w .. last // w of the sample, as one view.
        return x.as_strided(
            (last // w - first // w, w), (sample.spacing, 1), x.storage_offset() + first // w * sample.spacing
        )


class AdamMoments:
    """Emits the moment statistics of the Adam-family entries of one state walk."""

    def __init__(self) -> None:
        self._plan_key: tuple | None = None
        self._plan: MomentPlan | None = None
        self._norm_plan: list[Any] = [None]  # NormPlan.cached's slot, for the moments' norms
        self._series_key: tuple | None = None
        self._series: tuple[dict[int, tuple[int, bool]], list[dict[str, str]]] = ({}, [])
        self._indices = IndexCache()
        self._hp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (cached [3, E], betas, eps)

    def _series_map(self, monitor: MonitorView, key: tuple) -> tuple[dict[int, tuple[int, bool]], list[dict[str, str]]]:
        if key != self._series_key:
            self._series_key = key
            series = choose(monitor)
            self._series = (
                {id(s.param): (i, s.param.ndim <= 1) for i, s in enumerate(series)},
                [{"param": s.name} for s in series],
            )
        return self._series

    def _hyperparameters(self, monitor: MonitorView, entries: list[AdamEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ([2, E] beta1 and beta2, [E] eps) of each entry's group."""
        table = self._hyperparameter_table(monitor, entries)
        if self._hp is None or self._hp[0] is not table:  # the cached table's views are reused
            hp = table.view(-1, 3).t() if table.dim() == 1 else table
            self._hp = (table, hp[:2], hp[2])
        return self._hp[1], self._hp[2]

    def _hyperparameter_table(self, monitor: MonitorView, entries: list[AdamEntry]) -> torch.Tensor:
        """float64 beta1, beta2, eps of each entry's group: [3, E], or [E * 3] (entry by
        entry) from the index cache, the same tensor while the values stay the same."""
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
        return self._indices.get(flat_values, dev, torch.float64)

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
        betas, eps = self._hyperparameters(monitor, entries)
        bc1, bc2 = (1 - betas**steps).clamp_min(_TINY)  # [2, E]: both bias corrections at once

        sharded = monitor.sharded
        ms = [e.state["exp_avg"] for e in entries]
        vs = [e.v for e in entries]
        raw = vs if all(e.v is e.state["exp_avg_sq"] for e in entries) else [e.state["exp_avg_sq"] for e in entries]
        if sharded:
            ms, vs, raw = [local(t) for t in ms], [local(t) for t in vs], [local(t) for t in raw]
        moments = [real(t) for t in ms] + [real(t) for t in raw]
        # by shape groups (NormPlan: a few us less per tensor than a foreach norm and a stack)
        sq = NormPlan.cached(self._norm_plan, plan_key, moments, dev).to(torch.float64).square().view(2, -1)

        # Per element only c = eps * sqrt(1 - b2^t) is needed:
        #   sqrt(v_hat) < eps  <=>  sqrt(v) < c
        #   (m_hat / (sqrt(v_hat) + eps))^2 = m^2 / (sqrt(v) + c)^2 * (1 - b2^t) / (1 - b1^t)^2
        # the last factor is applied per entry, after the sums.
        c = (eps * bc2.sqrt()).to(torch.float32)
        # Rows: update sum of squares, elements below eps.
        acc = torch.zeros(2, len(entries), dtype=torch.float64, device=dev)
        for batch in plan.batches:
            plan.views(batch)
            m, v, below = batch.m, batch.v, batch.below
            assert m is not None and v is not None and below is not None
            src = [plan.source(ms[i], i, a, b) for i, a, b in batch.segments]
            src += [plan.source(vs[i], i, a, b) for i, a, b in batch.segments]
            torch._foreach_copy_(batch.dst, src)  # every segment of the batch in one call
            ce = c.index_select(0, batch.index)
            v.sqrt_()
            torch.lt(v, ce, out=below)  # 0/1 as float32
            m.div_(v.add_(ce))
            # Per-segment sums of squares (of 0/1 for the count) in one foreach call.
            sums = stack_steps(list(torch._foreach_norm(batch.parts)), dev).to(torch.float64).square()
            k = len(batch.lengths)
            sums[k:].round_()  # float32 norms of 0/1: the counts are integers
            acc.index_add_(1, batch.owner, sums.view(2, k))
        acc[0].mul_(bc2).div_(bc1.square())

        if not plan.n_bins:
            return
        # [5, E]: m, v sums of squares, update sum of squares, below eps, sampled elements.
        per_entry = torch.cat([sq, acc, plan.sampled])
        if plan.bin_entries is not None:
            per_entry = per_entry.index_select(1, plan.bin_entries)
        binned = torch.zeros(5, plan.n_bins, dtype=torch.float64, device=dev).index_add_(1, plan.bins, per_entry)
        if plan.keep is not None:
            binned = binned.index_select(1, plan.keep)
        labels = plan.labels

        def finish(t: torch.Tensor) -> None:
            t = t.view(5, -1)
            sampled = t[4].clamp_min(1)
            ctx.emit("adam_eps_dominated_ratio", t[3] / sampled, labels)
            ctx.emit("adam_normalized_update_rms", (t[2] / sampled).sqrt(), labels)
            ctx.emit("adam_exp_avg_norm", t[0].sqrt(), labels)
            ctx.emit("adam_exp_avg_sq_norm", t[1].sqrt(), labels)

        ctx.combine([(binned, "sum")], finish, across_ranks=sharded)

    def close(self) -> None:
        self._plan = None
        self._norm_plan = [None]
