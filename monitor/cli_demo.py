"""``trainvitals demo``: the command, and the throwaway collector the demo reports to.

The demo's training (a tiny model with incident I1, then its fix) is
:func:`trainvitals.demo.run_demo`; this module starts the collector it reports to
(in-process, no state file) and stops it at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import click

from trainvitals.demo import run_demo

__all__ = ["demo", "demo_collector"]


@contextmanager
def demo_collector(port: int) -> Iterator[str]:
    """A collector with the default rules on ``port`` (0: any free one), in this
    process; yields its URL. A taken port is a :class:`click.ClickException` saying so."""
    # Imported here: the CLI starts without the collector's web stack.
    from trainvitals.monitor.app import create_app
    from trainvitals.monitor.server import PortInUse, serve_in_thread
    from trainvitals.monitor.settings import Settings

    # state_path=None: a throwaway collector keeps no state file (nor shares one).
    settings = Settings(port=port, rules="default", log_level="warning", state_path=None)
    app = create_app(settings)
    try:
        server = serve_in_thread(app, port=port)
        url = server.__enter__()
    except PortInUse as exc:
        raise click.ClickException(
            f"{exc.strerror}. The demo runs its own collector: `trainvitals demo --port 0` picks a free port."
        ) from None
    try:
        yield url
    finally:
        server.__exit__(None, None, None)


@click.command("demo")
@click.option(
    "--steps",
    type=click.IntRange(25, 10_000),
    default=40,
    show_default=True,
    help="Optimizer steps per phase (bug, then fix).",
)
@click.option("--port", type=int, default=9477, show_default=True, help="Collector port (0: any free port).")
@click.option("--no-serve", is_flag=True, help="Exit when done instead of leaving /metrics up.")
def demo(steps: int, port: int, no_serve: bool) -> None:
    """Watch incident I1 (gradient dilution) fire and resolve on a tiny CPU model."""
    # The demo prints what matters itself; keep the hooks' own log lines out of the table.
    logger = logging.getLogger("trainvitals")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        result = run_demo(steps=steps, collector=demo_collector(port), serve=not no_serve)
    finally:
        logger.setLevel(level)
    if not result["fired_at"]:
        raise click.ClickException("the GradientDilution alert did not fire; this is a bug, please report it")
