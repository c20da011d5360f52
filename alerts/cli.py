"""``trainvitals rules``: check rule files, export them for Prometheus.

The main CLI adds this group: ``main.add_command(trainvitals.alerts.cli.rules)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trainvitals.alerts.export import export_prometheus
from trainvitals.alerts.loading import RuleError, resolve_rules
from trainvitals.alerts.model import EventRule, Rule, SilenceRule, ThresholdRule

__all__ = ["describe_rule", "rules"]


def _fmt_seconds(s: float) -> str:
    return f"{s / 60:g}m" if s >= 60 and s % 60 == 0 else f"{s:g}s"


def describe_rule(rule: Rule) -> str:
    """One line saying what the rule does, for ``rules check``."""
    if isinstance(rule, ThresholdRule):
        sel = rule.metric
        if rule.labels:
            sel += "{" + ", ".join(m.promql() for m in rule.labels) + "}"
        if rule.transform == "increase":
            sel = f"increase({sel})"
        elif rule.transform == "ratio_to_median":
            sel = f"{sel} / median(last {rule.window})"
            if rule.history_needed != rule.window:
                sel += f" (judged from {rule.history_needed} reports)"
        op = ">" if rule.above is not None else "<"
        text = f"{sel} {op} {rule.threshold:g}"
        if rule.clear is not None and rule.clear != rule.threshold:
            text += f" (clear at {rule.clear:g})"
        for cond in rule.and_:
            cop, thr = (">", cond.above) if cond.above is not None else ("<", cond.below)
            text += f" and {cond.metric} {cop} {thr:g}"
        waits = []
        if rule.for_steps:
            waits.append(f"{rule.for_steps} steps")
        if rule.for_:
            waits.append(_fmt_seconds(rule.for_))
        if waits:
            text += " for " + " and ".join(waits)
        holds = [f"{rule.hold_steps} steps"] if rule.hold_steps else []
        holds += [_fmt_seconds(rule.hold)] if rule.hold else []
        if holds:
            text += ", held " + " and ".join(holds)
        return text
    if isinstance(rule, EventRule):
        holds = [f"{rule.hold_steps} steps"] if rule.hold_steps else []
        holds += [_fmt_seconds(rule.hold)] if rule.hold else []
        return f"event {rule.event}" + (", held " + " and ".join(holds) if holds else "")
    assert isinstance(rule, SilenceRule)
    return f"no report for {_fmt_seconds(rule.silent_for)}"


@click.group("rules")
def rules() -> None:
    """Check alert rule files and export them for Prometheus."""


@rules.command("check")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=True, path_type=Path))
def check(files: tuple[Path, ...]) -> None:
    """Validate rule FILES (default: the shipped rules) and list their rules.

    Exits 1 with the file, rule and field of the first error.
    """
    sources: list[str | Path] = list(files) or ["default"]
    try:
        loaded = resolve_rules(sources)
    except RuleError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    width = max((len(r.alert) for r in loaded), default=0)
    for rule in loaded:
        click.echo(f"{rule.alert:<{width}}  {rule.severity:<8}  {describe_rule(rule)}")
    where = ", ".join(str(f) for f in files) if files else "the default rules"
    click.echo(f"{len(loaded)} rule{'s' if len(loaded) != 1 else ''} OK in {where}")


@rules.command("export")
@click.option(
    "--format", "fmt", type=click.Choice(["prometheus"]), default="prometheus", show_default=True, help="Output format."
)
@click.option(
    "--rules",
    "sources",
    multiple=True,
    default=("default",),
    show_default=True,
    help="Rule file or folder ('default': the shipped rules); repeatable.",
)
@click.option(
    "--step-seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Seconds per optimizer step, to turn for_steps/hold_steps into durations.",
)
@click.option(
    "--report-every",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Optimizer steps between reports (the hooks' `every`), for spike windows.",
)
@click.option("--increase-window", default="5m", show_default=True, help="Range for increase() of counters and events.")
@click.option("--runbook-base-url", default=None, help="Prefix for relative runbook links.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write to this file instead of stdout.",
)
def export(
    fmt: str,
    sources: tuple[str, ...],
    step_seconds: float,
    report_every: int,
    increase_window: str,
    runbook_base_url: str | None,
    output: Path | None,
) -> None:
    """Export rules as a Prometheus rule file (check it with `promtool check rules`)."""
    try:
        loaded = resolve_rules(list(sources))
        text = export_prometheus(
            loaded,
            step_seconds=step_seconds,
            report_every=report_every,
            increase_window=increase_window,
            runbook_base_url=runbook_base_url,
            sources=", ".join(sources) if sources != ("default",) else "the default rules",
        )
    except (RuleError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        click.echo(f"wrote {len(loaded)} rules to {output}", err=True)
