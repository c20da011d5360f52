"""Notifier configuration: the collector config's ``notifiers:`` list, validated.

::

    notifiers:
      - {type: alertmanager, url: "http://alertmanager:9093"}
      - {type: pagerduty, routing_key_env: PD_KEY}          # or routing_key_file
      - {type: slack, webhook_url_env: SLACK_WEBHOOK_URL}   # or webhook_url_file
      - {type: webhook, url: "https://hooks.example/tv", headers_env: {Authorization: TV_HOOK_AUTH}}

Secrets (routing keys, Slack webhook URLs, header values) come from the
environment or a file, are read once when the notifiers are built, and never
appear in a repr, a log line or an error message. Inline values are accepted
(``routing_key: ...``) for tests; prefer ``_env`` or ``_file``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from trainvitals.alerts.notifiers.alertmanager import AlertmanagerNotifier
from trainvitals.alerts.notifiers.base import Notifier, register_secret
from trainvitals.alerts.notifiers.pagerduty import DEFAULT_URL, PagerDutyNotifier
from trainvitals.alerts.notifiers.slack import SlackNotifier
from trainvitals.alerts.notifiers.webhook import WebhookNotifier
from trainvitals.wire.errors import ConfigurationError

__all__ = [
    "AlertmanagerConfig",
    "NotifierConfig",
    "NotifierConfigError",
    "PagerDutyConfig",
    "SlackConfig",
    "WebhookConfig",
    "build_notifiers",
    "parse_notifier_configs",
]


class NotifierConfigError(ConfigurationError):
    """A ``notifiers:`` entry that cannot be used; names the entry and the field."""


def _http_url(value: str) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    return value


HttpURL = Annotated[str, AfterValidator(_http_url)]


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")] | None = None
    timeout: Annotated[float, Field(gt=0, le=300)] = 10.0
    """Seconds for one HTTP request (connect at most 5)."""


def _secret(inline: SecretStr | None, env: str | None, file: Path | None, what: str) -> str:
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise _Field(f"{what}_env", f"environment variable {env} is not set")
        return value.strip()
    if file is not None:
        try:
            value = file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise _Field(f"{what}_file", f"cannot read {file}: {exc.strerror or type(exc).__name__}") from None
        if not value:
            raise _Field(f"{what}_file", f"{file} is empty")
        return value
    assert inline is not None
    return inline.get_secret_value()


def _registered(value: str) -> str:
    register_secret(value)
    return value


def _url_secrets(url: str) -> str:
    """Register what a plain ``url`` setting may hide, never logged: its password,
    its path (a token often is one: ``/hooks/T0KEN``; registered with the host, so the
    logs show ``http://***``), its query string and fragment."""
    parts = urlsplit(url)
    for secret in (parts.query, parts.fragment, parts.password):
        if secret:
            register_secret(secret)
    if parts.path.strip("/"):
        register_secret(parts.netloc + parts.path)
    return url


class _Field(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _one_source(model: BaseModel, what: str) -> None:
    given = [f for f in (what, f"{what}_env", f"{what}_file") if getattr(model, f) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of '{what}_env', '{what}_file' or '{what}'")


class AlertmanagerConfig(_Base):
    """``POST {url}/api/v2/alerts``; firing alerts are re-sent every ``resend_interval``."""

    type: Literal["alertmanager"]
    url: HttpURL

    def build(self, name: str) -> Notifier:
        return AlertmanagerNotifier(name, _url_secrets(self.url), timeout=self.timeout)


class PagerDutyConfig(_Base):
    """PagerDuty Events v2; the routing key from the environment, a file, or inline."""

    type: Literal["pagerduty"]
    url: HttpURL = DEFAULT_URL
    routing_key: SecretStr | None = None
    routing_key_env: str | None = None
    routing_key_file: Path | None = None

    @model_validator(mode="after")
    def _key(self) -> PagerDutyConfig:
        _one_source(self, "routing_key")
        return self

    def build(self, name: str) -> Notifier:
        key = _registered(_secret(self.routing_key, self.routing_key_env, self.routing_key_file, "routing_key"))
        return PagerDutyNotifier(name, key, url=self.url, timeout=self.timeout)


class SlackConfig(_Base):
    """Slack incoming webhook; its URL is a secret."""

    type: Literal["slack"]
    webhook_url: SecretStr | None = None
    webhook_url_env: str | None = None
    webhook_url_file: Path | None = None

    @model_validator(mode="after")
    def _key(self) -> SlackConfig:
        _one_source(self, "webhook_url")
        return self

    def build(self, name: str) -> Notifier:
        url = _registered(_secret(self.webhook_url, self.webhook_url_env, self.webhook_url_file, "webhook_url"))
        if not url.startswith(("http://", "https://")):
            field = (
                "webhook_url_env"
                if self.webhook_url_env
                else "webhook_url_file"
                if self.webhook_url_file
                else "webhook_url"
            )
            raise _Field(field, "the webhook URL must start with http:// or https://")
        return SlackNotifier(name, url, timeout=self.timeout)


class WebhookConfig(_Base):
    """Any JSON webhook; header values (tokens) inline or from the environment."""

    type: Literal["webhook"]
    url: HttpURL
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    headers_env: dict[str, str] = Field(default_factory=dict)

    def build(self, name: str) -> Notifier:
        headers = {k: _registered(v.get_secret_value()) for k, v in self.headers.items()}
        for header, env in self.headers_env.items():
            value = os.environ.get(env)
            if not value:
                raise _Field("headers_env", f"environment variable {env} (header {header}) is not set")
            headers[header] = _registered(value)
        return WebhookNotifier(name, _url_secrets(self.url), headers=headers, timeout=self.timeout)


NotifierConfig = Annotated[
    AlertmanagerConfig | PagerDutyConfig | SlackConfig | WebhookConfig, Field(discriminator="type")
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(NotifierConfig)
_CONFIGS: tuple[type[_Base], ...] = get_args(get_args(NotifierConfig)[0])
_TYPES = tuple(get_args(c.model_fields["type"].annotation)[0] for c in _CONFIGS)
"""The notifier types, each written once: in its config's ``type`` Literal."""


def _where(index: int, raw: Any) -> str:
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    return f"notifiers[{index}]" + (f" ({kind})" if isinstance(kind, str) else "")


def parse_notifier_configs(raw: Sequence[Mapping[str, Any]] | None) -> list[Any]:
    """Validate the ``notifiers:`` list; errors say ``notifiers[i] (type): field 'x': ...``."""
    out = []
    for i, item in enumerate(raw or []):
        if not isinstance(item, Mapping) or item.get("type") not in _TYPES:
            raise NotifierConfigError(f"{_where(i, item)}: field 'type': must be one of {', '.join(_TYPES)}")
        try:
            out.append(_ADAPTER.validate_python(dict(item)))
        except ValidationError as exc:
            err = exc.errors(include_input=False)[0]
            loc = [str(p) for p in err["loc"][1:]]  # drop the union tag
            msg = err["msg"].removeprefix("Value error, ")
            where = f"field '{'.'.join(loc)}': " if loc else ""
            raise NotifierConfigError(f"{_where(i, item)}: {where}{msg}") from None
    return out


def build_notifiers(raw: Sequence[Mapping[str, Any]] | None) -> list[Notifier]:
    """Validate the configs, read their secrets and build the notifiers (names unique)."""
    configs = parse_notifier_configs(raw)
    notifiers: list[Notifier] = []
    used: set[str] = set()
    try:
        for i, cfg in enumerate(configs):
            name = cfg.name or cfg.type
            if name in used:
                if cfg.name:
                    raise NotifierConfigError(f"notifiers[{i}] ({cfg.type}): field 'name': duplicate name {name!r}")
                n = 2
                while f"{cfg.type}-{n}" in used:
                    n += 1
                name = f"{cfg.type}-{n}"
            used.add(name)
            try:
                notifiers.append(cfg.build(name))
            except _Field as exc:
                raise NotifierConfigError(f"notifiers[{i}] ({cfg.type}): field '{exc.field}': {exc}") from None
    except Exception:
        for built in notifiers:
            built.close()
        raise
    return notifiers
