"""Loss accounting's report: a reported step's sums turned into samples and events.

During the step, capture (:mod:`~trainvitals.hooks.signals.loss.signal`) adds
everything it learns into one sums vector laid out by
:class:`~trainvitals.hooks.signals.loss.layout.SumsLayout`, plus each objective's
largest and smallest label-token weight. At a report, :class:`LossReport` combines
them across ranks (sum, max, min: one packed collective with the rest of the
report) and derives every figure below from them with batched tensor arithmetic;
on one rank that arithmetic runs on the sender thread, on the host copy of the
sums packed with the report (``StepContext.on_host``), so the training thread pays
no op for it. The log-once warnings about values (mixed or unknown modality codes,
a declared modality on no label token, a non-finite loss, a gradient that is not a
plain cross-entropy one) are said from the report's values on the sender thread
(across ranks: read a step later, once their host copy has landed): they are in
:mod:`~trainvitals.hooks.signals.loss.events`; what capture hands over is
:class:`~trainvitals.hooks.signals.loss.accumulated.Accumulated`.

Definitions (per optimizer step, over all its ``track_loss`` calls and all ranks):

- Label tokens: those where ``mask`` is true (all tokens without a mask). Other
  tokens carry no loss and are ignored everywhere.
- Sample: a row of ``per_token``; with ``segments``, a (row, segment id) pair, so a
  packed row holds several samples. A 1-D ``per_token`` [N] is N one-token samples,
  or with ``segments`` [N] one packed row. Samples without label tokens do not count.
- A sample's modality: its code in a per-sample ``modality``; with per-token codes,
  the highest declared code on any of its positions, label token or not (a VLM's
  image code marks the image *input* positions: the sample is an image sample). A
  sample whose label tokens mix codes is reported once as an event and a log line
  (a value problem, never raised). Codes outside ``attach(modalities=...)`` count
  toward the totals only (event + log once). A declared modality that marks only
  positions of samples without label tokens reads as absent: an event
  ``modality_without_label_tokens`` and a log line say so.
- Objectives: each ``track_loss`` call belongs to an ``objective`` (default
  ``"main"``; a hard-label term and a distillation term on the same logits are two),
  optionally with the ``weight`` it carries in the total loss (2.0, tau**2) and the
  ``normalization`` the job intends (``token``, ``sqrt``, ``sample``; or
  ``attach(loss_normalization=...)``).
- ``w_s`` = sum of the sample's label-token weights, ``n_s`` = its label tokens.
- ``modality_sample_share_ratio`` / ``_token_share_ratio`` / ``_grad_share_ratio``:
  the modality's share of samples, label tokens, and weight ``sum w`` (I1).
  ``modality_dilution_ratio`` = sample share / grad share (1 when every sample
  weighs the same; 17 in I1). ``modality_excess_dilution_ratio`` = the grad share
  the intended normalization gives the modality / the grad share it gets: the
  declared scheme; undeclared, sqrt when the fitted exponent is within 0.15 of 0.5,
  else per sample. 1 when the job does what it intends, the dilution itself for an
  undeclared per-token loss (I1), about 1 for a deliberate sqrt.
- ``loss``: mean per-token loss over every label token; ``modality_loss{modality}``
  over the modality's label tokens.
- ``loss_norm_exponent``: least-squares slope of ``log w_s`` on ``log n_s`` over
  the samples with ``w_s > 0``: 1 per-token, 0.5 sqrt, 0 per-sample normalization.
  Absent when the lengths do not vary (no slope to fit).
- ``loss_weight_mass{objective}``: the objective's ``sum w`` over the step divided
  by its declared ``weight`` (I2): 1 for a loss normalized over the step, N when the
  division by N accumulation steps is missing, the coefficient when one is carried
  but not declared. ``loss_accumulation_exponent{objective}`` = log(mass) / log(N)
  for the objective's N >= 2 micro-batches of the step: 1 when their losses were not
  divided by N, 0 when normalized, -1 when divided twice (a coefficient c shifts it
  by log c / log N, so one micro-batch never reads as a missing division). Under data
  parallelism DDP averages gradients, so a token's effective weight is
  ``w / world``: the mass is the sum over ranks divided by the world size.
  With ``attach(loss_reduction="sum")`` the job sums on purpose and divides later
  (across ranks too, as Megatron's per-token path does): the mass is the sum over
  ranks divided by ``loss_scale`` (default: the step's label tokens over all
  ranks), so 1 is still healthy.
- ``token_weight_spread_ratio{objective}``: max over the step's micro-batches (and
  ranks) of the objective's per-token weight over the min (I3): 1 for a globally
  normalized per-token loss, the token-count ratio for a mean of per-micro-batch
  means. Present only when every micro-batch is per-token normalized, i.e. its label
  tokens' weights are equal within a relative 1e-3. Where the job declares per-sample
  weighting (each sample averaged over its own tokens: GRPO's per-sequence mean, one
  sample per micro-batch in Megatron's default) unequal token weights are the intent:
  the series carries ``normalization="sample"`` and is the step's largest per-token
  weight over its smallest, every micro-batch uniform or not (the longest sample's
  label tokens over the shortest's when every sample weighs the same); no rule
  judges it a mean of means.
- ``modality_grad_norm{scope="output"}``: with ``output`` (logits or last hidden
  states), the gradient of the step's loss w.r.t. that tensor restricted to the
  modality's samples: sqrt of the sum over the modality's samples (and the step's
  micro-batches and ranks) of squared per-sample output-gradient norms, scaled like
  the mass (``/ world``, or ``/ loss_scale`` with "sum").
- ``microbatches``: micro-batches in the step (this rank): the most ``track_loss``
  calls of one objective.
- ``nonfinite_total{what="loss"}``: micro-batches since attach with a non-finite
  per-token loss on a label token, counted every step, summed over ranks.

"Absent" costs no host sync: such values are emitted with ``ctx.emit(present=...)``
and dropped on the sender thread where the condition is false (a modality without
samples has no dilution or loss either).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from trainvitals.hooks.host_finish import LogRatioFinish
from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.late_warnings import LateWarnings
from trainvitals.hooks.optimizer_family import FAMILY_VALUE, optimizer_family
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.signals.loss.accumulated import Accumulated, Snapshot
from trainvitals.hooks.signals.loss.arguments import MAX_OBJECTIVES, NORMALIZATIONS
from trainvitals.hooks.signals.loss.deferred import Deferred
from trainvitals.hooks.signals.loss.events import LossEvents
from trainvitals.hooks.signals.loss.labels import ModalityLabels
from trainvitals.hooks.signals.loss.layout import SumsLayout
from trainvitals.hooks.signals.loss.plan import ROWS, Plan
from trainvitals.hooks.signals.loss.probe import ModalityProbe
from trainvitals.hooks.step import StepContext
from trainvitals.hooks.tensors import float_dtype

__all__ = ["Accumulated", "LossReport"]


class LossReport(LossEvents):
    """Emits a reported step's loss-accounting figures; see the module docstring.

    ``objectives`` is capture's name -> slot table, shared (capture adds to it);
    ``late`` capture's log-once warnings, which capture polls too.

    On one rank, without the probe's Gram matrix, the figures are worked out on the
    sender thread from the host copy of the step's sums and extremes
    (:meth:`StepContext.on_host`): the training thread pays no op for them. A second
    instance does that work, with its own plans and caches (never shared across the
    threads)."""

    on_host = True
    """Whether a single rank's figures are made on the sender thread (the tests run both ways)."""

    def __init__(self, layout: SumsLayout, objectives: dict[str, int], late: LateWarnings) -> None:
        self._layout = layout
        self._objectives = objectives
        self._late = late
        self._host: LossReport | None = None  # the sender thread's emitter, made at first use
        self._lock = threading.Lock()  # the host emitter's: one emission at a time
        self._indices = IndexCache()
        self._family: torch.Tensor | None = None  # optimizer_scale_invariant, made once
        self._plans: dict[tuple[Any, ...], Plan] = {}  # per report layout
        self._modality_labels: dict[tuple[str, ...], ModalityLabels] = {}  # per modality names
        self._warnings: dict[tuple[Any, ...], tuple[tuple[tuple[str, str], ...], list[int]]] = {}

    def report(
        self,
        monitor: MonitorView,
        ctx: StepContext,
        acc: Accumulated,
        *,
        nonfinite: torch.Tensor | None,
        zero_code: bool,
        probe: ModalityProbe | None,
        gram: torch.Tensor | None,
    ) -> None:
        """Combine ``acc`` across ranks, then emit its figures into ``ctx``.
        ``nonfinite``: micro-batches with a non-finite loss since attach (this rank),
        None before the first; ``zero_code``: weights read from the logits' gradient;
        ``gram``: the parameter-space ``probe``'s Gram matrix on its steps (the probe is
        passed per report: a live setting may swap it)."""
        lay = self._layout
        distributed = monitor.world_size > 1
        if acc.sums is None:
            if not distributed:
                if nonfinite is not None:
                    ctx.emit("nonfinite_total", nonfinite.float(), {"what": "loss"})
                return
            dev = ctx.device
            fdt = float_dtype(dev)
            sums = torch.zeros(lay.size, dtype=fdt, device=dev)
            extremes = torch.full((lay.extremes,), float("-inf"), dtype=fdt, device=dev)
        else:
            assert acc.extremes is not None
            sums, extremes = acc.sums, acc.extremes  # the finished step's: written in place
        if nonfinite is not None:
            counter = acc.counter if acc.counter is not None else sums[lay.nonfinite]
            counter.copy_(nonfinite if nonfinite.dim() == 0 else nonfinite.reshape(()))
        if distributed:  # this rank's counts; on one rank the emission's division passes them through
            pairs, at = self._late_warnings(monitor, nonfinite is not None, zero_code)
            self._late.add_many(pairs, sums.index_select(0, self._indices.get(at, sums.device)))
        counting = nonfinite is not None
        # what the hooks kept, handed over once (a hook that fires later adds its own sums)
        taken_over = acc.later.close() if acc.later is not None else None
        entries, kept = taken_over if taken_over is not None else ((), [])
        if not distributed and gram is None and self.on_host:
            # On one rank the figures are made on the sender thread from the host copy of
            # the sums and extremes, taken when the report is packed (before the next
            # step's first micro-batch resets them), with the micro-batch results the
            # hooks left to it. What the emission reads of this step travels with it:
            # copies of the per-step host state, the monitor's settings.
            host = self._host
            if host is None:
                # its own layout too: the layout's caches are never shared across the threads
                host = self._host = LossReport(SumsLayout(lay.bins - 1, lay.objectives), self._objectives, self._late)
            view = Snapshot(
                monitor.modalities, monitor.config, monitor.world_size, monitor.warn_once, monitor.optimizer
            )
            objectives = dict(self._objectives)
            taken = Accumulated(
                calls=list(acc.calls),
                weights=dict(acc.weights),
                normalization=acc.normalization,
                fired=acc.fired,
                output=acc.output,
                withheld=acc.withheld,
            )

            def run(sub: StepContext, parts: list[torch.Tensor]) -> None:
                # One emission at a time: the sender thread and a caller of Monitor.latest()
                # may materialize two reports at once, and the plans' buffers are written in place.
                with host._lock:
                    sums, ext = parts[0], parts[1]
                    if entries:  # into copies: the report's host values stay as packed (a rerun adds once)
                        sums, ext = sums.clone(), ext.clone()
                        Deferred.apply(host._layout, entries, parts[2:], sums, ext)
                    host._emit(view, sub, sums, ext, taken, counting, zero_code, None, None, objectives)

            ctx.on_host([sums, extremes, *kept], run)
            return
        if entries:  # the figures are made here after all (a probe step, a setting changed): add them now
            Deferred.apply(lay, entries, kept, sums, extremes)
        # Across ranks (and on the probe's steps, whose Gram matrix is on the device) the
        # figures are tensor ops here. On one rank the emission reads the step's own sums,
        # in their own dtype (no copy): nothing writes them before the next step's first
        # micro-batch.
        objectives = self._objectives
        copies = monitor.world_size / (monitor.data_parallel_size * monitor.pipeline_stages)
        if copies != 1:  # a tensor-parallel group's ranks hold the same sums
            sums = sums * (1 / copies)
        if monitor.pipeline_stages > 1:  # what the last stage knows travels with the sums
            meta = self._stage_meta(acc, zero_code, sums.device)
            ctx.combine(
                [(sums, "sum"), (extremes, "max"), (meta, "max")],
                lambda s, ext, known: self._pipeline_emit(monitor, ctx, s, ext, known, counting, objectives),
                across_ranks=True,
            )
            return
        ctx.combine(
            [(sums, "sum"), (extremes, "max")],
            lambda s, ext: self._emit(monitor, ctx, s, ext, acc, counting, zero_code, probe, gram, objectives),
            across_ranks=True,
            as_is=True,
        )

    def _stage_meta(self, acc: Accumulated, zero_code: bool, device: torch.device) -> torch.Tensor:
        """What the emission reads of a step's host bookkeeping, as numbers combined by
        max over the ranks: on a pipeline-parallel job only the last stage tracks the loss,
        and rank 0, the sender, is on the first (:meth:`_pipeline_emit` reads them back).
        [fired, output, zero-code, withheld, normalization code, calls per objective slot,
        declared weight per slot (-inf: none)]."""
        code = 0.0 if acc.normalization is None else 1.0 + sorted(NORMALIZATIONS).index(acc.normalization)
        head = [float(acc.fired), float(acc.output), float(zero_code), float(bool(acc.withheld)), code]
        weights = [acc.weights.get(k, float("-inf")) for k in range(MAX_OBJECTIVES)]
        # the same numbers step after step: one kept tensor, no copy to the device per report
        return self._indices.get(head + [float(c) for c in acc.calls] + weights, device, torch.float32)

    def _pipeline_emit(
        self,
        monitor: MonitorView,
        ctx: StepContext,
        sums: torch.Tensor,
        extremes: torch.Tensor,
        meta: torch.Tensor,
        counting: bool,
        objectives: dict[str, int],
    ) -> None:
        """The figures of a pipeline-parallel job's step, made on the sender thread from the
        sums and the last stage's bookkeeping (:meth:`_stage_meta`) combined over every stage."""
        lay = self._layout
        host = self._host
        if host is None:
            host = self._host = LossReport(SumsLayout(lay.bins - 1, lay.objectives), self._objectives, self._late)
        view = Snapshot(
            monitor.modalities,
            monitor.config,
            monitor.world_size,
            monitor.warn_once,
            monitor.optimizer,
            monitor.data_parallel_size,
        )
        names = dict(objectives)

        def run(sub: StepContext, parts: list[torch.Tensor]) -> None:
            s, ext, known = parts
            values = [float(v) for v in known.tolist()]
            fired, output, zero_code, withheld, code = values[:5]
            calls = [int(c) for c in values[5 : 5 + MAX_OBJECTIVES]]
            weights = {k: w for k, w in enumerate(values[5 + MAX_OBJECTIVES :]) if w != float("-inf")}
            if not fired and not any(calls):  # as a job without pipeline stages that never asked
                sub.inactive_when(
                    "loss", None, "not_requested", "no track_loss call and no LM head read on any pipeline stage"
                )
            elif not fired:
                sub.inactive_when("loss", None, "no_input", "no loss got a gradient on any pipeline stage in the step")
            taken = Accumulated(
                calls=calls,
                weights=weights,
                normalization=None if code == 0 else sorted(NORMALIZATIONS)[int(code) - 1],
                fired=bool(fired),
                output=bool(output),
                withheld="the last pipeline stage's packed rows" if withheld else "",
            )
            with host._lock:
                host._emit(view, sub, s, ext, taken, counting, bool(zero_code), None, None, names)

        ctx.on_host([sums, extremes, meta], run)

    def _emit(
        self,
        monitor: MonitorView | Snapshot,
        ctx: StepContext,
        sums: torch.Tensor,
        extremes: torch.Tensor,
        acc: Accumulated,
        counting_nonfinite: bool,
        zero_code: bool,
        probe: ModalityProbe | None,
        gram: torch.Tensor | None,
        objectives: dict[str, int],
    ) -> None:
        """The step's figures from the sums combined over ranks (see the module docstring).

        Every ratio of one kind is one division over index-gathered numerators and
        denominators, every threshold test one comparison (``Plan``), so a report costs
        a few dozen tensor ops whatever the number of modalities and objectives."""
        names = list(monitor.modalities)
        m = len(names)
        labels = self._labels(names)
        config = monitor.config
        calls = acc.calls
        full = acc.fired or monitor.world_size > 1  # weights arrived: the figures about them
        active = [(name, k) for name, k in sorted(objectives.items(), key=lambda kv: kv[1]) if calls[k]]
        declared = acc.normalization or config.loss_normalization
        # How the job's loss combines across ranks sets the unit of weight (see module doc).
        scale: float | None  # None: the step's label tokens
        if config.loss_reduction == "sum":
            scale = float(config.loss_scale) if config.loss_scale is not None else None
        else:
            scale = float(monitor.data_parallel_size)  # the loss is averaged over the data-parallel ranks
        plan = self._plan(
            m,
            tuple(k for _, k in active) if full else (),
            tuple(acc.weights.get(k, 1.0) for _, k in active) if full else (),
            scale,
            declared,
            zero_code,
            sums.device,
            torch.float32,  # the figures' dtype, on one rank as on several (their sums come float32)
            sums.dtype,
        )
        first, verdicts, verdict = self._ratios(monitor, ctx, plan, sums, extremes, acc, zero_code)

        if counting_nonfinite or monitor.world_size > 1:
            ctx.emit("nonfinite_total", first[plan.nonfinite], {"what": "loss"})
        gate = self._zero_code_gate(ctx, plan, first, verdict) if zero_code else None

        def gated(present: torch.Tensor) -> torch.Tensor:
            return present if gate is None else present * gate

        ctx.emit("microbatches", self._indices.get([float(max(calls))], ctx.device, sums.dtype), present=gate)
        if acc.fired:
            ctx.inactive_when("loss", verdict[plan.no_input], "no_input", "no label token in the reported step")
        ctx.emit("loss", first[plan.loss], present=gated(first[plan.present_loss]))
        withheld = acc.withheld  # the samples of packed rows cannot be known: no per-sample figure
        if withheld:
            ctx.event("loss_samples_withheld", f"per-sample and per-modality figures withheld: {withheld}")
            monitor.warn_once(
                "loss_samples_withheld",
                "loss accounting: per-sample and per-modality figures withheld: %s (docs/signals.md, "
                "'Packed sequences')",
                withheld,
            )
        else:
            ctx.emit_block(
                labels.rows,
                first[plan.rows],
                present=gated(first[plan.present_rows]),
                gated=range(3 * m),
            )
        self._emit_events(monitor, ctx, plan, first, verdicts, verdict, labels, zero_code, withheld)
        if not full:
            return  # no weights arrived on this step: nothing honest to say about them

        self._emit_weights(
            monitor, ctx, plan, first, verdict, acc, labels, active, declared, gated, gate, scale, probe, gram, names
        )

    def _ratios(
        self,
        monitor: MonitorView | Snapshot,
        ctx: StepContext,
        plan: Plan,
        sums: torch.Tensor,
        extremes: torch.Tensor,
        acc: Accumulated,
        zero_code: bool,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, tuple[torch.Tensor, ...]]:
        """Every first-stage ratio (one gathered division over the plan's pool) and every
        threshold test (one comparison): ``(first, verdicts, verdict)``, split as the plan
        lays them out."""
        lay = self._layout
        # The pool every ratio reads from: the sums, their square roots, the per-bin
        # totals, the weight extremes, host-known constants, the exponent fit's products
        # and its numerator and denominator (``Plan``).
        # (the sums are a dense 1-D vector: their first rows viewed as [ROWS, bins], no copy)
        rows = acc.rows if sums is acc.sums and acc.rows is not None else None
        totals = (rows if rows is not None else sums.as_strided((len(ROWS), lay.bins), (lay.bins, 1))).sum(1)
        # [[n sxy, n sxx, sx sy, n n], [sx sy, sx sx, n sxy, n n]]; their difference is the
        # fit's numerator, denominator, minus numerator (and 0). A difference, not a product
        # with a sign matrix: a non-finite sy (an infinite weight) must leave the
        # denominator finite (inf * 0 is NaN), so the exponent reads NaN, not absent.
        torch.index_select(sums, 0, plan.fit, out=plan.fit_in)
        torch.prod(plan.fit_pairs, 2, out=plan.fit_out)  # written in kept buffers with their views made once
        above, below = plan.above, plan.below
        pieces = [sums, sums.sqrt(), totals, extremes, plan.consts, above, below, above - below]
        if plan.pool_wide is None:
            pool = torch.cat(pieces, out=plan.pool)
        else:  # one cat in the sums' dtype, then rounded once into the figures' dtype
            pool = plan.pool.copy_(torch.cat(pieces, out=plan.pool_wide))
        first = (pool.index_select(0, plan.num1) / pool.index_select(0, plan.den1)).split_with_sizes(plan.sizes)
        if monitor.world_size == 1:  # the warnings' counts (on several ranks, report took this rank's)
            pairs, _ = self._late_warnings(monitor, True, zero_code)  # the counter is 0 when not counting
            ctx.warn_when(pairs, first[plan.warn_counts], monitor.warn_once)
        torch.gt(first[plan.tests], plan.bounds, out=plan.tested)
        verdicts = plan.tested_rows.all(1)
        verdict = verdicts.split_with_sizes(plan.verdict_sizes)
        return first, verdicts, verdict

    def _emit_weights(
        self,
        monitor: MonitorView | Snapshot,
        ctx: StepContext,
        plan: Plan,
        first: tuple[torch.Tensor, ...],
        verdict: tuple[torch.Tensor, ...],
        acc: Accumulated,
        labels: ModalityLabels,
        active: list[tuple[str, int]],
        declared: str | None,
        gated: Callable[[torch.Tensor], torch.Tensor],
        gate: torch.Tensor | None,
        scale: float | None,
        probe: ModalityProbe | None,
        gram: torch.Tensor | None,
        names: list[str],
    ) -> None:
        """The figures about the step's loss weights (a step whose weights arrived): the
        dilution, the exponent, the objectives' mass, the optimizer family, the per-modality
        gradient norms and the probe."""
        mod_labels = labels.modality
        calls = acc.calls
        withheld = acc.withheld
        second = (first[plan.num2] / first[plan.den2]).split_with_sizes(plan.second_sizes)
        dilution, intended, mass, grad_norm, spread = second
        weighted = first[plan.weight_total] != 0  # the weight's total: it may be negative
        p_weighted = gated(first[plan.present_samples] * weighted)
        if declared is not None:
            excess = intended
        else:
            # undeclared: sqrt when the fitted exponent is 0.5 (a deliberate choice), else per sample
            excess = torch.where(verdict[plan.sqrt_ok], intended, dilution)
        if not withheld:  # the weight mass and the token-weight spread need no samples
            ctx.emit("modality_grad_share_ratio", first[plan.share], mod_labels, present=gated(weighted))
            ctx.emit("modality_dilution_ratio", dilution, mod_labels, present=p_weighted)
            ctx.emit("loss_norm_exponent", first[plan.exponent], present=gated(verdict[plan.fit_ok]))
            ctx.emit("modality_excess_dilution_ratio", excess, mod_labels, present=p_weighted)
        if active:
            self._emit_objectives(
                ctx,
                plan,
                mass,
                spread,
                gated(first[plan.present_mass]),
                verdict[plan.spread_ok],
                [(n, calls[k]) for n, k in active],
                declared,
                gated,
            )
        # What a missing division does depends on the optimizer: the rules read it beside the mass.
        if self._family is None:
            self._family = torch.tensor([FAMILY_VALUE[optimizer_family(monitor.optimizer)]], device=ctx.device)
        ctx.emit("optimizer_scale_invariant", self._family, present=gate)
        if acc.output and not withheld:
            ctx.emit(
                "modality_grad_norm",
                grad_norm,
                labels.output,
                present=gated(first[plan.present_samples]),
            )
        if gram is not None:
            assert probe is not None
            probe.emit(ctx, gram, names, first[plan.scale].reshape(()) if scale is None else scale)

    def _labels(self, names: list[str]) -> ModalityLabels:
        key = tuple(names)
        found = self._modality_labels.get(key)
        if found is None:
            if len(self._modality_labels) >= 16:
                self._modality_labels.clear()
            found = self._modality_labels[key] = ModalityLabels(names)
        return found

    def _emit_objectives(
        self,
        ctx: StepContext,
        plan: Plan,
        mass: torch.Tensor,
        spread: torch.Tensor,
        present: torch.Tensor,
        uniform: torch.Tensor,
        objectives: list[tuple[str, int]],
        declared: str | None,
        gated: Any,
    ) -> None:
        """Per objective (name, micro-batches): its weight mass relative to its declared
        weight, how that mass scales with the step's micro-batches, and its token-weight
        spread (I2, I3); ``uniform``: the spread's verdict per objective."""
        labels = [{"objective": name} for name, _ in objectives]
        dev, dt = mass.device, mass.dtype
        # present where the mass is > 0, for N >= 2 micro-batches (no mass is > inf)
        floor = self._indices.get([0.0 if c >= 2 else math.inf for _, c in objectives], dev, dt)
        ctx.emit("loss_weight_mass", mass, labels, present=present)
        # mass = N^k for N micro-batches: k = 1 when their losses were not divided by N,
        # 0 when normalized, -1 when divided twice (a coefficient shifts it by log c / log N).
        # log(mass) / log(N) on the sender thread: a few numbers
        ctx.emit_block(
            [("loss_accumulation_exponent", labels)],
            mass,
            present=gated(mass > floor),
            gated=range(len(labels)),
            host=LogRatioFinish([math.log(max(c, 2)) for _, c in objectives]),
        )
        # every micro-batch's token weights uniform (per-sample weighting declared: not
        # asked, unequal token weights are its intent), the smallest weight > 0, the largest
        # finite. Under per-sample intent the spread is a figure of that intent, labelled
        # normalization="sample": MeanOfMeansLoss leaves such series alone.
        if declared == "sample":
            labels = [{"objective": name, "normalization": "sample"} for name, _ in objectives]
        ctx.emit("token_weight_spread_ratio", spread, labels, present=gated(uniform))

    def _plan(
        self,
        m: int,
        slots: tuple[int, ...],
        declared_weights: tuple[float, ...],
        scale: float | None,
        declared: str | None,
        zero_code: bool,
        device: torch.device,
        dtype: torch.dtype,
        sums_dtype: torch.dtype,
    ) -> Plan:
        key = (m, slots, declared_weights, scale, declared, zero_code, device, dtype, sums_dtype)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 16:
                self._plans.clear()
            plan = self._plans[key] = Plan(self._layout, *key)
        return plan
