"""The ``Monitor`` that ``attach()`` returns: the user API, and what signals use of it.

Its hooks on the optimizer step, from a step's start to its report, are
:mod:`trainvitals.hooks.lifecycle` (which names the stages of a report, each its own
module); what it says in the job's log at attach and close is
:mod:`trainvitals.hooks.summary`.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

import torch
from torch import nn

from trainvitals.hooks import distributed
from trainvitals.hooks import pack as packing
from trainvitals.hooks.config import Config
from trainvitals.hooks.coverage import Coverage
from trainvitals.hooks.lifecycle import StepLifecycle
from trainvitals.hooks.live_settings import LiveSettings
from trainvitals.hooks.logits_finder import AUTO, find_head, find_logits_module
from trainvitals.hooks.naming import clean_name, unwrap
from trainvitals.hooks.pack import PendingReport
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.signals.base import Removable, Signal
from trainvitals.hooks.sinks import Sink
from trainvitals.hooks.step import StepContext
from trainvitals.hooks.summary import log_summary, start_line, visible_logs
from trainvitals.hooks.tensors import is_dtensor, is_sharded, rank_weight
from trainvitals.wire.schema import RUN_END_EVENT

__all__ = ["STATE_FORMAT", "Monitor", "builtin_signal_classes", "monitor_of", "visible_logs"]

STATE_FORMAT = 1
"""Version of ``Monitor.state_dict()``'s layout."""

log = logging.getLogger("trainvitals")

# optimizer -> its monitor, both weakly (a monitor holds its optimizer: a strong value
# would keep the key alive forever).
_BY_OPTIMIZER: weakref.WeakKeyDictionary[Any, weakref.ref[Monitor]] = weakref.WeakKeyDictionary()


