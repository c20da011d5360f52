"""Collector configuration: defaults, then a YAML file, then ``TRAINVITALS_*`` env vars.

Later wins: an environment variable overrides the file, and keyword arguments
(what the CLI passes) override both. The token never appears in ``repr`` or logs.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from trainvitals.wire.errors import ConfigurationError

__all__ = ["DEFAULT_PORT", "ENV_PREFIX", "STATE_OFF", "Settings", "SettingsError", "default_state_path"]

ENV_PREFIX = "TRAINVITALS_"
DEFAULT_PORT = 9477  # 9400 is DCGM exporter's, often on the same GPU nodes
MiB = 1024 * 1024  # mebibyte
# state_path values that keep the state in memory only (case-insensitive; YAML null too).
STATE_OFF = ("", "none", "null", "memory", ":memory:", "off")

# What Settings.from_file read, seen by the file source during one construction.
_FILE_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "trainvitals_settings_file", default=None
)


class SettingsError(ConfigurationError):
    """The configuration is invalid; the message names the file or variable and the field."""


def default_state_path() -> Path:
    """Where the collector keeps its state unless told otherwise: the XDG state folder,
    ``$XDG_STATE_HOME/trainvitals/collector.sqlite3`` (``~/.local/state/...`` when unset)."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "trainvitals" / "collector.sqlite3"


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns everything at once

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get() or {})


