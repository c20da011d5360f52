"""The lifecycle every signal follows, and what a signal may use of the monitor.

A signal places its hooks in ``bind``; the monitor calls ``before_step`` and
``after_step`` around every optimizer step (cheap bookkeeping only), and
``collect`` on report steps (with the step's gradient norms in ``ctx.grad_norms``
for a signal that ``uses_grad_norms``), where the signal computes its statistics as batched
tensor work and hands them to the :class:`~trainvitals.hooks.step.StepContext`.
Nothing here reads a tensor's value on the host: values reach the host once per
report, on the sender thread.

A signal that fails is turned off, one way for all: :meth:`Signal.turn_off` (log
once, drop buffers, skip it from then on). The monitor wraps every lifecycle call
in :meth:`Signal.run_guarded`; code a signal runs from a user call or a tensor hook
wraps itself in :meth:`Signal.guard`. Nothing reaches the training loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from trainvitals.hooks.step import StepContext
from trainvitals.wire.signals import SignalSpec

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from trainvitals.hooks.config import Config
    from trainvitals.hooks.coverage import CoverageTracker
    from trainvitals.hooks.grad_norms import GradNorms

__all__ = ["REBINDING", "MonitorView", "Removable", "Signal"]

REBINDING: contextvars.ContextVar[bool] = contextvars.ContextVar("trainvitals_rebinding", default=False)
"""True while a live settings change binds a signal again (its one-off start-up lines, the
weight-decay audit and "drift continues from the checkpoint", were said at attach)."""

log = logging.getLogger("trainvitals")


class Removable(Protocol):
    def remove(self) -> None: ...


class MonitorView(Protocol):
    """What a signal may use of the :class:`~trainvitals.hooks.job_monitor.Monitor`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: Config
    modalities: tuple[str, ...]
    scaler: Any
    device: torch.device
    step: int
    """Optimizer steps completed since attach (plus those restored by load_state_dict)."""
    rank: int
    world_size: int
    data_parallel_size: int
    """The ranks that see different data (the world less a Megatron tensor-parallel split)."""
    pipeline_stages: int
    """Megatron's pipeline-parallel size (1: none): only the last stage holds the loss."""
    sharded: bool
    """Some parameter is split across ranks: per-parameter sums are combined over ranks."""
    weighted: bool
    """Combined, and some parameter's per-rank sums count for less than 1 (replicated)."""
    coverage: CoverageTracker
    """Where signals declare their coverage state (:mod:`trainvitals.hooks.coverage`)."""

    @property
    def reporting_next(self) -> bool:
        """Whether the optimizer step now being accumulated will be reported."""
        ...

    def reports_at(self, step: int) -> bool: ...

    def name_of(self, p: torch.Tensor, fallback: str = "") -> str: ...

    def grad_layout_problem(self, params: list[torch.Tensor]) -> str | None:
        """A gradient placed otherwise than its DTensor parameter, named; or None."""
        ...

    def weight_of(self, p: torch.Tensor) -> float:
        """What this rank's partial sums of ``p`` count for in the sum over ranks."""
        ...

    def numel_of(self, p: torch.Tensor) -> int:
        """The element count of the whole of ``p`` (all its shards)."""
        ...

    def job_grad_norms(self, norms: GradNorms) -> GradNorms:
        """The step's gradient norms over every parameter the signals watch (a pipeline
        stage's laid out job-wide; else ``norms``)."""
        ...

    def groups(self) -> list[tuple[str, dict[str, Any]]]: ...

    def event(self, kind: str, detail: str = "", labels: dict[str, str] | None = None) -> None: ...

    def warn_once(self, key: str, message: str, *args: Any) -> bool: ...