def monitor_of(optimizer: Any) -> Monitor | None:
    """The open monitor watching ``optimizer``, or None."""
    ref = _BY_OPTIMIZER.get(optimizer)
    found = ref() if ref is not None else None
    return None if found is None or found._closed else found


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
        self.param_names: dict[int, str] = {id(p): clean_name(n) for n, p in self.model.named_parameters()}
        first = next(iter(self.model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.sharded = any(is_sharded(p) for p in self.model.parameters())
        self.coverage = Coverage()
        """What each built-in signal covers; signals declare their state here."""
        self._weights: dict[int, float] = {}
        self._grad_checked: tuple[tuple[int, ...], str | None] | None = None
        self.layout_problem = self._placements()
        """A parameter layout whose per-rank sums cannot be combined (named), or None."""
        self.weighted = self.sharded and any(w != 1.0 for w in self._weights.values())
        """Some parameter's per-rank sums count for less than 1 (:meth:`weight_of`)."""
        self._last_coverage: list[dict[str, Any]] | None = None
        # Zero-code loss accounting: its module is found first, so a wrong name raises
        # before anything is hooked or started.
        logits_module = None
        no_head = None
        self._loss_auto = config.loss_from_logits == AUTO
        if self._loss_auto:
            logits_module, *no_head = find_head(self.model)
        elif config.loss_from_logits:
            logits_module = find_logits_module(self.model, config.loss_from_logits)
        self._pending_events: list[tuple[str, str, dict[str, str]]] = []
        self._warned: set[str] = set()
        self._latest: PendingReport | None = None
        self._saved_signals: dict[str, Any] = {}
        self._closed = False
        self._end_report = True  # False: the run goes on in another monitor (trainvitals run)
        self.automatic = False
        """Attached by ``trainvitals run`` (the job's own ``attach`` may take over)."""
        evaluator = None
        if rules is not None:
            from trainvitals.alerts import LocalEvaluator

            evaluator = LocalEvaluator(rules=rules)
        # What is watched (start), what was reported and delivered (close) and alerts in
        # the job are said where the job can see them, even with logging unconfigured.
        visible_logs()
        self._evaluator = evaluator
        # The latest report's step, samples and firing alerts (set by the sender thread);
        # its headline figures are worked out when a tracker asks (most jobs have none),
        # and kept with the report they came from.
        self._headline_of: tuple[int, Any, list[str]] | None = None
        self._headline: tuple[tuple[int, Any, list[str]], tuple[int, dict[str, float]]] | None = None
        if evaluator is not None and hasattr(sink, "firing"):
            sink.firing = self._firing_names  # a tracker sink shows the alerts firing
        self._sender = Sender(
            sink, max_queue_bytes=config.queue_bytes, on_report=self._observe_report, spill=_spill_for(sink, run)
        )
        self.signals: list[Signal] = _default_signals(config.signals)
        if self.layout_problem is not None:  # withheld, said why: never a figure from a wrong sum
            for s in [s for s in self.signals if s.covers in _PLACED]:
                self.signals.remove(s)
                self.coverage.set_inactive(s.covers, "sharded", self.layout_problem)  # type: ignore[arg-type]
        self._steps = StepLifecycle(self)
        self._handles: list[Removable] = [optimizer.register_step_post_hook(self._steps.after_step)]
        if config.step_boundary == "pre_step_hook":
            self._handles.append(optimizer.register_step_pre_hook(self._steps.before_step))
        for s in self.signals:
            self._handles.extend(s.run_guarded("bind", s.bind, self) or [])
        if logits_module is not None:
            self._handles.extend(self._loss_signal().watch_logits(self, logits_module, auto=self._loss_auto))
        elif no_head is not None:  # "auto" found no head: watched without loss accounting, said why
            self.coverage.set_inactive("loss", *no_head)
        # Live settings arrive with the collector's answers (sender thread) and are
        # applied at the end of a step (training thread).
        self._live = LiveSettings(self)
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
        return not self._closed and self.reports_at(self.step + 1)

    def _placements(self) -> str | None:
        """Each parameter's :func:`rank_weight` (when any is a DTensor); the first layout
        that cannot be combined, as a sentence naming it."""
        named = list(self.model.named_parameters())
        listed = {id(p) for _, p in named}
        named += [
            (f"param_group {i} #{j}", p)
            for i, g in enumerate(self.optimizer.param_groups)
            for j, p in enumerate(g["params"])
            if id(p) not in listed
        ]
        if not any(is_dtensor(p) for _, p in named):
            return None
        for name, p in named:
            weight = rank_weight(p, self.world_size)
            if isinstance(weight, str):
                return f"{clean_name(name)}: {weight}; optimizer, parameter and Adam figures withheld"
            self._weights[id(p)] = weight
        return None

    def grad_layout_problem(self, params: list[torch.Tensor]) -> str | None:
        """A DTensor parameter among ``params`` whose gradient is placed otherwise than
        the parameter (SequenceParallel norms: ``Partial`` gradients of ``Replicate``
        weights, summed later): its norm cannot be had from the ranks' pieces. Named,
        or None; judged once per set of parameters (the placements follow the plan)."""
        if not self._weights:
            return None
        key = tuple(map(id, params))
        if self._grad_checked is None or self._grad_checked[0] != key:
            problem = None
            for p in params:
                grad = p.grad
                if grad is not None and is_dtensor(p) and tuple(getattr(grad, "placements", ())) != tuple(p.placements):  # type: ignore[attr-defined]
                    placed = tuple(getattr(grad, "placements", ()))
                    problem = (
                        f"{self.name_of(p, 'a parameter')}: gradient placed {placed} unlike the parameter "
                        f"{tuple(p.placements)}; gradient figures withheld"  # type: ignore[attr-defined]
                    )
                    break
            self._grad_checked = (key, problem)
        return self._grad_checked[1]

    def weight_of(self, p: torch.Tensor) -> float:
        """What this rank's partial sums of ``p`` count for in the sum over ranks (1: a
        piece no other rank holds; 1 / k: one of k copies). 1 when nothing is combined."""
        if not self.sharded:
            return 1.0
        weight = self._weights.get(id(p))
        if weight is None:  # a parameter added to the optimizer after attach
            found = rank_weight(p, self.world_size)
            if isinstance(found, str):  # cannot be combined: told, and counted as one piece
                self.warn_once(f"layout:{id(p)}", "%s: %s; its figures may be wrong", self.name_of(p), found)
                found = 1.0
            weight = self._weights[id(p)] = found
        return weight

    def name_of(self, p: torch.Tensor, fallback: str = "") -> str:
        return self.param_names.get(id(p), fallback)

    def groups(self) -> list[tuple[str, dict[str, Any]]]:
        """(label, param_group) for each optimizer param group; label is the group's
        ``name`` when set, else its index."""
        return [(str(g.get("name", i)), g) for i, g in enumerate(self.optimizer.param_groups)]

    def event(self, kind: str, detail: str = "", labels: dict[str, str] | None = None) -> None:
        """Queue a host-side event for the next report."""
        self._pending_events.append((kind, detail, dict(labels or {})))

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
        from trainvitals.hooks.signals.loss_accounting import LossAccounting

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
        if not self._closed:
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
            "signals": {type(s).__name__: s.state_dict() for s in self.signals if not s.broken},
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
            self._restore(s)

    def _restore(self, signal: Signal) -> None:
        saved = self._saved_signals.pop(type(signal).__name__, None)
        if saved:
            signal.run_guarded("load_state_dict", signal.load_state_dict, saved)

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
        return self._last_coverage or self._coverage_entries({})[0]

    def latest_coverage(self) -> list[dict[str, Any]]:
        """The most recent report's coverage: per built-in signal, active or why not."""
        return list(self._latest.materialize().get("coverage", [])) if self._latest else []

    def value(self, name: str, **labels: str) -> float | None:
        """The latest value of one series (labels must match exactly), or None."""
        for s in self.latest():
            if s["name"] == name and s["labels"] == labels:
                return s["value"]
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (bounded) until queued reports are delivered; False on timeout."""
        return self._sender.flush(self.config.flush_timeout if timeout is None else timeout)

    def close(self) -> None:
        """Remove every hook placed by ``attach`` and flush the sender (bounded wait)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001 - a handle that is already gone is fine
                pass
        self._handles.clear()
        for s in self.signals:
            s.run_guarded("close", s.close)
        # Before the interpreter ends: the process group's threads let go of our tensors.
        distributed.settle()
        # A last, sample-free report tells the collector the run ended on purpose,
        # so RunSilent does not page for a job that simply finished. Its coverage is
        # the last report's (or, with no report, what each signal would have covered).
        if self._end_report:
            end = StepContext(step=self.step, device=torch.device("cpu"))
            end.event(RUN_END_EVENT, f"Monitor.close() after {self.step} optimizer steps")
            try:
                end.coverage = self._end_coverage()
                self._sender.put(packing.pack(end, run=self.run, rank=self.rank))
            except Exception as exc:  # noqa: BLE001
                self.warn_once("run_end", "could not queue the run_end report: %s", exc)
        left = self._sender.close(self.config.flush_timeout, quiet=True)

        if self._end_report:
            try:
                log_summary(self, left)
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                log.warning("trainvitals: could not summarize run %r: %s", self.run, exc)
        if self._evaluator is not None and self._end_report:
            # The verdict after the summary: together, what was watched and what it showed.
            path = getattr(self._sender.sink, "path", None)
            self._evaluator.close(self.run, report_file=str(path) if path is not None else None)

    def headline(self) -> tuple[int, dict[str, float]] | None:
        """The latest report's step and headline figures (:mod:`trainvitals.hooks.headline`:
        a handful of series per signal, named as on ``/metrics``, and the alerts the job's
        rules see firing), for the trackers; None before the first report."""
        source = self._headline_of
        if source is None:
            return None
        kept = self._headline
        if kept is not None and kept[0] is source:
            return kept[1]
        from trainvitals.hooks.headline import headline_figures

        figures = (source[0], headline_figures(source[1], source[2]))
        self._headline = (source, figures)
        return figures

    def _firing_names(self) -> list[str]:
        return [a.alertname for a in self._evaluator.firing()] if self._evaluator is not None else []

    def verdict(self) -> Any:
        """The in-job rules' verdict on this run so far (:class:`trainvitals.alerts.verdict.RunVerdict`),
        or None when no rules are evaluated in the job (a collector does)."""
        return self._evaluator.verdict(self.run) if self._evaluator is not None else None

    def start_line(self) -> str:
        """What the monitor watches, in words (``attach`` logs it)."""
        return start_line(self)

    def _observe_report(self, report: Any) -> None:
        """Sender thread: the in-process rules, then the headline figures for the trackers."""
        if self._evaluator is not None:
            self._evaluator.observe(report)
        # The sender adds its drop counter to every report; a report with nothing else (the
        # run's end sent at close) has no figures and must not replace the last step's.
        if any(s.name != "client_dropped_reports_total" for s in report.samples):
            self._headline_of = (report.step, report.samples, self._firing_names())

    def _coverage_entries(
        self, emitted: dict[str, bool], verdicts: dict[str, tuple[str, str]] | None = None
    ) -> tuple[list[dict[str, Any]], set[str]]:
        """The coverage entries of a report (and the final ones): ``emitted`` says, per
        running signal, whether it emitted samples in this report (absent: judged as
        emitting, for previews); ``verdicts``: the report's own (``ctx.inactive_when``)."""
        running: dict[str, tuple[bool, bool, str]] = {}
        for s in self.signals:
            if s.covers is not None:
                running[s.covers] = (emitted.get(s.covers, True), s.broken, s.failure)
        return self.coverage.entries(running, stepped=self.step > 0, verdicts=verdicts)

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
    def _signal(self, cls: type[Signal]) -> Any:
        for s in self.signals:
            if isinstance(s, cls):
                return s
        s = cls()
        self.signals.append(s)
        self._handles.extend(s.run_guarded("bind", s.bind, self) or [])
        self._restore(s)  # a state loaded before this signal started
        return s

    def _loss_signal(self) -> Any:
        from trainvitals.hooks.signals.loss_accounting import LossAccounting

        return self._signal(LossAccounting)

    def _softmax_signal(self) -> Any:
        from trainvitals.hooks.signals.softmax import Softmax

        return self._signal(Softmax)


def _spill_for(sink: Sink, run: str) -> Sink | None:
    """A collector's reports that it never takes (unreachable until the queue overflows
    or the job ends) are kept in the run's local file, ``./trainvitals-<run>.jsonl``."""
    from trainvitals.hooks.sinks import FileSink, HttpSink

    if not isinstance(sink, HttpSink):
        return None
    return FileSink(f"trainvitals-{run.replace('/', '_')}.jsonl")


def builtin_signal_classes() -> dict[str, type[Signal]]:
    """The built-in signals by their ``signals=`` name, in the order they run."""
    from trainvitals.hooks.signals.adam_state import AdamState
    from trainvitals.hooks.signals.optimizer_stats import OptimizerStats
    from trainvitals.hooks.signals.packing.leak import PackingLeak
    from trainvitals.hooks.signals.param_health import ParamHealth

    return {"optimizer": OptimizerStats, "params": ParamHealth, "adam": AdamState, "packing": PackingLeak}


_PLACED = ("optimizer", "params", "adam")
"""The signals whose figures sum per-parameter pieces over ranks."""


def _default_signals(names: tuple[str, ...] | None) -> list[Signal]:
    builtin = builtin_signal_classes()
    return [cls() for name, cls in builtin.items() if names is None or name in names]
