"""The monitor's hooks on the optimizer step: one optimizer step, start to report.

Data flow of one report step (each stage its own module):

1. ``optimizer.step()`` runs :meth:`StepLifecycle.before_step` and
   :meth:`StepLifecycle.after_step`; the signals (:mod:`trainvitals.hooks.signals`)
   do cheap bookkeeping on every step. On a report step the step's gradient norms
   (:mod:`trainvitals.hooks.grad_norms`) are taken once before the step, for the
   signals that use them, and every signal's ``collect`` writes batched tensor
   statistics into a :class:`~trainvitals.hooks.step.StepContext`.
2. :class:`trainvitals.hooks.distributed.ReportCollective` runs the cross-rank partials
   in one collective the ranks agree on (a header says what each rank sent; what
   differs is withheld, said why, the same way on every rank).
3. :func:`trainvitals.hooks.pack.pack` concatenates everything into one vector and
   starts its one copy to the host.
4. :class:`trainvitals.hooks.sender.Sender` (one thread) materializes, validates,
   encodes and hands the report to a sink (:mod:`trainvitals.hooks.sinks`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainvitals.hooks import distributed
from trainvitals.hooks import pack as packing
from trainvitals.hooks.coverage import withhold
from trainvitals.hooks.grad_norms import GradNorms
from trainvitals.hooks.live_settings import LiveSettings
from trainvitals.hooks.pack import PendingReport
from trainvitals.hooks.running_signals import PendingEvents, RunningSignals
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.step import StepContext

__all__ = ["StepLifecycle"]


class StepLifecycle:
    """The per-step state of one monitor's optimizer hooks, and the reports they make.

    ``monitor`` is the view the signals get (its ``step`` counts the steps taken);
    the rest is what a report is made of and where it goes."""

    def __init__(
        self,
        monitor: MonitorView,
        *,
        run: str,
        signals: RunningSignals,
        events: PendingEvents,
        live: LiveSettings,
        sender: Sender,
    ) -> None:
        self.monitor = monitor
        self.run = run
        self.signals = signals
        self.events = events
        self.live = live
        self.sender = sender
        self.ready = False  # before_step ran for the step now being taken
        self.reporting = False  # the step now being taken is a report step
        self._grad_norms: GradNorms | None = None  # the step's, for its report
        self.latest: PendingReport | None = None
        """The latest report made (handed to the sender)."""
        self.last_coverage: list[dict[str, Any]] | None = None
        """The latest report's coverage entries as the training thread wrote them."""
        self.collective = distributed.ReportCollective()
        """The report's collective across data-parallel ranks (its agreed capacity)."""

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        mon = self.monitor
        self.ready = True
        self.reporting = mon.reporting_next
        self._grad_norms = None
        # Statistics only: no autograd bookkeeping. The mode is set by a function call
        # and put back in ``finally`` (the decorator costs several microseconds a call).
        grad_was = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            for s in self.signals.items:
                s.run_guarded("before_step", s.before_step, mon, self.reporting)
            if self.reporting:
                found = self._take_grad_norms()
                self._grad_norms = mon.job_grad_norms(found) if found is not None else None
        finally:
            torch.set_grad_enabled(grad_was)

    def _take_grad_norms(self) -> GradNorms | None:
        """The step's gradient norms, once: a signal's own measurement, else the applied
        gradients'; None when no running signal uses them."""
        mon = self.monitor
        users = [s for s in self.signals.items if s.uses_grad_norms and not s.broken]
        if not users:
            return None
        for s in self.signals.items:
            measured: GradNorms | None = s.run_guarded("measured_grad_norms", s.measured_grad_norms)
            if measured is not None:
                return measured
        try:
            return GradNorms.applied([g for _, g in mon.groups()], mon.device)
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            mon.warn_once("grad_norms", "could not take the gradient norms of step %d: %s", mon.step + 1, exc)
            return None

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        mon = self.monitor
        if not self.ready:  # step_boundary="manual" and gradients_ready() was not called
            self.before_step(optimizer, args, kwargs)
        self.ready = False
        mon.step += 1
        reporting = self.reporting
        self.live.step_ending()  # before the report: its own answer waits for the next step's end
        grad_was = torch.is_grad_enabled()  # statistics only: no autograd bookkeeping (before_step)
        torch.set_grad_enabled(False)
        try:
            for s in self.signals.items:
                s.run_guarded("after_step", s.after_step, mon, reporting)
            if reporting:
                try:
                    self.report()
                except Exception as exc:  # noqa: BLE001
                    mon.warn_once("report", "could not assemble the report of step %d: %s", mon.step, exc)
        finally:
            torch.set_grad_enabled(grad_was)
        self._grad_norms = None
        self.live.step_end(mon, reporting)  # the next step runs with what is due

    def report(self) -> None:
        """Collect, combine and pack the report of the step just taken (called by
        :meth:`after_step`, with autograd off)."""
        mon = self.monitor
        ctx = StepContext(step=mon.step, device=mon.device, grad_norms=self._grad_norms)
        emitted: dict[str, bool] = {}
        for s in self.signals.items:
            sections = len(ctx.sections)
            reduces = len(ctx.reduces)
            before = len(ctx.emits) + len(ctx.reduces) + sections
            s.run_guarded("collect", s.collect, mon, ctx)
            if s.broken:  # failed in collect: its partials are not this report's (nor the other ranks')
                del ctx.reduces[reduces:]
            for sec in ctx.sections[sections:]:  # a failure on the sender thread is this signal's
                sec.owner = s
            for red in ctx.reduces[reduces:]:
                red.owner = s
            if s.covers is not None:
                emitted[s.covers] = len(ctx.emits) + len(ctx.reduces) + len(ctx.sections) > before
        try:
            ctx.coverage, ctx.final = self.signals.coverage_entries(
                mon.coverage, emitted, stepped=mon.step > 0, verdicts=ctx.verdicts()
            )
            self.last_coverage = ctx.coverage
        except Exception as exc:  # noqa: BLE001
            mon.warn_once("coverage", "could not assemble the coverage of step %d: %s", mon.step, exc)
        self.live.contribute(mon, ctx)
        self._combine(ctx)
        self.events.move_to(ctx)
        pending = packing.pack(ctx, run=self.run, rank=mon.rank)
        if ctx.coverage:
            mon.coverage.note(ctx.coverage)
            pending.settle = mon.coverage.settle
        self.latest = pending
        self.sender.put(pending)

    def _combine(self, ctx: StepContext) -> None:
        """The report's collective, and what the ranks' headers said: figures withheld
        (their coverage says why), signals that failed on another rank turned off here,
        the step and interval realigned so the next reports pair."""
        mon = self.monitor
        members: list[distributed.Member] = []
        names: dict[str, int] = {}
        for s in self.signals.items:
            name = f"{type(s).__module__}.{type(s).__qualname__}"
            names[name] = names.get(name, 0) + 1
            if names[name] > 1:
                name += f"#{names[name]}"
            members.append(distributed.Member(name, off=s.broken, owner=s))
        out = self.collective.combine(ctx, members, every=mon.config.every)
        for owner, reason, detail in out.withheld:
            covers = getattr(owner, "covers", None)
            if covers is not None:
                withhold(ctx.coverage, ctx.final, covers, reason, detail)
        if out.withheld:
            mon.warn_once(
                "ranks_disagree",
                "step %d: the ranks' reports disagree, figures withheld: %s",
                ctx.step,
                "; ".join(sorted({d for _, _, d in out.withheld})),
            )
        for signal, rank in out.failed_on:
            signal.turn_off(f"collect on rank {rank}", RuntimeError("the signal failed on another rank"), agreed=True)
            signal.failure = (
                f"{type(signal).__name__} failed on rank {rank} and is turned off on every rank "
                f"(rank {rank}'s log has the error)"
            )
        if out.step is not None:
            mon.step = out.step
        if out.every is not None and out.every != mon.config.every:
            mon.config = dataclasses.replace(mon.config, every=out.every)
