"""Coverage on the training side: what each built-in signal covers, said in every report.

Every report carries one entry per registered signal (:data:`trainvitals.wire.coverage.SIGNALS`):
active, or inactive with a reason from :data:`trainvitals.wire.coverage.REASONS`. A
monitor has one :class:`CoverageTracker` (``monitor.coverage``); this is how signals (and
code that sets them up, such as zero-code attach) declare their state::

    cov = monitor.coverage
    cov.set_inactive("loss", "no_lm_head", "no get_output_embeddings() and no linear layer sized like the vocabulary")
    cov.set_inactive("loss", "head_bypassed", "no gradient reached 'lm_head' for 3 report steps")
    cov.set_active("loss")  # back to judging by the figures
    cov.clear("loss")  # forget what was declared

A declared state lasts until it is changed. At each report the monitor writes each
signal's entry, first match wins:

1. the signal failed (``Signal.turn_off``): ``failed``;
2. a state declared with :meth:`CoverageTracker.set_inactive`: that one;
3. no optimizer step has run (the report ``Monitor.close()`` sends after 0 steps):
   ``no_optimizer_step``;
4. declared active with :meth:`CoverageTracker.set_active`: active;
5. the signal runs and emitted figures in this report: active; it runs and emitted
   none: ``no_input`` (also when every figure it emitted was withheld by its presence
   flags, judged as the report is materialized: :func:`without_figures`);
6. the signal does not run: ``not_requested`` (the detail says how to ask for it).

A verdict about one report goes on that report's context instead, from ``collect``:
``ctx.inactive_when("loss", None, "no_input", detail)`` (between 2 and 3 above), or,
when only the device knows (a flag tensor, read without a host sync),
``ctx.inactive_when("loss", flag, "not_cross_entropy", detail)``: the entry is inactive
for that report when ``flag > 0`` (unless 1 or 2 holds). The first verdict wins.

:meth:`CoverageTracker.note` and :meth:`CoverageTracker.settle` tally what the reports said, for
the summary ``Monitor.close()`` logs (a report the device's verdicts never reached the
host for, still queued at close, counts as the training thread made it). No tensor work here; thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from trainvitals.wire.coverage import MAX_COVERAGE_DETAIL, NOT_BLIND, REASONS, SIGNALS
from trainvitals.wire.signals import spec_of

__all__ = ["CoverageTracker", "withhold", "without_figures"]


def _how_to_ask(name: str) -> str:
    spec = spec_of(name)
    return spec.how_to_ask if spec is not None else "not registered"


def _first_call(name: str) -> str | None:
    """The job's own call that starts a signal: at attach it is not requested *yet*."""
    spec = spec_of(name)
    return spec.first_call if spec is not None else None


