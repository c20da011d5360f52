"""Coverage: which built-in signals a report's figures come from, and why the others are missing.

Every report carries one entry per registered signal (:data:`SIGNALS`, derived from
the registry in :mod:`trainvitals.wire.signals`): active (it
produced figures for this report), or inactive with a reason from the closed list
:data:`REASONS` and a free-text ``detail``. A report without figures from a signal
therefore still says whether that signal is healthy-and-quiet or blind, and why.

The collector exports the entries as ``trainvitals_signal_active{run, signal,
reason}`` (1 active, 0 inactive; active series carry no ``reason``), and the
default rule ``SignalInactive`` warns when a signal stays inactive for a reason
other than ``not_requested``. Shared by the hooks, the wire schema, the collector's
decoder and the alert engine; standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple, get_args

from trainvitals.wire.signals import SIGNALS as _SIGNALS

__all__ = [
    "ACTIVE_METRIC",
    "MAX_COVERAGE_DETAIL",
    "MAX_COVERAGE_ENTRIES",
    "NOT_APPLICABLE",
    "NOT_BLIND",
    "REASONS",
    "SIGNALS",
    "CoverageSample",
    "ReasonName",
    "SignalName",
    "coverage_problem",
    "coverage_samples",
]

ACTIVE_METRIC = "signal_active"
"""Wire name of the per-run, per-signal gauge the collector derives from coverage."""

SignalName = str
"""A registered signal's name (:data:`SIGNALS`); checked by :func:`coverage_problem`
against the registry, so a signal registered after import is known."""
ReasonName = Literal[
    "not_requested",
    "no_optimizer_step",
    "no_input",
    "no_lm_head",
    "head_bypassed",
    "logits_layout",
    "not_cross_entropy",
    "logits_overwritten",
    "objective_scaled",
    "sharded",
    "failed",
    "not_adam",
    "no_parameters",
    "not_packed",
    "withheld",
    "ranks_disagree",
]

SIGNALS = _SIGNALS
"""The signals coverage speaks for, in order: every :class:`~trainvitals.wire.signals.SignalSpec`
registered (each spec's ``covers`` says what it measures): built in, ``optimizer``,
``params``, ``adam``, ``loss``, ``probe``, ``softmax``. A live view of the registry."""

MAX_COVERAGE_ENTRIES = 64
"""Entries a report's coverage may carry at most (a bound for the decoders; the check
against the signals registered is :func:`coverage_problem`'s)."""

REASONS: Mapping[str, str] = {
    "not_requested": "the job did not ask for it (signals=, no track_loss/loss_from_logits, no observe_logits, "
    "probe_every off)",
    "no_optimizer_step": "no optimizer step has run yet",
    "no_input": "asked for, but nothing reached it since the previous report (no track_loss call, "
    "no forward of the LM head, no observe_logits call)",
    "no_lm_head": "zero-code loss accounting found no LM head in the model",
    "head_bypassed": "the LM head was found but no gradient reached its output for several report steps "
    "(a fused or chunked loss that never calls the head module)",
    "logits_layout": "the head's output has a layout the accounting does not understand",
    "not_cross_entropy": "the loss is not a plain cross-entropy: signed per-token weights (a policy gradient "
    "with advantages, a preference loss), or a logits gradient with label smoothing, distillation, "
    "soft-capping, a loss that overwrites the logits in place",
    "logits_overwritten": "the logits were overwritten in place between the forward and the backward (a fused "
    "cross-entropy that reuses their memory): their gradient cannot be read",
    "objective_scaled": "the objective scales its loss on purpose (TRL's luspo by the completion length, Dr. GRPO "
    "by a constant length), or its normalization is not known: its weight mass is not a normalization check",
    "sharded": "not supported with sharded parameters (FSDP, DTensor)",
    "failed": "it failed and was turned off (the job's log has the error)",
    "not_adam": "the optimizer keeps no Adam moments (exp_avg/exp_avg_sq)",
    "no_parameters": "nothing it watches is in the model or the optimizer (no 1D parameter, no gradient)",
    "not_packed": "no row of the reported step's micro-batch holds several samples: no packing to check",
    "withheld": "it ran and got input, but every figure it made for the report was withheld (undefined on "
    "the step, or not exact for the job's layout): blind while it lasts",
    "ranks_disagree": "data-parallel ranks disagreed on this report (their steps, report intervals or the partials "
    "they sent differ): its cross-rank figures are withheld, the ranks realigned for the next report",
}
"""Why a signal is inactive: the closed list (a reason is a label value on /metrics)."""
assert tuple(REASONS) == get_args(ReasonName), "REASONS and ReasonName list the same reasons"

NOT_BLIND: frozenset[str] = frozenset({"not_requested", "not_adam", "no_parameters", "objective_scaled", "not_packed"})
"""Reasons that say the signal does not apply to the job (nothing asked for, nothing to
watch): not a blind spot. The close summary and ``SignalInactive`` leave them out."""

NOT_APPLICABLE: frozenset[str] = frozenset({"not_packed"})
"""Reasons that say the job has nothing of the kind the signal checks (no packed rows
for the boundary-leak check): a verdict lists such a signal neither as checked nor as
not checked (the coverage entries, ``/metrics`` and the close summary still say it)."""

MAX_COVERAGE_DETAIL = 512
"""Characters of an entry's ``detail``."""


class CoverageSample(NamedTuple):
    """An entry as a sample of :data:`ACTIVE_METRIC` (what the store and the rules see)."""

    name: str
    labels: dict[str, str]
    value: float


def coverage_problem(entries: Iterable[Any]) -> str | None:
    """What is wrong with a report's coverage (entries with ``signal``, ``active``,
    ``reason``), as ``coverage.i.field: message``; None if nothing. Types and the closed
    lists are the schemas'; this checks what ties fields together. A signal given twice
    is not an error: the last entry counts, but more entries than signals are."""
    entries = list(entries)
    if len(entries) > len(SIGNALS):
        return f"coverage: at most {len(SIGNALS)} entries (one per signal), got {len(entries)}"
    for i, e in enumerate(entries):
        if e.signal not in SIGNALS:
            return f"coverage.{i}.signal: {e.signal!r} is not a signal, one of {', '.join(SIGNALS)}"
        if e.active and e.reason is not None:
            return f"coverage.{i}.reason: an active signal has no reason (got {e.reason!r})"
        if not e.active and e.reason is None:
            return f"coverage.{i}.reason: an inactive signal needs a reason, one of {', '.join(REASONS)}"
    return None


def coverage_samples(entries: Iterable[Any]) -> list[CoverageSample]:
    """The entries as samples of ``signal_active`` (labels ``signal``, and ``reason`` when
    inactive), one per signal (the last entry of a signal given twice)."""
    by_signal: dict[str, CoverageSample] = {}
    for e in entries:
        labels = {"signal": e.signal} if e.active else {"signal": e.signal, "reason": e.reason}
        by_signal[e.signal] = CoverageSample(ACTIVE_METRIC, labels, 1.0 if e.active else 0.0)
    return list(by_signal.values())
