"""Softmax saturation and distillation signals (docs/incidents.md, I5).

``observe_logits`` reports, per (task, role), over every position observed in a
reported step (all calls of the step add up; the sums reset after each report):
the mean top-1 probability, the share of positions above 0.99 and 0.999, the mean
softmax Jacobian ``q (1 - q)`` of the top-1, the mean entropy in nats, and the
temperature that brings the mean top-1 down to ``softmax_target``.

Statistics are taken at the observed ``temperature`` (the logits divided by it);
the recommended temperature is absolute, a property of the raw logits: the
``tau`` to distill at, 1.0 when the mean top-1 at ``T = 1`` is already at or below
the target (the search and its accuracy: ``maths``).

``observe_distillation`` adds both roles at ``tau`` and, per task:

- ``distill_top1_grad_share_ratio``: the gradient of KL(p_T || p_S) with respect
  to the student's logits is ``g = (p_S - p_T) / tau`` (times tau^2 with Hinton's
  scaling; a share is scale-free). Because ``sum_j g_j = 0``, a descent step
  raises some logits and lowers others by the same L1 amount, ``||g||_1 / 2``.
  The share is the part of the raising that goes to the teacher's top-1 ``t``:
  ``sum_i max(p_T,it - p_S,it, 0) / sum_i ||p_S,i - p_T,i||_1 / 2`` over the
  (weighted) positions. 1 when everything the student is taught is "more of the
  top-1" (a near one-hot teacher: no dark knowledge); small when a soft teacher
  spreads it, or when the student is already more confident than the teacher
  (the gradient then lowers the top-1 and raises the rest). Pooled, so a position
  counts by its gradient magnitude (matched positions add nothing). (The plain
  L1 share ``|g_t| / ||g||_1`` cannot exceed 1/2, and is 1/2 for an overconfident
  student of a soft teacher too; hence this definition.)
- ``distill_dark_knowledge_mass``: mean teacher probability outside its top-1.

Cost, bounded for 150k-class vocabularies and paid only on reported steps:

- Positions: at most ``softmax_max_positions`` (default 128) per call, taken with a
  fixed stride over all positions (``ceil(N / cap)``, made coprime with T for
  [B, T] logits so the sample cycles through sequence positions); the mask then
  weights them. Selecting masked positions first would need their count on the
  host, so a sparse mask leaves about ``cap * density`` effective positions.
  Masked-out positions never reach a sum, even when their logits are NaN. The
  recommended temperature's knots are computed on every ``sub``-th kept position
  (at least 32; ``maths``), the others counting through their tangents.
- Per logit, one CPU thread: the statistics ~2 ns (one ``exp2`` and eight cheap
  passes), the knots ~5 ns on the sub-sample. Measured (``tests/benchmarks/
  bench_softmax.py``, this machine, 2 calls per step): 2.9-4.3 ms per call for
  the reference decoder's [4, 128, 8192] logits (103 kept), 3.5-5 ms with the
  call's share of the report; the previous per-logit histogram took 20-25 ms at
  171 positions.
- Classes more than ~87 nats (times tau) below the top-1 give float32 subnormals
  (below 1.2e-38) in the exponentials and at the knots near T = 1. They change no
  result, but cost: ~1.3x here (AMD) for logits with 10 % of their classes in that
  band (benchmark ``512x8192_x10``); CPUs that handle subnormals in microcode can
  be several times slower, which ``torch.set_flush_denormal(True)`` avoids.
- Vocabulary: rows are processed in chunks whose buffers stay within
  ``softmax_chunk_bytes`` (8 bytes per logit: two float32 buffers, or the knots'
  four power chains on half as many rows; at least one position's four chains;
  plus a row copy when the positions are not a view). On a CPU the chunk is also
  kept to ``CPU_CHUNK_BYTES`` (4 MiB), so the passes over it run from cache. The
  buffers are allocated once per call.
- Per position, a call leaves its three sums and its knots; turning them into
  statistics and top-1 curves (a few dozen small tensor ops, ~0.5 ms here
  whatever the number of positions) waits for the report, once per step for all
  calls, or every 64 calls of one (task, role, tau) to bound the memory.
- No host sync: everything is summed on the logits' device and emitted at the
  report, where it joins the step's single host transfer. Results are this rank's
  positions (not combined across ranks: ranks may observe different tasks).
"""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.signals.base import MonitorView, Signal
from trainvitals.hooks.signals.softmax import maths as sm
from trainvitals.hooks.signals.softmax.positions import (
    Positions,
    check_logits,
    check_mask,
    check_name,
    check_temperature,
)
from trainvitals.hooks.step import StepContext
from trainvitals.wire.signals import SignalSpec

