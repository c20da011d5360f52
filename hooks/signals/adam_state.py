"""Adam's state (I4): how much of each parameter Adam's epsilon dominates, how big its
normalized steps are, the moment norms; and optimizer state resets.

Adam-family optimizers are recognized by their keys, not their class (so subclasses,
foreach and fused variants work): a param group with ``betas`` and ``eps`` and a
per-parameter state with ``exp_avg``, ``exp_avg_sq`` and ``step``. With the
group's ``betas = (b1, b2)``, ``eps`` and the parameter's own step count t:

    m_hat = exp_avg / (1 - b1**t)        v_hat = v / (1 - b2**t)

where v is ``exp_avg_sq``, or ``max_exp_avg_sq`` with ``amsgrad`` (what torch's
Adam divides by). The bias corrections are tensor ops on the stacked step tensors
(CPU for plain/foreach, on the device for fused/capturable): no host sync.

- ``adam_eps_dominated_ratio``: share of elements with sqrt(v_hat) < eps, where
  Adam's step is about lr * m / eps instead of lr * sign-like.
- ``adam_normalized_update_rms``: RMS of m_hat / (sqrt(v_hat) + eps), the update
  over the learning rate; near 1 when steps are sign-like (INCIDENTS.md I4).
- ``adam_exp_avg_norm`` / ``adam_exp_avg_sq_norm``: L2 norms of exp_avg and
  exp_avg_sq.

Per parameter that has a ``param`` series (1D ones; with ``per_param=True`` also
ndim >= 2; see :mod:`param_series`), and per param group (label ``group``) over
the group's other parameters. The moment norms are exact. The two ratios are exact
for 1D parameters and for tensors of at most ``update_sample`` elements; larger
tensors use a deterministic sample of that many elements (like ``update_ratio``),
taken in evenly spaced runs of 16 contiguous elements (a cache line: single
strided elements cost a cache miss each) and processed in batches of bounded
size, so a report costs one pass over the moments for the norms and little else.

``optimizer_state_resets_total`` counts reports at which a reset was seen since
the previous report (several resets between two reports count once), each with an
``optimizer_state_reset`` event saying what was seen:

- the param groups changed (a group added or removed, or the parameters of a
  group changed: the optimizer was rebuilt in place, or a new stage added
  parameters; ``load_state_dict`` replacing the group dicts is not a change);
- a parameter's state vanished (``optimizer.state.clear()`` not refilled yet);
- a parameter's state tensors were recreated and its step count is at most the
  optimizer steps elapsed since the previous report (cleared, then refilled by
  the steps since), checked on the device;
- its step count went back in place below the previous report's, on the device.

The last two are decided on the sender thread (``ctx.event(when=...)``). A state
reloaded from a checkpoint (recreated, but with its old step count) is not a
reset. Host checks compare object identities only (weak references), so they see
a reset that happened between reports, and nothing here needs every step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainvitals.hooks.signals.base import Signal, StepContext
from trainvitals.hooks.signals.param_series import choose, flat, groups_key, real
from trainvitals.hooks.tensors import local

_BUCKET = 1 << 18  # sampled elements per batch: bounds the temporaries to a few MB
_BLOCK = 16  # sampled run length: one 64-byte cache line of float32
_TINY = 1e-30


def _is_adam_group(group: dict[str, Any]) -> bool:
    return "betas" in group and "eps" in group


def _step_tensor(st: dict[str, Any]) -> torch.Tensor | None:
    step = st.get("step")
    if isinstance(step, torch.Tensor):
        return step
    if isinstance(step, (int, float)):
        return torch.tensor(float(step))
    return None


def _anchor(st: dict[str, Any]) -> torch.Tensor | None:
    """A tensor of the state whose identity changes when the state is recreated."""
    step = st.get("step")
    if isinstance(step, torch.Tensor):
        return step
    for v in st.values():
        if isinstance(v, torch.Tensor):
            return v
    return None


class _Entry:
    __slots__ = ("param", "group", "state", "v")

    def __init__(self, param: torch.Tensor, group: int, state: dict[str, Any], v: torch.Tensor):
        self.param, self.group, self.state, self.v = param, group, state, v


class _Layout:
    """One arrangement of Adam entries: how each is sampled, the batches of samples,
    which series and group each entry feeds."""

    def __init__(self, monitor: Any, entries: list[_Entry], series_of: dict[int, tuple[int, bool]],
                 series_labels: list[dict[str, str]]):
        dev = monitor.device
        cap = monitor.config.update_sample
        groups = monitor.groups()
        # Per entry: None (every element) or (blocks, spacing, width): `blocks` runs of
        # `width` contiguous elements, `spacing` apart.
        self.plans: list[tuple[int, int, int] | None] = []
        sizes: list[int] = []
        series_entries, series_bins, group_entries, group_bins = [], [], [], []
        group_slot: dict[int, int] = {}
        for i, e in enumerate(entries):
            n = local(e.param).numel() * (2 if e.param.is_complex() else 1)
            pos, one_d = series_of.get(id(e.param), (-1, False))
            if one_d or n <= cap:
                self.plans.append(None)
                sizes.append(n)
            else:
                width = min(_BLOCK, cap)
                blocks = cap // width
                self.plans.append((blocks, n // blocks, width))
                sizes.append(blocks * width)
            if pos >= 0:
                series_entries.append(i)
                series_bins.append(pos)
            if not one_d:
                group_entries.append(i)
                group_bins.append(group_slot.setdefault(e.group, len(group_slot)))
        self.sampled = torch.tensor(sizes, dtype=torch.float64).to(dev)
        # Batches of at most _BUCKET sampled elements; a segment is (entry, first, last)
        # in the entry's sample. A sample larger than a batch (a huge 1D parameter) is split.
        self.buckets: list[_Bucket] = []
        segments: list[tuple[int, int, int]] = []
        room = _BUCKET
        for i, k in enumerate(sizes):
            start = 0
            plan = self.plans[i]
            while start < k:
                take = min(k - start, room)
                if plan is not None:
                    take -= take % plan[2]  # whole runs only
                if take == 0:
                    self.buckets.append(_Bucket(segments, dev))
                    segments, room = [], _BUCKET
                    continue
                segments.append((i, start, start + take))
                room -= take
                start += take
                if room == 0:
                    self.buckets.append(_Bucket(segments, dev))
                    segments, room = [], _BUCKET
        if segments:
            self.buckets.append(_Bucket(segments, dev))
        width = max((b.size for b in self.buckets), default=0)
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
            {"group": groups[g][0]} for g, _ in sorted(group_slot.items(), key=lambda kv: kv[1])]
        self.all_series_present = len(present) == self.n_series

    def sample(self, t: torch.Tensor, entry: int, first: int, last: int, out: torch.Tensor) -> None:
        """Copy elements ``first:last`` of entry ``entry``'s sample of ``t`` into ``out``."""
        plan = self.plans[entry]
        if plan is None:
            out.copy_(flat(t)[first:last])
            return
        x = t if t.is_contiguous() and not t.is_complex() else flat(t)
        blocks, spacing, width = plan
        view = x.as_strided((blocks, width), (spacing, 1), x.storage_offset())
        out.view(-1, width).copy_(view[first // width : last // width])


class _Bucket:
    """One batch of samples: its segments, and each element's entry (for the scalar)."""

    def __init__(self, segments: list[tuple[int, int, int]], dev: torch.device):
        self.segments = segments
        self.lengths = [b - a for _, a, b in segments]
        self.size = sum(self.lengths)
        owner = torch.tensor([i for i, _, _ in segments], dtype=torch.long)
        self.index = torch.repeat_interleave(owner, torch.tensor(self.lengths)).to(dev)
        self.owner = owner.to(dev)


class _Walk:
    """One look at the optimizer's state (host only)."""

    def __init__(self) -> None:
        self.vanished: list[str] = []  # parameters whose state is gone since the last look
        self.ids: list[int] = []  # parameters with a step count, and their step tensors
        self.steps: list[torch.Tensor] = []
        self.recreated: list[bool] = []  # state tensors replaced since the last look
        self.entries: list[_Entry] = []  # Adam-family parameters
        self.entry_steps: list[int] = []  # their positions in ``steps``


class AdamState(Signal):
    def __init__(self) -> None:
        self._layout_key: tuple | None = None
        self._layout: _Layout | None = None
        self._series_key: tuple | None = None
        self._series: tuple[dict[int, tuple[int, bool]], list[dict[str, str]]] = ({}, [])
        self._hyper_key: tuple | None = None
        self._hyper: torch.Tensor | None = None
        self._pick_key: tuple | None = None
        self._pick: torch.Tensor | None = None
        self._resets: torch.Tensor | None = None
        self._groups_key: tuple | None = None
        self._groups_params: set[int] = set()
        # id(param) -> (weakref to the param, weakref to its state's anchor tensor)
        self._anchors: dict[int, tuple[Any, Any]] = {}
        self._step_order: tuple[int, ...] = ()
        self._steps: torch.Tensor | None = None
        self._report_step = 0

    # -- attach ----------------------------------------------------------------
    def bind(self, monitor: Any) -> list:
        self._resets = torch.zeros((), device=monitor.device)
        self._groups_key = groups_key(monitor)
        self._groups_params = {id(p) for g in monitor.optimizer.param_groups for p in g["params"]}
        # A state that exists at attach (a resumed run) is the baseline.
        walk = self._walk(monitor)
        if walk.steps:
            self._steps, self._step_order = _stack(walk.steps, monitor.device), tuple(walk.ids)
        self._report_step = monitor.step
        return []

    # -- report ----------------------------------------------------------------
    def collect(self, monitor: Any, ctx: StepContext) -> None:
        key = groups_key(monitor)
        walk = self._walk(monitor)
        now = _stack(walk.steps, monitor.device) if walk.steps else None
        self._collect_resets(monitor, ctx, key, walk, now)
        if walk.entries and now is not None:
            self._collect_moments(monitor, ctx, key, walk, now)

    def _walk(self, monitor: Any) -> _Walk:
        state = monitor.optimizer.state
        walk = _Walk()
        anchors: dict[int, tuple[Any, Any]] = {}
        for gi, (label, group) in enumerate(monitor.groups()):
            adam = _is_adam_group(group)
            amsgrad = adam and bool(group.get("amsgrad", False))
            for i, p in enumerate(group["params"]):
                st = state.get(p)  # .get: optimizer.state is a defaultdict
                old = self._anchors.get(id(p))
                if old is not None and old[0]() is not p:
                    old = None  # the id now belongs to another parameter
                anchor = _anchor(st) if st else None
                if anchor is None:
                    if old is not None:
                        walk.vanished.append(monitor.name_of(p, f"{label}.{i}"))
                    continue
                same = old is not None and old[1]() is anchor
                anchors[id(p)] = old if same else (weakref.ref(p), weakref.ref(anchor))  # type: ignore[assignment]
                step = _step_tensor(st)
                if step is None:
                    continue
                if adam and "exp_avg" in st and "exp_avg_sq" in st:
                    v = st["max_exp_avg_sq"] if amsgrad and "max_exp_avg_sq" in st else st["exp_avg_sq"]
                    walk.entries.append(_Entry(p, gi, st, v))
                    walk.entry_steps.append(len(walk.steps))
                walk.ids.append(id(p))
                walk.steps.append(step)
                walk.recreated.append(old is not None and not same)
        self._anchors = anchors
        return walk

    def _collect_resets(self, monitor: Any, ctx: StepContext, key: tuple, walk: _Walk,
                        now: torch.Tensor | None) -> None:
        dev = monitor.device
        reasons: list[str] = []
        if key != self._groups_key:
            params = {id(p) for g in monitor.optimizer.param_groups for p in g["params"]}
            added, removed = len(params - self._groups_params), len(self._groups_params - params)
            reasons.append(f"param groups changed ({len(self._groups_key or ())} -> {len(key)} groups, "
                           f"{added} parameters added, {removed} removed)")
            self._groups_key, self._groups_params = key, params
        if walk.vanished:
            more = f" and {len(walk.vanished) - 3} more" if len(walk.vanished) > 3 else ""
            reasons.append(f"optimizer state emptied for {len(walk.vanished)} parameter(s) "
                           f"({', '.join(walk.vanished[:3])}{more})")
        flag = None
        elapsed = monitor.step - self._report_step
        ids = tuple(walk.ids)
        if now is not None and self._steps is not None:
            if ids == self._step_order and not any(walk.recreated):
                flag = (now < self._steps).any()  # the usual case: one compare, no index
            else:
                prev_pos = {pid: j for j, pid in enumerate(self._step_order)}
                kept = [(j, prev_pos[pid]) for j, (pid, rec) in enumerate(zip(ids, walk.recreated))
                        if pid in prev_pos and not rec]
                fresh = [j for j, rec in enumerate(walk.recreated) if rec]
                flag = torch.zeros((), dtype=torch.bool, device=dev)
                if kept:
                    a = torch.tensor([j for j, _ in kept], dtype=torch.long).to(dev)
                    b = torch.tensor([k for _, k in kept], dtype=torch.long).to(dev)
                    flag = flag | (now[a] < self._steps[b]).any()
                if fresh:
                    r = torch.tensor(fresh, dtype=torch.long).to(dev)
                    flag = flag | (now[r] <= elapsed).any()
        self._steps, self._step_order, self._report_step = now, ids, monitor.step
        assert self._resets is not None
        if reasons:
            self._resets = self._resets + 1
            ctx.event("optimizer_state_reset", "; ".join(reasons))
        elif flag is not None:
            self._resets = self._resets + flag.to(self._resets.dtype)
            ctx.event("optimizer_state_reset",
                      f"a step count went back or restarted since step {monitor.step - elapsed} "
                      "(optimizer state cleared, zeroed or rebuilt)", when=flag)
        ctx.emit("optimizer_state_resets_total", self._resets, {})

    def _series_map(self, monitor: Any, key: tuple) -> tuple[dict[int, tuple[int, bool]], list[dict[str, str]]]:
        if key != self._series_key:
            self._series_key = key
            series = choose(monitor)
            self._series = ({id(s.param): (i, s.param.ndim <= 1) for i, s in enumerate(series)},
                            [{"param": s.name} for s in series])
        return self._series

    def _hyperparameters(self, monitor: Any, entries: list[_Entry]) -> torch.Tensor:
        """[3, E] float64: beta1, beta2, eps of each entry's group."""
        groups = monitor.optimizer.param_groups
        per_group = [(g["betas"][0], g["betas"][1], g["eps"]) if _is_adam_group(g) else (0.0, 0.0, 0.0)
                     for g in groups]
        dev = monitor.device
        if any(isinstance(x, torch.Tensor) for row in per_group for x in row):
            return torch.stack([torch.stack([torch.as_tensor(x, dtype=torch.float64).to(dev).reshape(())
                                             for x in per_group[e.group]]) for e in entries], 1)
        key = (tuple(per_group), id(self._layout))
        if key != self._hyper_key:
            self._hyper_key = key
            self._hyper = torch.tensor([per_group[e.group] for e in entries],
                                       dtype=torch.float64).t().contiguous().to(dev)
        assert self._hyper is not None
        return self._hyper

    def _collect_moments(self, monitor: Any, ctx: StepContext, key: tuple, walk: _Walk,
                         now: torch.Tensor) -> None:
        dev = monitor.device
        entries = walk.entries
        series_of, series_labels = self._series_map(monitor, key)
        lkey = (key, tuple(id(e.param) for e in entries), monitor.config.update_sample)
        if lkey != self._layout_key:
            self._layout_key = lkey
            self._layout = _Layout(monitor, entries, series_of, series_labels)
        lay = self._layout
        assert lay is not None

        if len(walk.entry_steps) == len(walk.steps):
            steps = now.to(torch.float64)
        else:
            pick_key = tuple(walk.entry_steps)
            if pick_key != self._pick_key:
                self._pick_key = pick_key
                self._pick = torch.tensor(pick_key, dtype=torch.long).to(dev)
            steps = now.to(torch.float64).index_select(0, self._pick)  # type: ignore[arg-type]
        b1, b2, eps = self._hyperparameters(monitor, entries)
        bc1 = (1 - b1**steps).clamp_min(_TINY)
        bc2 = (1 - b2**steps).clamp_min(_TINY)

        sharded = monitor.sharded
        ms = [e.state["exp_avg"] for e in entries]
        vs = [e.v for e in entries]
        raw = vs if all(e.v is e.state["exp_avg_sq"] for e in entries) else [e.state["exp_avg_sq"] for e in entries]
        if sharded:
            ms, vs, raw = [local(t) for t in ms], [local(t) for t in vs], [local(t) for t in raw]
        both = torch._foreach_norm([real(t) for t in ms] + [real(t) for t in raw], 2, dtype=torch.float32)
        sq = _stack(both, dev).to(torch.float64).square().view(2, -1)
        m_sq, v_sq = sq[0], sq[1]

        # Per element only c = eps * sqrt(1 - b2^t) is needed:
        #   sqrt(v_hat) < eps  <=>  sqrt(v) < c
        #   (m_hat / (sqrt(v_hat) + eps))^2 = m^2 / (sqrt(v) + c)^2 * (1 - b2^t) / (1 - b1^t)^2
        # the last factor is applied per entry, after the sums.
        c = (eps * bc2.sqrt()).to(torch.float32)
        dominated = torch.zeros(len(entries), dtype=torch.float64, device=dev)
        update_sq = torch.zeros(len(entries), dtype=torch.float64, device=dev)
        for bucket in lay.buckets:
            m, v = lay.m_buf[: bucket.size], lay.v_buf[: bucket.size]
            for (i, a, b), mo, vo in zip(bucket.segments, m.split(bucket.lengths), v.split(bucket.lengths)):
                lay.sample(ms[i], i, a, b, mo)
                lay.sample(vs[i], i, a, b, vo)
            ce = c.index_select(0, bucket.index)
            v.sqrt_()
            below = (v < ce).to(torch.float32)
            m.div_(v.add_(ce))
            # Per-segment sums of squares (of 0/1 for the count) in one foreach call.
            sums = _stack(torch._foreach_norm([*m.split(bucket.lengths), *below.split(bucket.lengths)]),
                          dev).to(torch.float64).square()
            k = len(bucket.lengths)
            update_sq.index_add_(0, bucket.owner, sums[:k])
            dominated.index_add_(0, bucket.owner, sums[k:].round())
        update_sq = update_sq * bc2 / bc1.square()

        per_entry = torch.stack([m_sq, v_sq, dominated, update_sq, lay.sampled])  # [5, E]
        parts = []
        if lay.n_series:
            s = torch.zeros(5, lay.n_series, dtype=torch.float64, device=dev).index_add_(
                1, lay.series_bins, per_entry.index_select(1, lay.series_entries))
            parts.append(s if lay.all_series_present else s.index_select(1, lay.series_keep))
        if lay.n_groups:
            parts.append(torch.zeros(5, lay.n_groups, dtype=torch.float64, device=dev).index_add_(
                1, lay.group_bins, per_entry.index_select(1, lay.group_entries)))
        if not parts:
            return
        totals = torch.cat(parts, 1)
        labels = lay.labels

        def finish(t: torch.Tensor) -> None:
            t = t.view(5, -1)
            ctx.emit("adam_eps_dominated_ratio", t[2] / t[4].clamp_min(1), labels)
            ctx.emit("adam_normalized_update_rms", (t[3] / t[4].clamp_min(1)).sqrt(), labels)
            ctx.emit("adam_exp_avg_norm", t[0].sqrt(), labels)
            ctx.emit("adam_exp_avg_sq_norm", t[1].sqrt(), labels)

        if sharded:
            ctx.reduce(totals.reshape(-1), "sum", finish)
        else:
            finish(totals)

    def close(self) -> None:
        self._layout = None
        self._anchors.clear()
        self._steps = None


def _stack(tensors: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """Stack 0-d tensors onto ``dev``: one stack where they live, one copy."""
    first = tensors[0].device
    if all(t.device == first for t in tensors):
        return torch.stack(tensors).to(dev, non_blocking=True)
    return torch.stack([t.to(dev, non_blocking=True) for t in tensors])
