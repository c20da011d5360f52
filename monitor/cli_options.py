"""Command-line options several ``trainvitals`` commands share: the collector's bearer
token, given as ``--token`` (or ``$TRAINVITALS_TOKEN``) or ``--token-file``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

__all__ = ["bearer_token", "read_token_file", "token_file_option", "token_options"]

F = TypeVar("F", bound=Callable[..., Any])

token_file_option = click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="File holding the collector's bearer token (instead of TRAINVITALS_TOKEN).",
)


def token_options(f: F) -> F:
    """``--token`` (env ``TRAINVITALS_TOKEN``) and ``--token-file``; resolve them with
    :func:`bearer_token`."""
    f = token_file_option(f)
    return click.option(
        "--token",
        envvar="TRAINVITALS_TOKEN",
        default=None,
        help="The collector's bearer token, as jobs send it (env TRAINVITALS_TOKEN).",
    )(f)


def read_token_file(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


def bearer_token(token: str | None, token_file: Path | None) -> str | None:
    """The token to send: the file's content when ``--token-file`` is given."""
    return read_token_file(token_file) if token_file is not None else token