# Accumulator layout per (task, role): weight, STATS (weighted sums), then the sums
# of the mean top-1 estimate on the temperature grid: the covariate x over every kept
# position, the weight of the knot sub-sample, and q - x over that sub-sample.
_N_STATS = len(sm.STATS)
_K = sm.TEMPERATURE_POINTS
_COVARIATE = slice(1 + _N_STATS, 1 + _N_STATS + _K)
_SUB_WEIGHT = 1 + _N_STATS + _K
_RESIDUAL = slice(_SUB_WEIGHT + 1, _SUB_WEIGHT + 1 + _K)
_SAT_LEN = _SUB_WEIGHT + 1 + _K
# Per task: weight, raising of the teacher's top-1, ||g||_1 / 2, teacher mass outside top-1.
_DISTILL_LEN = 4


class _Pending:
    """What the calls of one (task, role, tau) left since the last compaction: per
    call the statistics' sums ``[3, n]`` and weights (None: all 1), the knots
    ``[knots, m]``, and the sums and weights of the knot sub-sample (views)."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []
        self.weights: list[torch.Tensor | None] = []
        self.knots: list[torch.Tensor] = []
        self.sub_sums: list[torch.Tensor] = []
        self.sub_weights: list[torch.Tensor | None] = []

    def add(self, sums: torch.Tensor, weight: torch.Tensor | None, knots: torch.Tensor, sub: int) -> None:
        self.sums.append(sums)
        self.weights.append(weight)
        self.knots.append(knots)
        self.sub_sums.append(sums[:, ::sub])
        self.sub_weights.append(None if weight is None else weight[::sub])

    @staticmethod
    def cat(sums: list[torch.Tensor], weights: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """All calls' sums side by side and their weights (``[3, N]``, ``[N]``)."""
        filled = [
            torch.ones(s.shape[1], device=s.device) if w is None else w for s, w in zip(sums, weights, strict=True)
        ]
        if len(sums) == 1:
            return sums[0], filled[0]
        return torch.cat(sums, 1), torch.cat(filled)


_MAX_PENDING_CALLS = 64
"""Calls of one (task, role, tau) kept as per-position sums before they are folded (memory bound)."""


