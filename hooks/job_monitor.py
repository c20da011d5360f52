"""The ``Monitor`` that ``attach()`` returns: the user API, and what signals use of it
(:class:`~trainvitals.hooks.signals.base.MonitorView`).

It puts together, each in its own module: where the parameters live
(:mod:`trainvitals.hooks.placement`), the running signals and their hooks
(:mod:`trainvitals.hooks.running_signals`), the hooks on the optimizer step, from a
step's start to its report (:mod:`trainvitals.hooks.lifecycle`, which names the stages
of a report), the collector's live settings (:mod:`trainvitals.hooks.live_settings`),
what the job makes of its own reports (in-job rules, the trackers' headline figures:
:mod:`trainvitals.hooks.report_observer`) and what it says in the job's log at attach
and close (:mod:`trainvitals.hooks.summary`).
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, TypeVar

import torch
from torch import nn

from trainvitals.hooks import distributed
from trainvitals.hooks import pack as packing
from trainvitals.hooks.config import Config
from trainvitals.hooks.coverage import CoverageTracker
from trainvitals.hooks.grad_norms import GradNorms
from trainvitals.hooks.lifecycle import StepLifecycle
from trainvitals.hooks.live_settings import LiveSettings
from trainvitals.hooks.logits_finder import AUTO, find_head, find_logits_module
from trainvitals.hooks.naming import unwrap
from trainvitals.hooks.pack import PendingReport
from trainvitals.hooks.placement import Placement
from trainvitals.hooks.report_observer import ReportObserver
from trainvitals.hooks.running_signals import PendingEvents, RunningSignals
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.signals.base import Signal
from trainvitals.hooks.signals.loss.signal import LossAccounting
from trainvitals.hooks.signals.registry import builtin_signal_classes
from trainvitals.hooks.signals.softmax.signal import Softmax
from trainvitals.hooks.sinks import FileSink, HttpSink, Sink
from trainvitals.hooks.step import StepContext
from trainvitals.hooks.summary import log_summary, start_line, visible_logs
from trainvitals.wire.schema import RUN_END_EVENT
from trainvitals.wire.signals import SignalNames

__all__ = ["STATE_FORMAT", "Monitor", "builtin_signal_classes", "monitor_of", "visible_logs"]

STATE_FORMAT = 1
"""Version of ``Monitor.state_dict()``'s layout."""

log = logging.getLogger("trainvitals")

S = TypeVar("S", bound=Signal)

# optimizer -> its monitor, both weakly (a monitor holds its optimizer: a strong value
# would keep the key alive forever).
_BY_OPTIMIZER: weakref.WeakKeyDictionary[Any, weakref.ref[Monitor]] = weakref.WeakKeyDictionary()


def monitor_of(optimizer: Any) -> Monitor | None:
    """The open monitor watching ``optimizer``, or None."""
    ref = _BY_OPTIMIZER.get(optimizer)
    found = ref() if ref is not None else None
    return None if found is None or found.closed else found


