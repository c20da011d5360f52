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

import math
import operator
from typing import Any

import torch

from trainvitals.hooks.host_finish import AdamFinish
from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.sampling import BlockSample, owner_index
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.signals.optimizer.state import (
    AdamEntry,
    StateWalk,
    is_adam_group,
)
from trainvitals.hooks.signals.param_series import choose
from trainvitals.hooks.step import ReduceOp, StepContext
from trainvitals.hooks.tensors import NormPlan, SparseSum, flat, foreach_norm32, local, real

BATCH = 1 << 18
"""Sampled elements per batch: bounds the temporaries to a few MB."""
_TINY = 1e-30


def bias_factors(beta1: float, beta2: float, eps: float, step: float) -> tuple[float, float]:
    """``(c, g)`` of one parameter at its step count t (host numbers; the report does the
    same on the device in :meth:`AdamMoments.collect`): ``c = eps * sqrt(1 - b2**t)`` and
    ``g = sqrt(1 - b2**t) / (1 - b1**t)``, so that element by element

        sqrt(v_hat) < eps                   <=>  sqrt(v) < c
        m_hat / (sqrt(v_hat) + eps)          =   m / (sqrt(v) + c) * g

    (the bias corrections floored at 1e-30, as there)."""
    bc1 = max(1.0 - beta1**step, _TINY)
    bc2 = max(1.0 - beta2**step, _TINY)
    return eps * math.sqrt(bc2), math.sqrt(bc2) / bc1


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
        self.ceg: torch.Tensor | None = None  # each element's c / g, c, 1 / g [3, size] (AdamMoments.collect)
        self.cq: torch.Tensor | None = None  # and its rows
        self.ce: torch.Tensor | None = None
        self.gi: torch.Tensor | None = None
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []  # the moments' views copied into dst (AdamMoments._sources)
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
        self.ceg_buf = torch.empty(3 * width, dtype=torch.float32, device=dev)
        # Per entry c / g, c and 1 / g [3, E] (see AdamMoments.collect), written in place:
        # no cast op per report; gathered for every element of a batch by one index_select.
        self.cg = torch.empty(3, len(entries), dtype=torch.float32, device=dev)
        # The bias corrections [bc1; bc2; bc2] [3, E] (float64, the betas' dtype), in place.
        self.bc = torch.empty(3, len(entries), dtype=torch.float64, device=dev)
        self.one = torch.ones((), dtype=torch.float64, device=dev)
        # [eps; eps; bc1; sqrt(bc2); 1 / sqrt(bc2)] [5, E]: the last three rows by one pow
        # of bc (``exponents``), then c / g, c and 1 / g are its first three rows times its
        # last three (AdamMoments.collect).
        self.factors = torch.empty(5, len(entries), dtype=torch.float64, device=dev)
        self.eps_of: torch.Tensor | None = None  # the eps the first rows hold
        # Its views, made once (a view is an op at every report otherwise).
        self.eps_row, self.powered, self.head, self.root = (
            self.factors[:2],
            self.factors[2:],
            self.factors[:3],
            self.factors[2:],
        )
        self.exponents = torch.tensor([[1.0], [0.5], [-0.5]], dtype=torch.float64).to(dev)
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
        out_of_series = {pos: j for j, pos in enumerate(present)}
        entry_bins: list[list[int]] = [[] for _ in entries]
        for i, pos in zip(series_entries, series_bins, strict=True):
            entry_bins[i].append(out_of_series[pos])
        for i, g in zip(group_entries, group_bins, strict=True):
            entry_bins[i].append(len(present) + g)
        # Replicated pieces (tensor parallel): each entry's share of the sums over ranks.
        self.weights = [monitor.weight_of(e.param) for e in entries] if monitor.weighted else None
        self._reduction(entry_bins, sizes, dev)
        # The state tensors the batches' source views are of: (m list, v list, both, all
        # contiguous, their data_ptrs), as AdamMoments._sources last saw them.
        self.sources_seen: tuple[list[Any], list[Any], list[Any], bool, list[int]] | None = None
        # The squared norms z when one foreach call gives them all (stacked straight into
        # float64, no cast op), and the kept output of ``matrix`` with its ratio rows' view.
        self.z: torch.Tensor | None = None
        self.z_items: list[torch.Tensor] = []  # its elements' views, on a CPU
        self.sums = torch.empty(4 * self.n_out, dtype=torch.float64, device=dev)

    def _reduction(self, entry_bins: list[list[int]], sizes: list[int], dev: torch.device) -> None:
        """What turns the report's norms into the emitted values. The norms, squared, lie
        in one vector z: the exact exp_avg norms [E], the exact exp_avg_sq norms [E], then
        per batch its segments' (bias-corrected) update norms [k] and below-eps counts
        (as norms of 0/1) [k]. ``matrix(z)`` gives, per bin (series then groups), the
        rows [below-eps count, update sum of squares, exp_avg and exp_avg_sq sums of
        squares]; divided by ``denominator`` (the sampled elements, 1 for the norms), the
        ratio row as it is and the root of the others (``powers``)."""
        n_entries, n_out = len(entry_bins), len(self.labels)
        pairs: list[tuple[int, int]] = []
        for e, bins in enumerate(entry_bins):
            for b in bins:
                pairs += [(2 * n_out + b, e), (3 * n_out + b, n_entries + e)]
        at = 2 * n_entries
        for batch in self.batches:
            k = len(batch.segments)
            for j, (e, _, _) in enumerate(batch.segments):
                for b in entry_bins[e]:
                    pairs += [(n_out + b, at + j), (b, at + k + j)]
            at += 2 * k
        weights = self.weights or [1.0] * n_entries
        sampled = [0.0] * n_out
        for e, bins in enumerate(entry_bins):
            for b in bins:
                sampled[b] += sizes[e] * weights[e]
        self.n_out = n_out
        self.matrix = SparseSum(4 * n_out, pairs, dev, torch.float64)
        # z's weights: in column order, and in the order of the pairs (``matrix.take``)
        self.z_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.weights is not None:
            columns = weights + weights
            for batch in self.batches:
                columns += [weights[e] for e, _, _ in batch.segments] * 2
            by_column = torch.tensor(columns, dtype=torch.float64)
            self.z_weights = (by_column.to(dev), by_column[[c for _, c in pairs]].to(dev))
        self.bin_sampled = torch.tensor(sampled, dtype=torch.float64).to(dev)  # summed across shards when sharded
        self.finish = AdamFinish(sampled)  # in one process: on the sender thread
        self.ratio_rows = (torch.arange(4 * n_out) < n_out).to(dev)
        self.powers = torch.where(self.ratio_rows, 1.0, 0.5).to(torch.float64)  # the ratio as it is, roots else

    def denominator_of(self, sampled: torch.Tensor) -> torch.Tensor:
        s = sampled.clamp_min(1)
        return torch.cat([s, s, torch.ones(2 * self.n_out, dtype=s.dtype, device=s.device)])

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
        batch.ceg = self.ceg_buf[: 3 * batch.size].view(3, batch.size)
        batch.cq, batch.ce, batch.gi = batch.ceg.unbind()
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
        self._plan_key: tuple[Any, ...] | None = None
        self._plan: MomentPlan | None = None
        self._norm_plan: list[Any] = [None]  # NormPlan.cached's slot, for the moments' norms
        self._series_key: tuple[Any, ...] | None = None
        self._series: tuple[dict[int, tuple[int, bool]], list[dict[str, str]]] = ({}, [])
        self._indices = IndexCache()
        self._hp_table: tuple[list[AdamEntry], list[Any], torch.device, torch.Tensor] | None = None
        self._hp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (cached, [b1; b2; b2], eps)
        # The last state walk and what was read from it (its moment tensors, the plan's key).
        self._walk_seen: StateWalk | None = None
        self._walk_lists: tuple[Any, ...] = ()

    def _series_map(
        self, monitor: MonitorView, key: tuple[Any, ...]
    ) -> tuple[dict[int, tuple[int, bool]], list[dict[str, str]]]:
        if key != self._series_key:
            self._series_key = key
            series = choose(monitor)
            self._series = (
                {id(s.param): (i, s.param.ndim <= 1) for i, s in enumerate(series)},
                [{"param": s.name} for s in series],
            )
        return self._series

    def _hyperparameters(self, monitor: MonitorView, entries: list[AdamEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ([3, E] beta1, beta2 and beta2 again, [E] eps) of each entry's group."""
        table = self._hyperparameter_table(monitor, entries)
        if self._hp is None or self._hp[0] is not table:  # kept while the cached table is the same
            hp = table.view(-1, 3).t() if table.dim() == 1 else table
            self._hp = (table, hp[[0, 1, 1]], hp[2])
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
        # The same entries (the walk's list) and group values: the same table, without the
        # per-entry list and its lookup.
        seen = self._hp_table
        if seen is not None and seen[0] is entries and seen[1] == per_group and seen[2] == dev:
            return seen[3]
        flat_values = [float(x) for e in entries for x in per_group[e.group]]
        table = self._indices.get(flat_values, dev, torch.float64)
        self._hp_table = (entries, per_group, dev, table)
        return table

    def collect(
        self, monitor: MonitorView, ctx: StepContext, key: tuple[Any, ...], walk: StateWalk, now: torch.Tensor
    ) -> None:
        dev = monitor.device
        entries = walk.entries
        sharded = monitor.sharded
        if walk is self._walk_seen and not sharded:  # the same walk: the same tensors
            ms, vs, raw, moments, plan_key = self._walk_lists
        else:
            plan_key = (key, tuple(id(e.param) for e in entries), monitor.config.update_sample)
            ms = [e.state["exp_avg"] for e in entries]
            vs = [e.v for e in entries]
            raw = vs if all(e.v is e.state["exp_avg_sq"] for e in entries) else [e.state["exp_avg_sq"] for e in entries]
            if sharded:
                ms, vs, raw = [local(t) for t in ms], [local(t) for t in vs], [local(t) for t in raw]
            moments = [real(t) for t in ms] + [real(t) for t in raw]
            self._walk_seen, self._walk_lists = walk, (ms, vs, raw, moments, plan_key)
        if plan_key[2] != monitor.config.update_sample:
            plan_key = (key, plan_key[1], monitor.config.update_sample)
        if plan_key != self._plan_key:
            series_of, series_labels = self._series_map(monitor, key)
            self._plan_key = plan_key
            self._plan = MomentPlan(monitor, entries, series_of, series_labels)
            self._norm_plan = [None]
        plan = self._plan
        assert plan is not None
        if not plan.n_out:
            return

        steps = now
        if len(walk.entry_steps) != len(walk.steps):
            steps = now.index_select(0, self._indices.get(walk.entry_steps, dev))
        betas, eps = self._hyperparameters(monitor, entries)
        # [3, E]: both bias corrections at once (bc2 twice, for the rows of c and 1 / g), in float64 (the betas' dtype)
        torch.pow(betas, steps, out=plan.bc)
        torch.sub(plan.one, plan.bc, out=plan.bc).clamp_min_(_TINY)

        # Small tensors of one shape normed together (NormPlan) when the model has them;
        # else the exact norms join the first batch's foreach call.
        if self._norm_plan[0] is None:
            self._norm_plan = [(plan_key, NormPlan(moments, dev))]
        moment_plan = self._norm_plan[0][1]
        pieces: list[torch.Tensor] = []
        norm_lists: list[list[torch.Tensor]] = []
        joined: list[torch.Tensor] = []
        if moment_plan.groups:
            pieces.append(NormPlan.cached(self._norm_plan, plan_key, moments, dev))
        else:
            joined = moments

        # Per element only c = eps * sqrt(1 - b2^t) and g = sqrt(1 - b2^t) / (1 - b1^t) are needed:
        #   sqrt(v_hat) < eps  <=>  sqrt(v) < c
        #   m_hat / (sqrt(v_hat) + eps) = m / (sqrt(v) + c) * g = m / (sqrt(v) * (1 / g) + c / g)
        # (the denominator by one addcmul from c / g = eps * bc1 and 1 / g = bc1 / sqrt(bc2))
        # (computed in float64, rounded once into the float32 buffers)
        if plan.eps_of is not eps:  # a new table when the hyperparameters change
            plan.eps_row.copy_(eps)
            plan.eps_of = eps
        torch.pow(plan.bc, plan.exponents, out=plan.powered)
        torch.mul(plan.head, plan.root, out=plan.cg)
        self._sources(plan, ms, vs)
        for batch in plan.batches:
            plan.views(batch)
            m, v, below, ceg, cq, ce, gi = batch.m, batch.v, batch.below, batch.ceg, batch.cq, batch.ce, batch.gi
            assert m is not None and v is not None and below is not None and ceg is not None
            assert cq is not None and ce is not None and gi is not None
            torch._foreach_copy_(batch.dst, batch.src)  # every segment of the batch in one call
            torch.index_select(plan.cg, 1, batch.index, out=ceg)  # each element's c / g, c, 1 / g
            v.sqrt_()
            torch.lt(v, ce, out=below)  # 0/1 as float32
            m.div_(torch.addcmul(cq, v, gi, out=v))
            # The segments' norms (of 0/1 for the counts) in one foreach call.
            norm_lists.append(foreach_norm32(joined + batch.parts))
            joined = []
        matrix = plan.matrix
        if not pieces and len(norm_lists) == 1:
            # One foreach call: its norms stacked into float64 at once, already in the order
            # the sum gathers them (a norm summed into two bins is stacked twice): no gather.
            norms = norm_lists[0]
            taken = matrix.take(norms)
            if plan.z is None or plan.z.numel() != len(taken):
                plan.z = torch.empty(len(taken), dtype=torch.float64, device=dev)
                plan.z_items = list(plan.z.unbind()) if dev.type == "cpu" else []
            if plan.z_items:
                # On a CPU a stack into float64 casts element by element (4x the copy)
                torch._foreach_copy_(plan.z_items, taken)
                z = plan.z.square_()
            else:
                z = torch.stack(taken, out=plan.z).square_()
            if plan.z_weights is not None:  # replicated pieces count 1 / k
                z.mul_(plan.z_weights[1])
            sums = matrix.add_taken(z, out=plan.sums)
        else:
            pieces += [torch.stack(n) for n in norm_lists]
            z = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(torch.float64).square()
            if plan.z_weights is not None:  # replicated pieces count 1 / k
                z.mul_(plan.z_weights[0])
            sums = matrix(z, out=plan.sums)
        labels = plan.labels
        names = ("adam_eps_dominated_ratio", "adam_normalized_update_rms", "adam_exp_avg_norm", "adam_exp_avg_sq_norm")

        def finish(t: torch.Tensor, *sampled: torch.Tensor) -> None:
            series = [(name, labels) for name in names]
            if not sampled:  # the counts are the plan's: the sender thread divides and takes the roots
                ctx.emit_block(series, t, host=plan.finish)
                return
            # float32 norms of 0/1: the counts are integers
            t = torch.where(plan.ratio_rows, t.round(), t)
            values = (t / plan.denominator_of(sampled[0])) ** plan.powers
            ctx.emit_block(series, values)

        parts: list[tuple[torch.Tensor, ReduceOp]] = [(sums, "sum")]
        if sharded:
            parts.append((plan.bin_sampled, "sum"))
        ctx.combine(parts, finish, across_ranks=sharded)

    def _sources(self, plan: MomentPlan, ms: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """The batches' source views of the moments, made again only when a moment
        tensor is another one or has other storage (each view is an op per report).
        The walk's lists are the same objects while its tensors are: then only the
        storage is compared."""
        seen = plan.sources_seen
        both = seen[2] if seen is not None and seen[0] is ms and seen[1] is vs else ms + vs
        if seen is not None and seen[3]:  # views of contiguous tensors: kept while the storage is
            same = both is seen[2] or (len(both) == len(seen[2]) and all(map(operator.is_, both, seen[2])))
            if same and list(map(torch.Tensor.data_ptr, both)) == seen[4]:
                plan.sources_seen = (ms, vs, both, True, seen[4])
                return
        contiguous = all(t.is_contiguous() for t in both)
        plan.sources_seen = (ms, vs, both, contiguous, list(map(torch.Tensor.data_ptr, both)))
        for batch in plan.batches:
            batch.src = [plan.source(ms[i], i, a, b) for i, a, b in batch.segments]
            batch.src += [plan.source(vs[i], i, a, b) for i, a, b in batch.segments]

    def close(self) -> None:
        """Let go of the plan and the walk's tensors (the next collect builds them anew)."""
        self._plan, self._plan_key = None, None
        self._walk_seen, self._walk_lists = None, ()
        self._norm_plan = [None]
        self._hp_table = None