def _weighted_sum(weight: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[1 + C]``: sum of weights, then the weighted column sums of ``values``
    ``[r, C]``; rows with weight 0 never contribute (their values may be NaN)."""
    kept = torch.where((weight > 0).unsqueeze(1), values, 0.0)
    return torch.cat([weight.sum().reshape(1), weight @ kept])


class Softmax(Signal):
    """Saturation per (task, role) and distillation per task, summed over a reported step."""

    spec = SignalSpec(
        name="softmax",
        covers="saturation and distillation (I5)",
        how_to_ask="no observe_logits() or observe_distillation() call",
        group="softmax",
        title="Softmax saturation and distillation (I5)",
        dashboard="trainvitals-softmax.json",
        first_call="observe_logits()",
    )
    covers = spec.name

    def __init__(self) -> None:
        self._saturation: dict[tuple[str, str], torch.Tensor] = {}
        self._pending: dict[tuple[tuple[str, str], float], _Pending] = {}
        self._distillation: dict[str, torch.Tensor] = {}
        self._grids: dict[torch.device, sm.TemperatureGrid] = {}

    # -- user calls (through Monitor) ----------------------------------------
    def observe_logits(
        self,
        monitor: MonitorView,
        logits: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        task: str = "all",
        role: str = "student",
        temperature: float = 1.0,
    ) -> None:
        where = "observe_logits"
        check_logits(where, "logits", logits)
        check_mask(where, mask, logits)
        check_name("task", task, "ie")
        check_name("role", role, "teacher")
        tau = check_temperature(where, temperature)
        if not monitor.reporting_next or self.broken:
            return
        with self.guard(where), torch.no_grad():
            positions = Positions(logits, mask, monitor.config.softmax_max_positions)
            self._add_saturation((task, role), positions, tau, monitor.config)

    def observe_distillation(
        self,
        monitor: MonitorView,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        *,
        temperature: float,
        mask: torch.Tensor | None = None,
        task: str = "all",
    ) -> None:
        where = "observe_distillation"
        check_logits(where, "student_logits", student_logits)
        check_logits(where, "teacher_logits", teacher_logits)
        if tuple(teacher_logits.shape) != tuple(student_logits.shape):
            raise ValueError(
                f"{where}: teacher_logits shape {tuple(teacher_logits.shape)} must equal "
                f"student_logits shape {tuple(student_logits.shape)}"
            )
        check_mask(where, mask, student_logits)
        check_name("task", task, "ie")
        tau = check_temperature(where, temperature)
        if not monitor.reporting_next or self.broken:
            return
        config = monitor.config
        with self.guard(where), torch.no_grad():
            student = Positions(student_logits, mask, config.softmax_max_positions)
            teacher = Positions(teacher_logits, mask, config.softmax_max_positions)
            self._add_saturation((task, "student"), student, tau, config)
            self._add_saturation((task, "teacher"), teacher, tau, config)
            self._add_distillation(task, student, teacher, tau, config.softmax_chunk_bytes)

    # -- accumulation ----------------------------------------------------------
    def _grid(self, device: torch.device) -> sm.TemperatureGrid:
        if device not in self._grids:
            self._grids[device] = sm.TemperatureGrid(device)
        return self._grids[device]

    def _add_saturation(self, key: tuple[str, str], positions: Positions, tau: float, config: Any) -> None:
        """The passes over the logits: the statistics' sums on every kept position,
        then the knots on every ``sub``-th (``maths``). Turning them into
        statistics and top-1 curves waits for the report (``_compact``): it is a few
        dozen small tensor ops, paid once per step instead of once per call."""
        device, count = positions.logits.device, positions.count
        step = sm.rows_per_chunk(
            positions.vocab,
            config.softmax_chunk_bytes,
            copies=positions.copies,
            itemsize=positions.logits.element_size(),
            device=device,
        )
        workspace = sm.Workspace(min(step, count), positions.vocab, device)
        sums = torch.empty((3, count), device=device)
        sub = sm.subsample_stride(count, sm.temperature_positions(config.softmax_max_positions), positions.period)
        knots = torch.empty((len(sm.CHAIN_POWERS), len(range(0, count, sub))), device=device)
        for start in range(0, count, step):
            stop = min(start + step, count)
            sm.saturation_chunk(positions.rows(start, stop), 1.0 / tau, workspace, sums[:, start:stop])
            # the chunk's knot rows while they are in cache (the workspace is free again)
            first = -(-start // sub)
            for a in range(first, -(-stop // sub), workspace.chain_rows):
                b = min(a + workspace.chain_rows, -(-stop // sub))
                sm.temperature_chunk(positions.rows(a * sub, b * sub, sub), workspace, knots[:, a:b])
        weight = positions.weights
        group = (key, tau)
        pending = self._pending.setdefault(group, _Pending())
        pending.add(sums, weight, knots, sub)
        if len(pending.sums) >= _MAX_PENDING_CALLS:
            self._compact(group)

    def _compact(self, group: tuple[tuple[str, str], float]) -> None:
        """Fold the pending calls of one (task, role, tau) into the step's sums."""
        key, tau = group
        pending = self._pending.pop(group)
        sums, weight = pending.cat(pending.sums, pending.weights)
        sub_sums, sub_weight = pending.cat(pending.sub_sums, pending.sub_weights)
        n = sums.shape[1]
        grid = self._grid(sums.device)
        # every kept position, then the knot sub-sample again: one pass of small ops
        per_position = sm.saturation_stats(torch.cat([sums, sub_sums], dim=1), 1.0 / tau)
        covariate = sm.covariate_on_grid(per_position[:, _N_STATS : _N_STATS + 2], grid, 1.0 / tau)
        knots = pending.knots[0] if len(pending.knots) == 1 else torch.cat(pending.knots, 1)
        top1 = sm.top1_on_grid(sm.knot_logs(knots, per_position[n:, -1]), grid)
        total = torch.cat(
            [
                _weighted_sum(weight, torch.cat([per_position[:n, :_N_STATS], covariate[:n]], dim=1)),
                _weighted_sum(sub_weight, top1.sub_(covariate[n:])),
            ]
        )
        self._saturation[key] = self._add(self._saturation.get(key), total)

    def _add_distillation(
        self, task: str, student: Positions, teacher: Positions, tau: float, chunk_bytes: int
    ) -> None:
        device = student.logits.device
        step = sm.rows_per_chunk(
            student.vocab,
            chunk_bytes,
            copies=student.copies + teacher.copies,
            itemsize=max(student.logits.element_size(), teacher.logits.element_size()),
            device=device,
        )
        workspace = sm.Workspace(min(step, student.count), student.vocab, device)
        total = torch.zeros(_DISTILL_LEN, device=device)
        for start in range(0, student.count, step):
            stop = min(start + step, student.count)
            per_position = sm.distillation_chunk(
                student.rows(start, stop), teacher.rows(start, stop), 1.0 / tau, workspace
            )
            total += _weighted_sum(student.weight(start, stop, device), per_position)
        self._distillation[task] = self._add(self._distillation.get(task), total)

    @staticmethod
    def _add(acc: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
        return part if acc is None else acc + part.to(acc.device, non_blocking=True)

    # -- report ------------------------------------------------------------------
    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        for group in list(self._pending):
            self._compact(group)
        saturation, self._saturation = self._saturation, {}
        distillation, self._distillation = self._distillation, {}
        if saturation:
            self._emit_saturation(monitor, ctx, saturation)
        if distillation:
            tasks = list(distillation)
            acc = torch.stack([distillation[t].to(ctx.device) for t in tasks])
            weight, raise_top, raise_all, dark = acc.unbind(1)
            labels = [{"task": t} for t in tasks]
            ctx.emit("distill_top1_grad_share_ratio", raise_top / raise_all, labels, present=raise_all > 0)
            ctx.emit("distill_dark_knowledge_mass", dark / weight, labels, present=weight > 0)

    def _emit_saturation(
        self, monitor: MonitorView, ctx: StepContext, saturation: dict[tuple[str, str], torch.Tensor]
    ) -> None:
        keys = list(saturation)
        acc = torch.stack([saturation[k].to(ctx.device) for k in keys])
        weight, sub_weight = acc[:, :1], acc[:, _SUB_WEIGHT : _SUB_WEIGHT + 1]
        present = weight[:, 0] > 0
        top1, sat99, sat999, jac, entropy = (acc[:, 1 : 1 + _N_STATS] / weight).unbind(1)
        # mean top-1 on the grid: covariate over every position + residual over the sub-sample
        residual = torch.where(sub_weight > 0, acc[:, _RESIDUAL] / sub_weight, 0.0)
        curve = acc[:, _COVARIATE] / weight + residual
        recommended = sm.temperature_for_target(
            self._grid(ctx.device).temperatures, curve, monitor.config.softmax_target
        )
        labels = [{"task": task, "role": role} for task, role in keys]
        ctx.emit("softmax_top1_prob_mean", top1, labels, present=present)
        thresholds = [str(t) for t in sm.SATURATION_THRESHOLDS]
        ctx.emit(
            "softmax_saturated_ratio",
            torch.cat([sat99, sat999]),
            [{**lab, "threshold": t} for t in thresholds for lab in labels],
            present=torch.cat([present, present]),
        )
        ctx.emit("softmax_jacobian_mean", jac, labels, present=present)
        ctx.emit("softmax_entropy_nats", entropy, labels, present=present)
        ctx.emit("softmax_recommended_temperature", recommended, labels, present=present)

    def reset(self) -> None:
        self._saturation.clear()
        self._pending.clear()
        self._distillation.clear()

    def close(self) -> None:
        self.reset()
        self._grids.clear()