class Monitor:
    """Watches one model and optimizer. Create it with :func:`attach`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run: str,
        sink: Sink,
        modalities: tuple[str, ...],
        scaler: Any,
        config: Config,
        rules: Any = None,
    ):
        self.model = unwrap(model)
        self.optimizer = optimizer
        self.run = run
        self.modalities = modalities
        self.scaler = scaler
        self.config = config
        self.step = 0
        self.rank = distributed.rank()
        self.world_size = distributed.world_size()
        self._warned: set[str] = set()
        self._placement = Placement(self.model, optimizer, self.world_size, self.warn_once)
        """Where the parameters live: names, device, how per-rank sums combine."""
        self.param_names = self._placement.param_names
        self.optimizer = self._placement.watched(optimizer)
        """As the signals see it: on a pipeline-parallel job, every stage's parameters."""
        self.device = self._placement.device
        self.sharded = self._placement.sharded
        self.data_parallel_size = self._placement.data_parallel_size
        """The ranks that see different data for the same parameters (Megatron's data-parallel group)."""
        self.pipeline_stages = self._placement.pipeline_stages
        """Megatron's pipeline stages: the loss and the LM head are on the last only."""
        self.coverage = CoverageTracker()
        """What each built-in signal covers; signals declare their state here."""
        self.layout_problem = self._placement.layout_problem
        """A parameter layout whose per-rank sums cannot be combined (named), or None."""
        self.weighted = self._placement.weighted
        """Some parameter's per-rank sums count for less than 1 (:meth:`weight_of`)."""
        # Zero-code loss accounting: its module is found first, so a wrong name raises
        # before anything is hooked or started.
        logits_module = None
        no_head = None
        self._loss_auto = config.loss_from_logits == AUTO
        if not self._placement.pipeline_last:
            pass  # a pipeline stage before the last reads no logits: its loss sums are zeros
        elif self._loss_auto:
            logits_module, *no_head = find_head(self.model)
        elif config.loss_from_logits:
            logits_module = find_logits_module(self.model, config.loss_from_logits)
        self._events = PendingEvents()
        self._saved_signals: dict[str, Any] = {}
        self.closed = False
        """``close()`` has run: no hooks left, nothing more reported."""
        self.ends_run = True
        """``close()`` reports the run's end (False: the run goes on in another monitor,
        as when ``trainvitals run``'s monitor hands over to the job's own ``attach``)."""
        self.automatic = False
        """Attached by ``trainvitals run`` (the job's own ``attach`` may take over)."""
        self._observer = ReportObserver(rules)
        # What is watched (start), what was reported and delivered (close) and alerts in
        # the job are said where the job can see them, even with logging unconfigured.
        visible_logs()
        if self._observer.evaluator is not None and hasattr(sink, "firing"):
            sink.firing = self._observer.firing_names  # a tracker sink shows the alerts firing
        self._sender = Sender(
            sink, max_queue_bytes=config.queue_bytes, on_report=self._observer.observe, spill=_spill_for(sink, run)
        )
        self.signals: list[Signal] = _default_signals(config.signals)
        if self.layout_problem is not None:  # withheld, said why: never a figure from a wrong sum
            for s in [s for s in self.signals if s.covers in _PLACED]:
                self.signals.remove(s)
                self.coverage.set_inactive(s.covers, "sharded", self.layout_problem)  # type: ignore[arg-type]
        self._running = RunningSignals(self.signals)
        # Live settings arrive with the collector's answers (sender thread) and are
        # applied at the end of a step (training thread).
        self._live = LiveSettings(
            config, run=run, signals=self._running, events=self._events, builtin=builtin_signal_classes()
        )
        self._steps = StepLifecycle(
            self, run=run, signals=self._running, events=self._events, live=self._live, sender=self._sender
        )
        self._running.hold(optimizer.register_step_post_hook(self._steps.after_step))
        if config.step_boundary == "pre_step_hook":
            self._running.hold(optimizer.register_step_pre_hook(self._steps.before_step))
        for s in self.signals:
            self._running.bind(s, self)
        if self.pipeline_stages > 1:  # on every stage, in the same place: the reports' vectors alike
            self._loss_signal()
        if logits_module is not None:
            self._running.hold_all(self._loss_signal().watch_logits(self, logits_module, auto=self._loss_auto))
        elif no_head is not None:  # "auto" found no head: watched without loss accounting, said why
            self.coverage.set_inactive("loss", *no_head)
        if hasattr(sink, "on_answer"):
            sink.on_answer = self._live.receive
        atexit.register(self.close)
        _BY_OPTIMIZER[optimizer] = weakref.ref(self)

    # -- what signals use ----------------------------------------------------
    def reports_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is a report step."""
        return step == 1 or step % self.config.every == 0

    @property
    def reporting_next(self) -> bool:
        """Whether the optimizer step now being accumulated will be reported."""
        return not self.closed and self.reports_at(self.step + 1)

    def grad_layout_problem(self, params: list[torch.Tensor]) -> str | None:
        """A gradient placed otherwise than its DTensor parameter, named; or None
        (:meth:`Placement.grad_layout_problem`)."""
        return self._placement.grad_layout_problem(params)

    def weight_of(self, p: torch.Tensor) -> float:
        """What this rank's partial sums of ``p`` count for in the sum over ranks
        (:meth:`Placement.weight_of`)."""
        return self._placement.weight_of(p)

    def job_grad_norms(self, norms: GradNorms) -> GradNorms:
        """The step's gradient norms over every parameter the signals watch
        (:meth:`Placement.job_grad_norms`: a pipeline stage's, laid out job-wide)."""
        return self._placement.job_grad_norms(norms)

    def numel_of(self, p: torch.Tensor) -> int:
        """The element count of the whole of ``p``: a DTensor's is global already; a
        Megatron tensor-parallel split's is its piece's times the group's size."""
        return self._placement.numel_of(p)

    def name_of(self, p: torch.Tensor, fallback: str = "") -> str:
        return self._placement.name_of(p, fallback)

    def groups(self) -> list[tuple[str, dict[str, Any]]]:
        """(label, param_group) for each optimizer param group; label is the group's
        ``name`` when set, else its index."""
        return [(str(g.get("name", i)), g) for i, g in enumerate(self.optimizer.param_groups)]

    def event(self, kind: str, detail: str = "", labels: dict[str, str] | None = None) -> None:
        """Queue a host-side event for the next report."""
        self._events.add(kind, detail, labels)

    def warn_once(self, key: str, message: str, *args: Any) -> bool:
        """Log ``message`` the first time ``key`` is given; True when it logged now."""
        if key in self._warned:
            return False
        self._warned.add(key)
        log.warning("trainvitals: " + message, *args)
        return True

    # -- user API ------------------------------------------------------------
    def track_loss(
        self,
        per_token: torch.Tensor,
        *,
        modality: Any = None,
        mask: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
        objective: str = "main",
        weight: float | None = None,
        normalization: str | None = None,
    ) -> None:
        """Account the loss weights of one micro-batch; call once per micro-batch,
        before its backward (definitions: docs/signals.md, "Loss accounting").

        ``per_token``: [B, T] (or [N]) per-token losses the loss is reduced from
        (``reduction="none"``); it must require grad. ``modality``: per sample [B] or
        per token [B, T], integer codes or names from ``attach(modalities=...)``; leave
        it out for a job with one modality (its figures are the totals: weight mass,
        exponent, spread).
        ``mask``: [B, T] bool, the label tokens (default: all). ``segments``: [B, T]
        sample ids of packed rows. ``output``: logits or last hidden states
        [B, T, ...], for per-modality output-gradient norms. ``objective``: which term of
        the loss this is (a mixture, hard labels + distillation, is judged per term);
        ``weight``: the coefficient it carries in the loss you call backward on (2.0,
        tau**2), so its weight mass is judged against it; ``normalization``: how the job
        intends to weight samples ("token", "sqrt", "sample"; default
        ``attach(loss_normalization=...)``). Wrong types, shapes and unknown names raise
        here; problems in the values become events.
        """
        signal = self._loss_signal()
        if self._loss_auto and signal.reads_logits:
            # The job accounts its loss itself: the head's logits are read no more (the
            # step begun from them is dropped, so no micro-batch counts twice).
            signal.stop_reading_logits()
            log.info("trainvitals: track_loss() called: loss accounting from it; the LM head's logits are read no more")
        if self._loss_auto:
            self._loss_auto = False
            if self.coverage.declared("loss") is not None:
                self.coverage.clear("loss")  # the head "auto" did not find no longer matters
        signal.track(
            self,
            per_token,
            modality=modality,
            mask=mask,
            segments=segments,
            output=output,
            objective=objective,
            weight=weight,
            normalization=normalization,
        )

    @property
    def reads_logits(self) -> bool:
        """Zero-code loss accounting is on: the LM head's logits are read every micro-batch."""
        return any(isinstance(s, LossAccounting) and s.reads_logits for s in self.signals)

    def tag_batch(self, modality: Any = None, segments: torch.Tensor | None = None) -> None:
        """With zero-code loss accounting (``attach(loss_from_logits=...)``): the modality
        of the next forward's samples (codes or names per sample [B] or per token [B, T],
        or one name for all) and, for packed rows, their segment ids [B, T]. Call it
        before each micro-batch's forward; an untagged micro-batch counts toward the
        totals only. Wrong types raise here, wrong shapes when the logits arrive."""
        self._loss_signal().tag(self, modality, segments)

    def gradients_ready(self) -> None:
        """With ``attach(step_boundary="manual")``: the step's gradients are final (call
        it where the last backward of the step has run and ``optimizer.step()`` is about
        to update, e.g. Lightning's ``on_before_optimizer_step``)."""
        if self.config.step_boundary != "manual":
            raise RuntimeError(
                "gradients_ready() is for attach(step_boundary='manual'); by default "
                "the optimizer's pre-step hook marks the end of a step's gradients"
            )
        if not self.closed:
            self._steps.before_step(self.optimizer, (), {})

    def observe_logits(
        self,
        logits: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        task: str = "all",
        role: str = "student",
        temperature: float = 1.0,
    ) -> None:
        """Softmax saturation statistics of ``logits`` ([B, T, V] or [N, V])."""
        self._softmax_signal().observe_logits(self, logits, mask=mask, task=task, role=role, temperature=temperature)

    def observe_distillation(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        *,
        temperature: float,
        mask: torch.Tensor | None = None,
        task: str = "all",
    ) -> None:
        """Saturation of both roles at ``temperature`` plus the distillation signals."""
        self._softmax_signal().observe_distillation(
            self, student_logits, teacher_logits, temperature=temperature, mask=mask, task=task
        )

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to keep measuring from the original references: the
        step count, counters, each watched 1D parameter's reference value and drift
        window (keyed by parameter name). Save it with the checkpoint (``torch.save``);
        under FSDP each rank saves its own (references are rank-local shards)."""
        return {
            "format": STATE_FORMAT,
            "run": self.run,
            "step": self.step,
            "signals": self._running.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output: step numbering, counters and drift
        references carry on. Call it after ``attach`` (before or after the optimizer's
        own ``load_state_dict``). Parameters are matched by name; what no longer matches
        (renamed, reshaped) starts afresh."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                "load_state_dict needs the dict Monitor.state_dict() returned "
                f"(format {STATE_FORMAT}); got {type(state).__name__}"
                + (f" with format {state.get('format')!r}" if isinstance(state, dict) else "")
            )
        if not isinstance(state.get("step"), int) or not isinstance(state.get("signals"), dict):
            raise ValueError(
                "load_state_dict: the state has no 'step' and 'signals'; pass what Monitor.state_dict() returned"
            )
        self.step = state["step"]
        self._saved_signals = dict(state["signals"])
        for s in self.signals:
            self._running.restore(s, self._saved_signals)

    @property
    def _latest(self) -> PendingReport | None:
        """The latest report made (:attr:`StepLifecycle.latest`)."""
        return self._steps.latest

    def latest(self) -> list[dict[str, Any]]:
        """The most recent report's samples: dicts with ``name``, ``labels``, ``value``
        (the caller's own copies: the signals share their label dicts across reports)."""
        if not self._latest:
            return []
        return [{**s, "labels": dict(s["labels"])} for s in self._latest.materialize()["samples"]]

    def latest_events(self) -> list[dict[str, Any]]:
        """The events carried by the most recent report (the caller's own copies)."""
        if not self._latest:
            return []
        return [{**e, "labels": dict(e["labels"])} for e in self._latest.materialize()["events"]]

    def _end_coverage(self) -> list[dict[str, Any]]:
        """The run_end report's coverage: the last report's as it was sent, with the
        device's verdicts applied (a step withheld as not cross-entropy stays inactive at
        the run's end, not active as the training thread first wrote it); with no report,
        what each signal would have covered. At close: a wait for the device is fine."""
        if self._latest:
            # The sender thread materializes reports (the loss figures are made there):
            # let it finish the last one rather than making it here.
            self._sender.wait_encoded(self.config.flush_timeout)
            coverage = self._latest.materialize().get("coverage")
            if coverage:
                return [dict(e) for e in coverage]
        return self._steps.last_coverage or self._coverage_entries()

    def latest_coverage(self) -> list[dict[str, Any]]:
        """The most recent report's coverage: per built-in signal, active or why not."""
        return list(self._latest.materialize().get("coverage", [])) if self._latest else []

    def value(self, name: str, **labels: str) -> float | None:
        """The latest value of one series (labels must match exactly), or None."""
        for s in self.latest():
            if s["name"] == name and s["labels"] == labels:
                value: float = s["value"]
                return value
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (bounded) until queued reports are delivered; False on timeout."""
        return self._sender.flush(self.config.flush_timeout if timeout is None else timeout)

    def close(self) -> None:
        """Remove every hook placed by ``attach`` and flush the sender (bounded wait)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        self._running.close()
        # Before the interpreter ends: the process group's threads let go of our tensors.
        distributed.settle()
        # A last, sample-free report tells the collector the run ended on purpose,
        # so RunSilent does not page for a job that simply finished. Its coverage is
        # the last report's (or, with no report, what each signal would have covered).
        if self.ends_run:
            end = StepContext(step=self.step, device=torch.device("cpu"))
            end.event(RUN_END_EVENT, f"Monitor.close() after {self.step} optimizer steps")
            try:
                end.coverage = self._end_coverage()
                end.coverage_settled = True  # judged with the figures of the report it comes from
                self._sender.put(packing.pack(end, run=self.run, rank=self.rank))
            except Exception as exc:  # noqa: BLE001
                self.warn_once("run_end", "could not queue the run_end report: %s", exc)
        left = self._sender.close(self.config.flush_timeout, quiet=True)

        if self.ends_run:
            try:
                log_summary(self, self._coverage_entries(), self._sender, left)
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                log.warning("trainvitals: could not summarize run %r: %s", self.run, exc)
        if self.ends_run:
            # The verdict after the summary: together, what was watched and what it showed.
            path = getattr(self._sender.sink, "path", None)
            self._observer.close(self.run, str(path) if path is not None else None)

    def headline(self) -> tuple[int, dict[str, float]] | None:
        """The latest report's step and headline figures (:mod:`trainvitals.hooks.headline`:
        a handful of series per signal, named as on ``/metrics``, and the alerts the job's
        rules see firing), for the trackers; None before the first report."""
        return self._observer.headline()

    def verdict(self) -> Any:
        """The in-job rules' verdict on this run so far (:class:`trainvitals.alerts.verdict.RunVerdict`),
        or None when no rules are evaluated in the job (a collector does)."""
        return self._observer.verdict(self.run)

    def start_line(self) -> str:
        """What the monitor watches, in words (``attach`` logs it)."""
        return start_line(self, self._coverage_entries(), self._sender)

    def _coverage_entries(self) -> list[dict[str, Any]]:
        """What each built-in signal would cover now (every running signal judged as
        emitting)."""
        return self._running.coverage_entries(self.coverage, {}, stepped=self.step > 0)[0]

    @property
    def dropped_reports(self) -> int:
        """Reports not delivered (queue full, refused, unreachable until close)."""
        return self._sender.dropped

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Monitor(run={self.run!r}, step={self.step}, every={self.config.every}, sink={self._sender.sink!r})"

    # -- internals -----------------------------------------------------------
    def _signal(self, cls: type[S]) -> S:
        found = self._running.find(cls)
        if found is not None:
            return found
        s = cls()
        self.signals.append(s)
        self._running.bind(s, self)
        self._running.restore(s, self._saved_signals)  # a state loaded before this signal started
        return s

    def _loss_signal(self) -> LossAccounting:
        return self._signal(LossAccounting)

    def _softmax_signal(self) -> Softmax:
        return self._signal(Softmax)


def _spill_for(sink: Sink, run: str) -> Sink | None:
    """A collector's reports that it never takes (unreachable until the queue overflows
    or the job ends) are kept in the run's local file, ``./trainvitals-<run>.jsonl``."""
    if not isinstance(sink, HttpSink):
        return None
    return FileSink(f"trainvitals-{run.replace('/', '_')}.jsonl")


_PLACED = SignalNames(lambda spec: spec.per_parameter_sums)
"""The signals whose figures sum per-parameter pieces over ranks (the registry's
``per_parameter_sums``)."""


def _default_signals(names: tuple[str, ...] | None) -> list[Signal]:
    builtin = builtin_signal_classes()
    return [cls() for name, cls in builtin.items() if names is None or name in names]
