"""``trainvitals check`` and ``trainvitals report``: local diagnosis, no collector.

``check FILE.jsonl ...`` runs the rules over recorded reports (every run in the
files) and prints the verdict (:mod:`trainvitals.alerts.verdict`) as a table;
``check -- COMMAND ...`` is the pre-flight check: the command runs under
``trainvitals run`` reporting every step, for ``--steps N`` optimizer steps or to
its end, then the same verdict and what was watched. Exit status: 1 when an alert
of severity ``--fail-on`` or worse fired (default ``warning``: a warning or a page;
``--fail-on page``: pages only), 0 when none did, 2 for a usage error or an
unreadable file (the message names the line), 3 when the pre-flight job failed or
reported nothing.

``report FILE.jsonl -o report.html`` writes the report page
(:mod:`trainvitals.monitor.report_page`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

__all__ = ["check", "report"]

EXIT_PAGE, EXIT_USAGE, EXIT_JOB = 1, 2, 3


class _UsageError(click.ClickException):
    """Exit status 2: the arguments or a file cannot be used."""

    exit_code = EXIT_USAGE


def _builder(rules: tuple[str, ...]) -> Any:
    from trainvitals.alerts.loading import RuleError
    from trainvitals.alerts.verdict import VerdictBuilder

    spec: Any = "default" if not rules or rules == ("default",) else [Path(r) for r in rules if r != "default"]
    if rules and "default" in rules and rules != ("default",):
        spec = ["default", *spec]
    try:
        return VerdictBuilder(spec)
    except (RuleError, OSError) as exc:
        raise _UsageError(f"--rules: {exc}") from None


def decode_line(line: bytes) -> list[Any]:
    """One JSONL line (a report, or a wire body) by the collector's decoder (msgspec:
    several times cheaper than the wire models); ValueError when it refuses it."""
    from trainvitals.monitor.decode import decode_batch
    from trainvitals.wire.report_files import line_as_body

    return list(decode_batch(line_as_body(line)).reports)


def _judge(files: list[Path], rules: tuple[str, ...]) -> tuple[list[Any], list[str]]:
    """The verdicts of every run in ``files``, each file judged on its own; a run name
    found in several files is kept apart, each verdict named ``RUN [FILE]``, and said
    in the notes returned."""
    from trainvitals.wire.report_files import ReportFileError, read_report_file

    per_file = []
    try:
        for path in files:
            builder = _builder(rules)
            for _, report in read_report_file(path, decode_line):
                builder.observe(report)
            per_file.append((path, builder.verdicts()))
    except ReportFileError as exc:
        raise _UsageError(str(exc)) from None
    seen: dict[str, list[Path]] = {}
    for path, verdicts in per_file:
        for v in verdicts:
            seen.setdefault(v.run, []).append(path)
    shared = {run: paths for run, paths in seen.items() if len(paths) > 1}
    out = []
    for path, verdicts in per_file:
        for v in verdicts:
            if v.run in shared:
                v.source = str(path)
            out.append(v)
    notes = [
        f"note: run {run!r} is in {len(paths)} files ({', '.join(map(str, paths))}): each is judged on its own, "
        "as RUN [FILE] (one file holds one run's reports: concatenate them to judge them as one)"
        for run, paths in shared.items()
    ]
    return out, notes


def _is_report_file(arg: str) -> bool:
    return arg.endswith((".jsonl", ".json"))


def _first_line_is_report(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            line = f.readline(1 << 20)
    except OSError:
        return False
    try:
        return bool(line.strip()) and bool(decode_line(line))
    except ValueError:
        return False


def _report_files(args: tuple[str, ...]) -> list[Path] | None:
    """The arguments as report files (named ``.jsonl``/``.json``, or files whose first
    line is a report), or None for a command to run; a file that is neither a report
    file nor a program is refused, saying so (``check notes.txt`` does not run it)."""
    if all(_is_report_file(a) for a in args):
        return [Path(a) for a in args]
    first = Path(args[0])
    if not first.is_file():
        return None  # a program on PATH (python, torchrun, ...)
    if all(Path(a).is_file() and _first_line_is_report(Path(a)) for a in args):
        return [Path(a) for a in args]
    if os.access(first, os.X_OK) and not _is_report_file(args[0]):
        return None  # ./train.sh
    bad = next(a for a in args if not (Path(a).is_file() and _first_line_is_report(Path(a))))
    hint = f"trainvitals check -- python {args[0]}" if args[0].endswith(".py") else "trainvitals check -- COMMAND ..."
    raise _UsageError(
        f"{bad}: not a trainvitals report file (its first line is not a report) and not a program to run; "
        f"pass report files (.jsonl), or a command: {hint}"
    )


def _exit_status(verdicts: list[Any], fail_on: str) -> int:
    """EXIT_PAGE when an alert of severity ``fail_on`` or worse fired, else 0."""
    levels = {"page": ("page",), "warning": ("page", "warning")}[fail_on]
    return EXIT_PAGE if any(i.severity in levels for v in verdicts for i in v.incidents) else 0


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--rules",
    "rules",
    multiple=True,
    metavar="PATH",
    help="Rule file or folder instead of the default rules ('default' adds them back); repeatable.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
@click.option(
    "--fail-on",
    type=click.Choice(["page", "warning"]),
    default="warning",
    show_default=True,
    help="Exit 1 when an alert of this severity or worse fired.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Pre-flight: stop the job cleanly after N optimizer steps.  [default: run it to its end]",
)
@click.option(
    "--every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Pre-flight: report every N optimizer steps.",
)
@click.option("--run", "run_name", default=None, metavar="NAME", help="Pre-flight: the run's name.")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="OPTION=VALUE",
    help="Pre-flight: any attach option, as for trainvitals run; repeatable.",
)
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED)
def check(
    rules: tuple[str, ...],
    as_json: bool,
    fail_on: str,
    steps: int | None,
    every: int,
    run_name: str | None,
    settings: tuple[str, ...],
    args: tuple[str, ...],
) -> None:
    """Judge recorded reports, or run a pre-flight check of a job, with the alert rules.

    \b
      trainvitals check trainvitals-myrun.jsonl           (recorded reports, offline)
      trainvitals check --steps 30 -- python train.py     (pre-flight: run it, judge it)

    Before a long job, run the pre-flight check on it: it runs the command under
    trainvitals run reporting every step (--every), stops it cleanly after --steps
    optimizer steps (or lets it finish), and prints each incident, what to do and
    what was watched. Exit status: 1 if an alert of severity --fail-on (default
    warning: a warning or a page) fired, 0 if none did, 2 for a usage error or an
    unreadable file, 3 if the pre-flight job failed or reported nothing.
    """
    files = _report_files(args)
    if files is not None:
        every_source = click.get_current_context().get_parameter_source("every")
        every_given = every_source is not None and every_source is not click.core.ParameterSource.DEFAULT
        if steps is not None or run_name is not None or settings or every_given:
            raise _UsageError("--steps, --every, --run and --set are for the pre-flight check (check -- COMMAND ...)")
        verdicts, notes = _judge(files, rules)
        if not verdicts:
            raise _UsageError(f"no report in {', '.join(args)}")
        for note in notes:
            click.echo(note, err=True)
        _print(verdicts, as_json, files=list(args))
        sys.exit(_exit_status(verdicts, fail_on))
    _preflight(rules, as_json, fail_on, steps, every, run_name, settings, args)


def _print(verdicts: list[Any], as_json: bool, *, files: list[str], job: dict[str, Any] | None = None) -> None:
    from trainvitals.alerts.verdict_text import format_verdict, verdict_table

    if as_json:
        out: dict[str, Any] = {"files": files, "runs": [v.as_dict() for v in verdicts]}
        if job is not None:
            out["job"] = job
        click.echo(json.dumps(out, indent=2))
        return
    if job is None:
        click.echo(verdict_table(verdicts))
        return
    for v in verdicts:
        for line in format_verdict(v, report_file=files[0] if files else None):
            click.echo(line)
        click.echo(f"what was watched in run {v.run}:")
        for line in v.coverage_lines():
            click.echo(line)


def _preflight(
    rules: tuple[str, ...],
    as_json: bool,
    fail_on: str,
    steps: int | None,
    every: int,
    run_name: str | None,
    settings: tuple[str, ...],
    command: tuple[str, ...],
) -> None:
    from trainvitals.monitor.cli_run import hook_config, job_environment

    config = hook_config()
    builder = _builder(rules)  # a bad --rules is refused before the job starts
    env = job_environment(run_name, None, every, None, settings, command)
    run = env[config.ATTACH_ENV["run"]]
    path = Path(f"trainvitals-check-{run.replace('/', '_')}.jsonl")
    # the job's own path: absolute, as a job may change its working folder before it attaches
    env[config.ATTACH_ENV["collector"]] = f"file:{path.resolve()}"
    env[config.CHECK_ENV] = f"file:{path.resolve()}"  # a monitor the job attaches itself reports here too
    env[config.ATTACH_ENV["rules"]] = "off"  # judged here, from the file
    if steps is not None:
        env["TRAINVITALS_CHECK_STEPS"] = str(steps)
    else:
        env.pop("TRAINVITALS_CHECK_STEPS", None)
    if path.exists():
        path.unlink()  # this check's own file, from an earlier check of the same run name
    until = f"for {steps} optimizer steps" if steps is not None else "to its end"
    click.echo(
        f"trainvitals check: running {' '.join(command)!r} as run {run!r} under trainvitals run, "
        f"reporting every {every} step(s), {until}; reports in {path}",
        err=True,
    )
    try:
        status = subprocess.call(list(command), env=env, stdout=sys.stderr if as_json else None)
    except OSError as exc:
        raise _UsageError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted") from None
    job = {"command": list(command), "status": status, "reports_file": str(path), "steps": steps}
    if not path.exists():
        click.echo(
            f"trainvitals check: the job (exit status {status}) wrote no report: no torch optimizer step was "
            "seen, so nothing was watched",
            err=True,
        )
        if as_json:
            _print([], True, files=[str(path)], job=job)
        sys.exit(EXIT_JOB)
    from trainvitals.wire.report_files import ReportFileError, read_report_file

    try:
        for _, report in read_report_file(path, decode_line):
            builder.observe(report)
    except ReportFileError as exc:
        raise _UsageError(str(exc)) from None
    verdicts = builder.verdicts()
    click.echo(f"trainvitals check: the job exited with status {status}", err=True)
    _print(verdicts, as_json, files=[str(path)], job=job)
    if _exit_status(verdicts, fail_on):
        sys.exit(EXIT_PAGE)
    if status != 0 or not any(v.reports for v in verdicts):
        sys.exit(EXIT_JOB)
    sys.exit(0)


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("trainvitals-report.html"),
    show_default=True,
    help="The HTML file to write.",
)
@click.option("--rules", "rules", multiple=True, metavar="PATH", help="Rule files or folders, as for check.")
@click.option("--title", default=None, help="The page's title.  [default: the files' names]")
def report(files: tuple[Path, ...], output: Path, rules: tuple[str, ...], title: str | None) -> None:
    """Write one self-contained HTML page of the runs in FILES: the verdict, the
    incident timeline and the signals behind each alert with their thresholds.

    Nothing in the page is fetched from elsewhere: mail it, open it offline.
    """
    from trainvitals.monitor.report_page import RunHistory, render_page
    from trainvitals.wire.report_files import ReportFileError, read_report_files

    builder = _builder(rules)
    history = RunHistory(rules=builder.rules)
    try:
        for r in read_report_files(files, decode_line):
            builder.observe(r)
            history.add(r)
    except ReportFileError as exc:
        raise _UsageError(str(exc)) from None
    if not builder.verdicts():
        raise _UsageError(f"no report in {', '.join(map(str, files))}")
    page = render_page(builder, history, title=title or ", ".join(f.name for f in files))
    tmp = output.with_name(output.name + ".tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, output)
    except OSError as exc:
        raise _UsageError(f"cannot write {output}: {exc.strerror or exc}") from None
    click.echo(f"report of {len(builder.verdicts())} run(s) written to {output} ({len(page.encode()) / 1e6:.2f} MB)")
