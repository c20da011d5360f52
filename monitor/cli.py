"""The ``trainvitals`` command line.

Subcommands attach to the :func:`main` group: decorate with ``@main.command()``
here, or call ``main.add_command(cmd)`` from another module imported below.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from trainvitals.monitor.cli_options import bearer_token, token_options
from trainvitals.monitor.settings import DEFAULT_PORT, Settings, SettingsError
from trainvitals.wire import encode_body, encode_report
from trainvitals.wire.report_files import ReportFileError, read_report_file

if TYPE_CHECKING:
    import httpx

__all__ = ["main"]

_MAX_REPLAY_BODY = 8 * 1024 * 1024  # bytes per POST, well under the collector's 16 MiB default


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trainvitals")
def main() -> None:
    """trainvitals: catch the training failures the loss curve hides."""


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML settings file (TRAINVITALS_* environment variables override it).",
)
@click.option("--host", default=None, help="Address to bind.  [default: 127.0.0.1]")
@click.option("--port", type=int, default=None, help=f"TCP port.  [default: {DEFAULT_PORT}]")
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="File holding the bearer token clients must send.",
)
@click.option(
    "--state-path",
    default=None,
    help="SQLite file for durable state, or 'memory'.  [default: $XDG_STATE_HOME/trainvitals/collector.sqlite3]",
)
def serve(
    config_file: Path | None,
    host: str | None,
    port: int | None,
    token_file: Path | None,
    state_path: str | None,
) -> None:
    """Run the collector: ingest reports, serve /metrics."""
    import resource

    import uvicorn

    from trainvitals.monitor import logs
    from trainvitals.monitor.app import create_app, tune_gc
    from trainvitals.monitor.server import base_url, bind, uvicorn_config

    try:
        settings = Settings.from_file(config_file, host=host, port=port, token_file=token_file, state_path=state_path)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logs.install()
    # Bind before anything else, so a taken port is one clear line, not a banner then a traceback.
    try:
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        raise click.ClickException(exc.strerror or str(exc)) from None
    try:
        app = create_app(settings)
    except SettingsError as exc:
        sock.close()
        raise click.ClickException(str(exc)) from None
    # Each connection is a file: use the hard limit, not the (often 1024) soft one.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tune_gc()
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    bound = sock.getsockname()[1]
    scheme = "https" if settings.tls_certfile is not None else "http"
    app.state.alerts.serving_at(base_url(settings.host, bound, tls=settings.tls_certfile is not None))
    auth = "bearer token required" if settings.auth_required else "no authentication"
    reads = "read token required" if settings.read_auth_required else "open"
    state = (
        f"state in {settings.state_path}"
        if settings.state_path
        else ("state in memory only: a restart forgets runs, alerts and notifications sent")
    )
    click.echo(
        f"trainvitals collector on {scheme}://{shown}:{bound} "
        f"(POST /v1/reports: {auth}; GET /metrics, /v1/*: {reads}; {state})"
    )
    config = uvicorn_config(app, settings)  # configures uvicorn's loggers and handlers
    logs.install()  # so their lines are redacted and bounded too
    uvicorn.Server(config).run(sockets=[sock])


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--collector",
    envvar="TRAINVITALS_COLLECTOR",
    required=True,
    help="Collector base URL, e.g. http://127.0.0.1:9477 (env TRAINVITALS_COLLECTOR).",
)
@token_options
@click.option(
    "--batch-size",
    type=click.IntRange(1, 10_000),
    default=100,
    show_default=True,
    help="Reports per request.",
)
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds per request.")
def replay(
    file: Path,
    collector: str,
    token: str | None,
    token_file: Path | None,
    batch_size: int,
    timeout: float,
) -> None:
    """Send a file sink's JSONL reports to a collector.

    Each line is a wire body {"schema": 1, "reports": [...]} or a single report.
    """
    import httpx

    token = bearer_token(token, token_file)
    url = collector.rstrip("/")
    if not url.endswith("/v1/reports"):
        url += "/v1/reports"
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    accepted = 0
    with httpx.Client(timeout=timeout, headers=headers) as client:
        for first_line, last_line, reports in _batches(file, batch_size):
            try:
                resp = client.post(url, content=encode_body(reports))
            except httpx.HTTPError as exc:
                raise click.ClickException(
                    f"cannot reach the collector at {url}: {exc or type(exc).__name__}"
                    f" ({accepted} reports accepted before)"
                ) from None
            if resp.status_code != 202:
                raise click.ClickException(
                    f"collector refused lines {first_line}-{last_line} of {file}: "
                    f"HTTP {resp.status_code}: {_detail(resp)} ({accepted} reports accepted before)"
                )
            accepted += int(resp.json().get("accepted", len(reports)))
    click.echo(f"{accepted} reports from {file} accepted by {collector}")


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["detail"])
    except (ValueError, KeyError, TypeError):  # not JSON, or not an error body
        return resp.text[:500] or "(empty body)"


def _reports(file: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, one report's wire JSON) for each report in the file."""
    try:
        for lineno, report in read_report_file(file):
            yield lineno, encode_report(report)
    except ReportFileError as exc:
        raise click.ClickException(f"{exc.where}: {exc.reason}") from None


def _batches(file: Path, size: int) -> Iterator[tuple[int, int, list[bytes]]]:
    """Group reports into bodies of at most ``size`` reports and about 8 MiB."""
    batch: list[bytes] = []
    nbytes = 0
    first = last = 0
    for lineno, report in _reports(file):
        if batch and (len(batch) >= size or nbytes + len(report) > _MAX_REPLAY_BODY):
            yield first, last, batch
            batch, nbytes = [], 0
        if not batch:
            first = lineno
        batch.append(report)
        nbytes += len(report) + 1
        last = lineno
    if batch:
        yield first, last, batch


def _add_subcommands() -> None:
    from trainvitals.alerts.cli import rules
    from trainvitals.monitor.cli_audit import audit
    from trainvitals.monitor.cli_check import check, report
    from trainvitals.monitor.cli_demo import demo
    from trainvitals.monitor.cli_run import configure, run

    main.add_command(rules)
    main.add_command(demo)
    main.add_command(run)
    main.add_command(configure)
    main.add_command(check)
    main.add_command(report)
    main.add_command(audit)


_add_subcommands()


if __name__ == "__main__":  # python -m trainvitals.monitor.cli
    main()