class CoverageTracker:
    """Per registered signal: declared states, and the tally of what the reports said.
    (Named apart from the wire's :class:`trainvitals.wire.schema.Coverage`, one entry.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._declared: dict[str, tuple[bool, str | None, str]] = {}
        self._active_reports: dict[str, int] = dict.fromkeys(SIGNALS, 0)
        self._last: dict[str, tuple[str | None, str]] = {}
        self._reports = 0

    # -- what signals call -----------------------------------------------------
    def set_active(self, signal: str) -> None:
        """``signal`` produces figures (overrides the judgement by emitted samples)."""
        _check(signal)
        with self._lock:
            self._declared[signal] = (True, None, "")

    def set_inactive(self, signal: str, reason: str, detail: str = "") -> None:
        """``signal`` cannot produce figures, for ``reason`` (one of the wire's
        :data:`~trainvitals.wire.coverage.REASONS`); ``detail`` says it in words
        (shortened to the wire's limit)."""
        _check(signal)
        if reason not in REASONS:
            raise ValueError(f"coverage reason {reason!r} is not one of {', '.join(REASONS)}")
        with self._lock:
            self._declared[signal] = (False, reason, _short(detail))

    def clear(self, signal: str) -> None:
        """Forget what was declared for ``signal``: judged by its figures again."""
        with self._lock:
            self._declared.pop(signal, None)

    def declared(self, signal: str) -> tuple[bool, str | None, str] | None:
        """``(active, reason, detail)`` as last declared, or None."""
        with self._lock:
            return self._declared.get(signal)

    # -- what the monitor calls --------------------------------------------------
    def entries(
        self,
        running: Mapping[str, tuple[bool, bool, str]],
        *,
        stepped: bool,
        verdicts: Mapping[str, tuple[str, str]] | None = None,
    ) -> tuple[list[dict[str, Any]], set[str]]:
        """One wire entry per signal for a report, and the signals whose entry is final
        (failed, or declared inactive: a report's own verdicts do not change it).
        ``running``: for each signal that runs, ``(emitted, failed, failure)``: it emitted
        samples in this report; it was turned off, and why. ``stepped``: an optimizer step
        has run. ``verdicts``: this report's ``(reason, detail)`` per signal
        (``StepContext.inactive_when`` without a flag), between the declared states and
        the judgement by figures."""
        out = []
        final: set[str] = set()
        verdicts = verdicts or {}
        with self._lock:
            declared = dict(self._declared)
        for name in SIGNALS:
            state = running.get(name)
            said = declared.get(name)
            if state is not None and state[1]:
                out.append(_entry(name, False, "failed", state[2]))
                final.add(name)
            elif said is not None and not said[0]:
                out.append(_entry(name, False, said[1], said[2]))
                final.add(name)
            elif name in verdicts:
                out.append(_entry(name, False, *verdicts[name]))
            elif not stepped and (state is not None or said is not None):
                out.append(_entry(name, False, "no_optimizer_step", "no optimizer step has run since attach"))
            elif said is not None:
                out.append(_entry(name, True))
            elif state is not None:
                if state[0]:
                    out.append(_entry(name, True))
                else:
                    out.append(_entry(name, False, "no_input", "it emitted nothing for this report"))
            else:
                out.append(_entry(name, False, "not_requested", _how_to_ask(name)))
        return out, final

    def note(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """Tally one report's entries as the training thread made them."""
        with self._lock:
            self._reports += 1
            for e in entries:
                if e["active"]:
                    self._active_reports[e["signal"]] = self._active_reports.get(e["signal"], 0) + 1
                else:
                    self._last[e["signal"]] = (e["reason"], e["detail"])

    def settle(self, made: Iterable[Mapping[str, Any]], final: Iterable[Mapping[str, Any]]) -> None:
        """A report's entries after the device's verdicts (sender thread): an entry
        :meth:`note` counted active that a flag turned inactive is taken back."""
        was = {e["signal"]: e["active"] for e in made}
        with self._lock:
            for e in final:
                if not e["active"] and was.get(e["signal"]):
                    self._active_reports[e["signal"]] = self._active_reports.get(e["signal"], 0) - 1
                    self._last[e["signal"]] = (e["reason"], e["detail"])

    def summary(self) -> tuple[dict[str, int], dict[str, tuple[str | None, str]]]:
        """``(reported, never)``: signals active in at least one report with how many;
        signals active in none with the last reason and detail the reports gave."""
        with self._lock:
            reported = {s: n for s, n in self._active_reports.items() if n}
            never = {s: self._last.get(s, ("no_optimizer_step", "no report was made")) for s in SIGNALS}
            return reported, {s: v for s, v in never.items() if s not in reported}

    def describe(self, entries: Iterable[Mapping[str, Any]]) -> str:
        """Entries in words: ``watching optimizer, params; not watching: loss (no_lm_head: ...)``."""
        entries = list(entries)
        on = [e["signal"] for e in entries if e["active"]]
        off = [e for e in entries if not e["active"]]
        expected = [e for e in off if e["reason"] not in NOT_BLIND and e["reason"] != "no_optimizer_step"]
        pending = [e["signal"] for e in off if e["reason"] == "no_optimizer_step"]
        parts = []
        if on or pending:
            later = " (from the first optimizer step)" if pending else ""
            parts.append("watching " + ", ".join(on + pending) + later)
        else:
            parts.append("NOTHING is watched")
        if expected:
            parts.append("blind: " + "; ".join(f"{e['signal']} ({e['reason']}: {e['detail']})" for e in expected))
        moot = [f"{e['signal']} ({e['detail']})" for e in off if e["reason"] in NOT_BLIND - {"not_requested"}]
        if moot:
            parts.append("does not apply: " + "; ".join(moot))
        skipped = [e["signal"] for e in off if e["reason"] == "not_requested"]
        first_call = [f"{name} (from the first {_first_call(name)} call)" for name in skipped if _first_call(name)]
        if first_call:
            parts.append("not requested yet: " + ", ".join(first_call))
        unasked = [name for name in skipped if not _first_call(name)]
        if unasked:
            parts.append("not requested: " + ", ".join(unasked))
        return "; ".join(parts)


def _entry(signal: str, active: bool, reason: str | None = None, detail: str = "") -> dict[str, Any]:
    if active:
        return {"signal": signal, "active": True}
    return {"signal": signal, "active": False, "reason": reason, "detail": _short(detail)}


def _short(text: str) -> str:
    text = str(text)
    return text if len(text) <= MAX_COVERAGE_DETAIL else text[: MAX_COVERAGE_DETAIL - 3] + "..."


def _check(signal: str) -> None:
    if signal not in SIGNALS:
        raise ValueError(f"coverage: {signal!r} is not a built-in signal ({', '.join(SIGNALS)})")


_GROUP_OF: dict[str, str] | None = None


def without_figures(coverage: list[dict[str, Any]], samples: Iterable[Mapping[str, Any]]) -> None:
    """Never active without a figure: an entry still active whose signal carries no
    sample in the report as sent (every figure it emitted was withheld by its presence
    flags, decided on the host) turns inactive, ``withheld``, in place: unlike ``no_input``
    (nothing reached it, as between two ``observe_logits`` calls), a signal withheld
    report after report is blind, and ``SignalInactive`` says so. A signal's
    samples are known by their metric's group (:mod:`trainvitals.wire.metrics`)."""
    global _GROUP_OF
    if _GROUP_OF is None:
        from trainvitals.wire.metrics import METRICS

        _GROUP_OF = {m.name: m.group for m in METRICS.values() if m.owner == "hooks"}
    groups = set(_GROUP_OF.values())
    present = {_GROUP_OF.get(s["name"]) for s in samples}
    for e in coverage:
        if e.get("active") and e["signal"] in groups and e["signal"] not in present:
            e.update(active=False, reason="withheld", detail="its figures were all withheld in this report")


def withhold(coverage: list[dict[str, Any]], final: set[str], signal: str, reason: str, detail: str) -> None:
    """``signal``'s figures of this report were withheld (the ranks disagreed): its
    entry turns inactive for ``reason``, in place, unless it is final already."""
    if signal in final:
        return
    for e in coverage:
        if e["signal"] == signal:
            e.clear()
            e.update(_entry(signal, False, reason, detail))
