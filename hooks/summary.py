"""What the monitor says in the job's own log: the start line at attach and the one
summary line at close (what was reported, what never engaged and why, what was not
delivered and where it was going)."""

from __future__ import annotations

import logging
import sys
from typing import Any, Protocol

import torch
from torch import nn

from trainvitals.hooks.config import Config
from trainvitals.hooks.coverage import CoverageTracker
from trainvitals.hooks.sender import Sender
from trainvitals.wire.coverage import NOT_BLIND

__all__ = ["Watched", "log_summary", "start_line", "visible_logs"]

log = logging.getLogger("trainvitals")


def visible_logs() -> None:
    """The job did not configure logging: show trainvitals' own lines (what is watched,
    alerts firing and resolving, the summary and verdict at close) on stderr. A job that configures logging gets them
    its way."""
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class Watched(Protocol):
    """What the log lines say of a monitor."""

    run: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: Config
    coverage: CoverageTracker
    step: int


def start_line(monitor: Watched, entries: list[dict[str, Any]], sender: Sender) -> str:
    """What the monitor watches, in words (``attach`` logs it); ``entries``: the
    coverage each signal would have now."""
    optimizer = getattr(monitor.optimizer, "watched_from", monitor.optimizer)  # a pipeline job's view: its own
    return (
        f"run {monitor.run!r}, {type(optimizer).__name__} on {type(monitor.model).__name__}: "
        f"{monitor.coverage.describe(entries)}; reports every {monitor.config.every} "
        f"optimizer steps to {sender.sink!r}"
    )


def log_summary(monitor: Watched, entries: list[dict[str, Any]], sender: Sender, left: int) -> None:
    """One line at close: what was reported, what never engaged and why, what was not
    delivered and where it was going (``entries``: the coverage each signal would have
    now; ``left``: reports still queued at close)."""
    reported, never = monitor.coverage.summary()
    sink = sender.sink
    dropped = sender.dropped
    parts = [f"run {monitor.run!r} closed after {monitor.step} optimizer step(s)"]
    if reported:
        parts.append("reported: " + ", ".join(f"{s} ({n} report(s))" for s, n in reported.items()))
    elif monitor.step == 0:
        would = [e["signal"] for e in entries if e.get("reason") == "no_optimizer_step"]
        also = f" (would have watched {', '.join(would)})" if would else ""
        parts.append("NOTHING was watched: no optimizer step ran" + also)
        never = {e["signal"]: (e["reason"], e["detail"]) for e in entries if e.get("reason") != "no_optimizer_step"}
    else:
        parts.append("NOTHING was watched")
    blind = {s: v for s, v in never.items() if v[0] not in NOT_BLIND}
    if blind:
        parts.append(
            "never engaged: " + "; ".join(f"{s} ({r}: {d})" if d else f"{s} ({r})" for s, (r, d) in blind.items())
        )
    moot = {s: v for s, v in never.items() if v[0] in NOT_BLIND and v[0] != "not_requested"}
    if moot:
        parts.append("does not apply: " + "; ".join(f"{s} ({d})" for s, (_, d) in moot.items()))
    skipped = [s for s, v in never.items() if v[0] == "not_requested"]
    if skipped:
        parts.append("not requested: " + ", ".join(skipped))
    delivery = f"{sender.sent} report(s) delivered to {sink!r}, {dropped} not delivered"
    problem = getattr(sink, "problem", None)
    if dropped and problem:
        delivery += f" ({problem})"
    elif left:
        delivery += f" ({left} still queued at close)"
    parts.append(delivery)
    level = logging.WARNING if (dropped or blind or not reported) else logging.INFO
    log.log(level, "trainvitals: %s", "; ".join(parts))