class Signal:
    """Base class: override what you need. Handles returned by ``bind`` are removed
    on ``Monitor.close()``."""

    broken: bool = False
    """Set by :meth:`turn_off`: the signal failed and is skipped from then on."""
    failure: str = ""
    """Why :meth:`turn_off` turned it off (where, and the error), for the coverage detail."""
    covers: str | None = None
    """The signal name its coverage entry has (:mod:`trainvitals.hooks.coverage`): its
    spec's name, set by :func:`~trainvitals.hooks.signals.registry.register`."""
    spec: ClassVar[SignalSpec | None] = None
    """Its declaration (:class:`~trainvitals.wire.signals.SignalSpec`). A built-in one's
    is also written into ``wire/builtin_signals.py`` (``python -m
    trainvitals.hooks.signals.catalogue --write``), for the collector."""
    _failed_later: tuple[str, BaseException] | None = None
    """A failure off the training thread (:meth:`fail_later`), not yet acted on."""
    _collecting = False  # inside run_guarded("collect"): a failure turns the signal off at once
    uses_grad_norms: bool = False
    """True: its ``collect`` reads ``ctx.grad_norms``, the step's gradient norms
    (:mod:`trainvitals.hooks.grad_norms`), which are then taken before the step."""

    def bind(self, monitor: MonitorView) -> list[Removable]:
        """Place hooks; return their handles (anything with ``remove()``)."""
        return []

    def before_step(self, monitor: MonitorView, reporting: bool) -> None:
        """Called before ``optimizer.step()``; gradients are final here."""

    def after_step(self, monitor: MonitorView, reporting: bool) -> None:
        """Called after ``optimizer.step()``."""

    def settings_changed(self, monitor: MonitorView, old: Config, new: Config) -> None:
        """Between steps, after live settings replaced ``monitor.config`` (``old`` by
        ``new``): adjust what the settings shape. Nothing by default."""

    def measured_grad_norms(self) -> GradNorms | None:
        """The step's gradient norms when this signal measured them already (asked before
        ``optimizer.step()`` of a report step, after ``before_step``); None: not measured."""
        return None

    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        """On report steps, after ``after_step``: emit this step's statistics."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to keep measuring from the same references (counters,
        references, windows); plain Python values and CPU tensors. Empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (what no longer matches is skipped)."""

    def reset(self) -> None:
        """Drop what the current step accumulated (the signal is being turned off)."""

    def close(self) -> None:
        """Release buffers."""
        self.reset()

    # -- failure handling: one way for every signal ----------------------------
    def collectives_in_step(self) -> bool:
        """Whether the signal issues collectives of its own during the step (in the
        backward's hooks), which the other ranks issue too: then a failure on one rank
        must not stop its share of them mid-step (:meth:`turn_off`)."""
        return False

    def turn_off(self, where: str, exc: BaseException, *, agreed: bool = False) -> None:
        """Mark the signal broken, drop its buffers, log once. A signal whose hooks issue
        collectives (:meth:`collectives_in_step`) is turned off at its next ``collect``
        only, where the report's header tells every rank and all turn it off together:
        until then it keeps issuing its share of the collectives, so no rank waits for
        it in one (a hang). ``agreed``: every rank turns it off at this point (the
        report's header said so), at once."""
        if self.broken:
            return
        if not (agreed or self._collecting) and self.collectives_in_step():
            self.fail_later(where, exc)
            return
        self.broken = True
        self.failure = f"{type(self).__name__} failed in {where}: {type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            self.reset()
        log.warning(
            "trainvitals: signal %s failed in %s and is turned off: %s: %s",
            type(self).__name__,
            where,
            type(exc).__name__,
            exc,
        )

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a block; a failure turns the signal off instead of propagating."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self.turn_off(where, exc)

    def fail_later(self, where: str, exc: BaseException) -> None:
        """A failure on another thread (the sender thread, running what the signal handed
        it with ``ctx.on_host``): the signal is turned off at its next guarded call on the
        training thread, where :meth:`turn_off`'s reset cannot race the step."""
        if self._failed_later is None:
            self._failed_later = (where, exc)

    def run_guarded(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` unless the signal is broken; a failure turns it off (returns None)."""
        collecting = where == "collect"
        self._collecting = collecting
        try:
            if self._failed_later is not None:
                self.turn_off(*self._failed_later)
            if self.broken:
                return None
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001
                self.turn_off(where, exc)
                return None
        finally:
            if collecting:
                self._collecting = False
