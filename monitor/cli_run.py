"""``trainvitals run`` and ``trainvitals configure``.

``run`` starts a job with trainvitals loaded at start-up and no change to its code:
the command replaces this process (``exec``), so its exit code, its signals and
its process id are the job's own. The job finds the settings in its environment:
``PYTHONPATH`` starts with the folder of the start-up shim
(``trainvitals/hooks/_sitecustomize``), and ``TRAINVITALS_*`` variables carry the
options (docs/configuration.md). Nothing here imports torch: the variables are
checked with ``trainvitals/hooks/config.py`` loaded on its own.

``configure`` changes a running job's settings for a while through the collector
(``PUT /v1/runs/{run}/settings``); the job applies them at the step after its next
report.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import click

from trainvitals.monitor.cli_options import bearer_token, read_token_file, token_file_option, token_options
from trainvitals.monitor.settings import DEFAULT_PORT
from trainvitals.wire.live_settings import MAX_TTL_SECONDS
from trainvitals.wire.runs import RUN_RULE, is_run

__all__ = ["configure", "default_report_file", "hook_config", "job_environment", "parse_duration", "run", "shim_folder"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def hooks_folder() -> Path:
    """The installed ``trainvitals.hooks`` folder, found without importing it (torch)."""
    spec = importlib.util.find_spec("trainvitals.hooks")
    if spec is None or not spec.submodule_search_locations:
        raise click.ClickException("cannot find the trainvitals.hooks package in this installation")
    return Path(next(iter(spec.submodule_search_locations)))


def shim_folder() -> Path:
    """The folder ``trainvitals run`` puts first on the job's PYTHONPATH."""
    folder = hooks_folder() / "_sitecustomize"
    if not (folder / "sitecustomize.py").is_file():
        raise click.ClickException(f"the start-up shim is missing from this installation ({folder})")
    return folder


@functools.lru_cache(maxsize=1)
def hook_config() -> ModuleType:
    """``trainvitals/hooks/config.py`` loaded on its own (standard library only), so the
    job's variables are checked here without importing torch (seconds)."""
    path = hooks_folder() / "config.py"
    spec = importlib.util.spec_from_file_location("_trainvitals_hook_config", path)
    if spec is None or spec.loader is None:
        raise click.ClickException(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered under its own name: dataclasses and typing.get_type_hints look it up.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _check_environment(env: dict[str, str]) -> None:
    """Refuse variables the job's attach would refuse, before the job starts."""
    config = hook_config()
    try:
        config.Config.from_env(env)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    run = env.get(config.ATTACH_ENV["run"], "")
    if run and not is_run(run):
        raise click.ClickException(f"run name {run!r}: {RUN_RULE}")
    sink = env.get(config.ATTACH_ENV["collector"], "").strip()
    if sink and sink not in ("null", "none") and not sink.startswith(("http://", "https://", "file:")):
        raise click.ClickException(
            f"collector {sink!r}: use an http(s) URL like http://127.0.0.1:9477, file:PATH or null"
        )


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--run",
    "run_name",
    default=None,
    metavar="NAME",
    help="The run's name (TRAINVITALS_RUN).  [default: the script's name and the start time]",
)
@click.option(
    "--collector",
    default=None,
    metavar="URL",
    help="Where reports go: a collector URL, file:PATH or null (TRAINVITALS_COLLECTOR). "
    " [default: ./trainvitals-<run>.jsonl]",
)
@click.option(
    "--every",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Report every N optimizer steps (TRAINVITALS_EVERY).  [default: 10]",
)
@token_file_option
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="OPTION=VALUE",
    help="Any attach option, e.g. --set per_param=true (TRAINVITALS_<OPTION>); repeatable.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    run_name: str | None,
    collector: str | None,
    every: int | None,
    token_file: Path | None,
    settings: tuple[str, ...],
    command: tuple[str, ...],
) -> None:
    """Run COMMAND with trainvitals attached to every optimizer it steps.

    \b
      trainvitals run --collector http://127.0.0.1:9477 -- python train.py --lr 3e-4
      trainvitals run --run llm-7b -- torchrun --nproc-per-node 8 train.py
      trainvitals run -- python -m mypkg.train

    No change to the job's code: parameter, gradient, 1D-drift and Adam signals, and
    loss accounting where the logits can be found. The command replaces this process:
    its exit code and signals are the job's own. Options not given here come from the
    TRAINVITALS_* environment (docs/configuration.md).
    """
    env = job_environment(run_name, collector, every, token_file, settings, command)
    where = env.get(hook_config().ATTACH_ENV["collector"]) or default_report_file(env)
    click.echo(f"trainvitals run: run {env['TRAINVITALS_RUN']!r}, reports to {_shown(where)}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        # As a shell does: 127 for a command not found, 126 for one that cannot run.
        click.echo(f"trainvitals run: cannot run {command[0]!r}: {exc.strerror or exc}", err=True)
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)


