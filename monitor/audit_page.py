"""The audit on the report page (:mod:`trainvitals.monitor.report_page`): the findings
as the verdict's incidents, the checkpoints as its reports, and the per-checkpoint
figures (``param_drift_log2``, ``adam_eps_dominated_ratio``) as the plotted series,
with the default rules' thresholds drawn."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainvitals.alerts.loading import resolve_rules
from trainvitals.alerts.verdict import Incident, RunVerdict
from trainvitals.audit.analysis import Audit
from trainvitals.monitor.report_page import RunHistory, render_page


class _Findings:
    """What :func:`render_page` reads of a verdict builder."""

    def __init__(self, verdict: RunVerdict) -> None:
        self.rules = resolve_rules("default")
        self._verdict = verdict

    def verdicts(self) -> list[RunVerdict]:
        return [self._verdict]


def _step(lk: Any) -> int:
    return int(lk.step if lk.step is not None else lk.index + 1)


def render_audit(result: Audit, run: str | None = None) -> str:
    """The page; ``run``: the section's name (default: ``audit of`` the checkpoints' folder)."""
    run = run or f"audit of {Path(result.looks[0].path).parent.name or result.looks[0].path}"
    looks = result.looks
    # Each checkpoint is one of the page's "reports"; what was read is the page's "watched".
    verdict = RunVerdict(run, reports=len(looks), first_step=_step(looks[0]), last_step=_step(looks[-1]), ended=True)
    with_opt = sum(1 for lk in looks if lk.has_optimizer)
    verdict.signals = {
        "params": {"active": len(looks), "reports": len(looks), "reason": None, "detail": None},
        "adam": {
            "active": with_opt,
            "reports": len(looks),
            "reason": None if with_opt else "no_optimizer_state",
            "detail": None if with_opt else "no optimizer state in the checkpoints",
        },
    }
    for f in result.findings:
        verdict.incidents.append(
            Incident(
                run=run,
                alert=f.alert,
                severity=f.severity,
                labels={"param": f.subject} if f.subject else {},
                first_step=_step(looks[0]),
                last_step=_step(looks[-1]),
                peak=f.value if f.value is not None else math.nan,
                summary=f"{f.where}: {f.summary}",
                action=f.action,
                runbook=f.runbook,
                metric=f.metric,
            )
        )
    history = RunHistory()
    for lk in looks:
        samples = []
        for name, e in result.one_d.items():
            walk = e.get("walk") or []
            if lk.index < len(walk) and walk[lk.index] is not None:
                samples.append(SimpleNamespace(name="param_drift_log2", labels={"param": name}, value=walk[lk.index]))
        for name, a in lk.adam.items():
            if a.eps_ratio is not None:
                samples.append(
                    SimpleNamespace(name="adam_eps_dominated_ratio", labels={"param": name}, value=a.eps_ratio)
                )
        history.add(SimpleNamespace(run=run, step=_step(lk), rank=0, samples=samples))
    title = f"audit of {len(looks)} checkpoint(s): " + ", ".join(lk.label for lk in looks[:4])
    builder: Any = _Findings(verdict)  # what render_page reads of a VerdictBuilder
    return render_page(builder, history, title=title + (" ..." if len(looks) > 4 else ""))