class Settings(BaseSettings):
    """Collector settings. Env: ``TRAINVITALS_<FIELD>`` (e.g. ``TRAINVITALS_PORT``)."""

    # hide_input_in_errors: a validation error must not echo the token.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", hide_input_in_errors=True)

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 to serve other hosts.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    token: SecretStr | None = Field(None, description="Bearer token clients must send; none: no authentication.")
    token_file: Path | None = Field(None, description="File holding the token (surrounding whitespace stripped).")
    max_body_bytes: int = Field(16 * MiB, gt=0, description="Largest request body, as sent.")
    max_decompressed_bytes: int = Field(
        64 * MiB, gt=0, description="Largest body after gzip decoding (bounds gzip bombs)."
    )
    run_ttl_seconds: float = Field(3600.0, gt=0, description="A run silent this long is dropped with its series.")
    max_series: int = Field(1_000_000, ge=1, description="Series cap; a batch that would pass it is refused (503).")
    max_series_per_run: int = Field(
        200_000,
        ge=4,
        description="Series budget of one run; a batch that would pass it is "
        "refused (422) and counted, other runs unaffected.",
    )
    stale_reports: int = Field(
        100,
        ge=0,
        description="A series its rank left out of this many consecutive reports is "
        "dropped (0: kept while the run lives).",
    )
    read_token: SecretStr | None = Field(
        None, description="Bearer token for GET /metrics, /v1/* and the API docs; none: open."
    )
    read_token_file: Path | None = Field(
        None, description="File holding the read token (surrounding whitespace stripped)."
    )
    state_path: Path | None = Field(
        default_factory=default_state_path,
        description="SQLite file for runs, alert states, notifications sent and the reports "
        "already applied, so a restart resolves what cleared, does not page twice and applies "
        "a retried report once. Default: $XDG_STATE_HOME/trainvitals/collector.sqlite3 "
        "(~/.local/state/...); 'memory' (or none, null, '') keeps state in memory only.",
    )
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="A request body must arrive within this many seconds (408)."
    )
    state_check_seconds: float = Field(
        2.0,
        gt=0,
        description="How often the state file is checked (deleted or replaced: written back) "
        "and writes the disk refused are tried again.",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="A connection must send its request headers within this many "
        "seconds (half-open connections are closed).",
    )
    keepalive_seconds: float = Field(
        5.0, gt=0, description="An idle keep-alive connection is closed after this many seconds."
    )
    max_connections: int = Field(1000, ge=1, description="Connections served at once; beyond it requests get 503.")
    tls_certfile: Path | None = Field(None, description="PEM certificate: serve HTTPS.")
    tls_keyfile: Path | None = Field(None, description="PEM private key for tls_certfile.")
    access_log: bool = Field(False, description="Log every request (uvicorn access log).")
    api_docs: bool = Field(
        False,
        description="Serve the interactive API docs at /docs and /redoc. Their scripts come from a CDN, so they "
        "are off by default: every page the collector serves otherwise works offline.",
    )
    log_level: str = Field("info", description="uvicorn / logging level.")
    # Passed through to the alert engine, which validates them.
    rules: list[str] | str | None = Field(None, description="Rule files or directories; none: the shipped defaults.")
    alerts: dict[str, Any] | None = Field(None, description="Alert engine options.")
    notifiers: list[dict[str, Any]] | None = Field(None, description="Notifier configs.")

    @field_validator("state_path", mode="before")
    @classmethod
    def _state_path(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in STATE_OFF):
            return None
        if isinstance(value, (str, os.PathLike)):
            return Path(value).expanduser()
        return value

    @model_validator(mode="after")
    def _read_token_files(self) -> Settings:
        self._read_token_file()
        if self.read_token_file is not None:
            if self.read_token is not None:
                raise ValueError("set read_token or read_token_file, not both")
            self.read_token = SecretStr(_read_secret(self.read_token_file, "read_token_file"))
        elif self.read_token is not None and not self.read_token.get_secret_value().strip():
            raise ValueError("read_token is empty; unset it to leave the read endpoints open")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("set tls_certfile and tls_keyfile together")
        return self

    def _read_token_file(self) -> Settings:
        if self.token_file is None:
            if self.token is not None and not self.token.get_secret_value().strip():
                raise ValueError("token is empty; unset it to disable authentication")
            return self
        if self.token is not None:
            raise ValueError("set token or token_file, not both")
        self.token = SecretStr(_read_secret(self.token_file, "token_file"))
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
        """Load ``path`` (YAML mapping) under the environment; ``overrides`` win over both.

        Raises :class:`SettingsError` naming the file (or env var) and the field.
        """
        data: dict[str, Any] = {}
        where = "settings"
        if path is not None:
            where = str(path)
            try:
                with open(path, encoding="utf-8") as fh:
                    loaded = yaml.safe_load(fh)
            except OSError as exc:
                raise SettingsError(f"{where}: cannot read config file: {exc.strerror}") from None
            except yaml.YAMLError as exc:
                raise SettingsError(f"{where}: not valid YAML: {exc}") from None
            if loaded is None:
                loaded = {}
            if not isinstance(loaded, dict):
                raise SettingsError(f"{where}: expected a mapping of settings, got {type(loaded).__name__}")
            data = loaded
        overrides = {k: v for k, v in overrides.items() if v is not None}
        # A token given here replaces one from the file or environment, whichever form.
        if "token_file" in overrides:
            overrides.setdefault("token", None)
        elif "token" in overrides:
            overrides["token_file"] = None
        token = _FILE_DATA.set(data)
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, where, data, overrides)) from None
        finally:
            _FILE_DATA.reset(token)

    @property
    def read_auth_required(self) -> bool:
        """True when GET /metrics, /v1/* and the API docs need the read token."""
        return self.read_token is not None

    @property
    def auth_required(self) -> bool:
        """True when clients must send the bearer token."""
        return self.token is not None


def _read_secret(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"{what} {str(path)!r} is empty")
    return text


def _describe(exc: ValidationError, where: str, data: dict[str, Any], overrides: dict[str, Any]) -> str:
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = err["loc"]
        field = str(loc[0]) if loc else ""
        path = ".".join(str(p) for p in loc)
        msg = err["msg"].removeprefix("Value error, ")
        env_name = ENV_PREFIX + field.upper()
        if field in overrides:
            source = "argument"
        elif field and env_name in os.environ:
            source = f"environment variable {env_name}"
        else:
            source = where
        lines.append(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