def default_report_file(env: dict[str, str]) -> str:
    """Where a job's reports go when no collector is set: ``./trainvitals-<run>.jsonl``."""
    return f"./trainvitals-{env['TRAINVITALS_RUN'].replace('/', '_')}.jsonl"


def job_environment(
    run_name: str | None,
    collector: str | None,
    every: int | None,
    token_file: Path | None,
    settings: tuple[str, ...],
    command: tuple[str, ...],
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment ``trainvitals run`` gives a job: the options as ``TRAINVITALS_*``
    variables (checked as the job's attach would check them) and the start-up shim
    first on ``PYTHONPATH``. ``--set`` takes every attach option: the :class:`Config`
    fields and the core arguments that have a variable (``rules``, ``modalities``)."""
    env = dict(os.environ if base is None else base)
    config = hook_config()
    core = {k: v for k, v in config.ATTACH_ENV.items() if k in ("rules", "modalities")}
    known = [*config.Config.field_names(), *core]
    for item in settings:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in known:
            raise click.ClickException(f"--set {item!r}: use OPTION=VALUE with OPTION one of {', '.join(known)}")
        env[core[name] if name in core else config.env_name(name)] = value
    if every is not None:
        env[config.env_name("every")] = str(every)
    if collector is not None:
        env[config.ATTACH_ENV["collector"]] = collector
    if token_file is not None:
        env["TRAINVITALS_TOKEN"] = read_token_file(token_file)
    if run_name is not None:
        env[config.ATTACH_ENV["run"]] = run_name
    else:
        env.setdefault(config.ATTACH_ENV["run"], config.default_run_name(list(command)))
    _check_environment(env)
    shim = str(shim_folder())
    previous = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = shim + (os.pathsep + previous if previous else "")
    return env


def _shown(url: str) -> str:
    from trainvitals.wire.redact import redact

    return redact(url)


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``30m``, ``2h`` or ``1d``."""
    m = _DURATION.match(text)
    if not m:
        raise click.BadParameter(f"{text!r}: use a number with s, m, h or d, e.g. 30m or 2h")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _interval_or_off(text: str) -> int | None:
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: use a number of steps or 'off'") from None
    if value < 1:
        raise click.BadParameter(f"{text!r}: use a positive number of steps or 'off'")
    return value


@click.command()
@click.argument("run_name", metavar="RUN")
@click.option("--every", type=click.IntRange(min=1), default=None, metavar="N", help="Report every N optimizer steps.")
@click.option(
    "--signals",
    default=None,
    metavar="LIST",
    help="Built-in signals to run: a comma-separated list of optimizer, params, adam; 'all' or 'none'.",
)
@click.option("--per-param/--no-per-param", default=None, help="Per-parameter series for parameters with ndim >= 2.")
@click.option("--probe-every", default=None, metavar="N|off", help="Per-modality gradient probe every N steps, or off.")
@click.option(
    "--for",
    "duration",
    default="1h",
    show_default=True,
    metavar="DURATION",
    help="Until the job goes back to its own settings (30m, 2h, 1d; at most 7d).",
)
@click.option("--reset", is_flag=True, help="Back to the job's own settings now.")
@click.option(
    "--collector",
    envvar="TRAINVITALS_COLLECTOR",
    default=f"http://127.0.0.1:{DEFAULT_PORT}",
    show_default=True,
    metavar="URL",
    help="Collector base URL, where `trainvitals serve` listens (env TRAINVITALS_COLLECTOR).",
)
@token_options
@click.option(
    "--read-token",
    envvar="TRAINVITALS_READ_TOKEN",
    default=None,
    help="The collector's read token, to show settings (env TRAINVITALS_READ_TOKEN).",
)
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds per request.")
def configure(
    run_name: str,
    every: int | None,
    signals: str | None,
    per_param: bool | None,
    probe_every: str | None,
    duration: str,
    reset: bool,
    collector: str,
    token: str | None,
    token_file: Path | None,
    read_token: str | None,
    timeout: float,
) -> None:
    """Change a running job's settings for a while, through its collector.

    \b
      trainvitals configure llm-7b --every 1 --for 30m
      trainvitals configure llm-7b --per-param --signals params,adam
      trainvitals configure llm-7b --reset
      trainvitals configure llm-7b                 (show what is set)

    The job gets them in the answer to its next report and applies them from the
    step after; they expire back to the job's own settings (default after 1h).
    """
    import httpx

    body: dict[str, Any] = {}
    if every is not None:
        body["every"] = every
    if signals is not None:
        low = signals.strip().lower()
        body["signals"] = (
            None if low == "all" else ([] if low == "none" else [s.strip() for s in signals.split(",") if s.strip()])
        )
    if per_param is not None:
        body["per_param"] = per_param
    if probe_every is not None:
        body["probe_every"] = _interval_or_off(probe_every)
    if reset and body:
        raise click.UsageError("--reset goes back to the job's own settings: give it alone")
    ctx = click.get_current_context()
    duration_given = ctx.get_parameter_source("duration") is not click.core.ParameterSource.DEFAULT
    if duration_given and not body:
        raise click.UsageError(
            f"--for {duration} says how long settings last, but no setting is given: add --every, "
            "--signals, --per-param or --probe-every (or leave --for out to show what is set)"
        )
    ttl = None
    if body:
        ttl = parse_duration(duration)
        if not 0 < ttl <= MAX_TTL_SECONDS:
            raise click.BadParameter(
                f"{duration}: settings last at most {MAX_TTL_SECONDS / 86400:g}d and more than 0s; "
                "run configure again before they expire to extend them",
                param_hint="'--for'",
            )
    token = bearer_token(token, token_file)
    url = collector.rstrip("/") + "/v1/runs/" + quote(run_name, safe="/:") + "/settings"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(timeout=timeout) as client:
            if reset:
                resp = client.delete(url, headers=headers)
            elif body:
                body["ttl_seconds"] = ttl
                resp = client.put(url, json=body, headers=headers)
            else:
                resp = client.get(url, headers={"Authorization": f"Bearer {read_token}"} if read_token else {})
    except httpx.HTTPError as exc:
        raise click.ClickException(
            f"cannot reach the collector at {_shown(collector)}: {exc or type(exc).__name__}"
        ) from None
    if resp.status_code != 200:
        try:
            detail = resp.json()["detail"]
        except Exception:  # noqa: BLE001
            detail = resp.text[:500] or "(empty body)"
        raise click.ClickException(f"the collector refused: HTTP {resp.status_code}: {detail}")
    answer = resp.json()
    shown = answer.get("settings")
    if reset:
        click.echo(
            f"run {run_name!r}: back to the job's own settings at its next report"
            + ("" if answer.get("cleared") else " (none were set)")
        )
    elif shown is None:
        click.echo(f"run {run_name!r}: the job's own settings (nothing set)")
    else:
        values = ", ".join(
            f"{k}={_value(k, v)}" for k, v in shown.items() if k not in ("set_at", "expires_at", "expires_in")
        )
        until = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(shown["expires_at"]))
        click.echo(
            f"run {run_name!r}: {values} until {until} (in {_span(shown['expires_in'])}); "
            + (
                "the job applies them from the step after its next report"
                if body
                else "then back to the job's own settings"
            )
        )


def _value(key: str, v: Any) -> str:
    if key == "signals":
        return "all" if v is None else (",".join(v) or "none")
    if v is None:
        return "off"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _span(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h " if h else "") + (f"{m}m " if m or h else "") + f"{s}s"
