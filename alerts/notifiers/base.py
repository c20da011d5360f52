"""What every notifier shares: the notification, the error, the HTTP plumbing.

Exceptions::

    NotifyError           a send failed
      .retryable          429, 5xx, timeouts, connection errors: try again later
      .retry_after        seconds the receiver asked us to wait (429 Retry-After)

Error messages never carry URLs or bodies: a Slack webhook URL is a secret.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import httpx

from trainvitals.wire.errors import TrainvitalsError
from trainvitals.wire.redact import redact

__all__ = [
    "HttpNotifier",
    "Notification",
    "Notifier",
    "NotifyError",
    "dedup_key",
    "redact_secrets",
    "register_secret",
    "rfc3339",
]

_USER_AGENT = "trainvitals-alerts/0.1"


class _Redactor(logging.Filter):
    """Hides registered secrets and URL credentials/tokens in httpx's log lines (it logs
    every request URL at INFO)."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.redact(redact(message))
        if clean != message:
            record.msg, record.args = clean, ()
        return True

    def redact(self, message: str) -> str:
        with self.lock:
            secrets = sorted(self.secrets, key=len, reverse=True)  # a URL before its token
        for s in secrets:
            if s in message:
                message = message.replace(s, "***")
        return message


_REDACTOR = _Redactor()
logging.getLogger("httpx").addFilter(_REDACTOR)


def redact_secrets(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    return _REDACTOR.redact(text)


def register_secret(value: str) -> None:
    """Never let ``value`` (a Slack URL, a routing key, a token) reach httpx's logs."""
    if value:
        with _REDACTOR.lock:
            _REDACTOR.secrets.add(value)


def rfc3339(t: float) -> str:
    """Unix seconds as RFC 3339 UTC with milliseconds: ``2025-11-29T08:00:00.000Z``."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dedup_key(labels: Mapping[str, str], limit: int = 255) -> str:
    """A stable, readable key from the alert's labels (severity excluded), <= ``limit`` chars.

    ``GradientDilution{modality="image",run="mm-pt1"}``; longer ones keep a
    readable prefix and end in ``#`` + SHA-256 of the full key.
    """
    name = labels.get("alertname", "")
    rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in ("alertname", "severity"))
    key = f"{name}{{{rest}}}"
    if len(key) <= limit:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    return key[: limit - len(digest) - 1] + "#" + digest


@dataclass(frozen=True)
class Notification:
    """One alert's state to tell the world: firing (maybe a periodic repeat) or resolved."""

    status: Literal["firing", "resolved"]
    labels: Mapping[str, str]  # alertname, severity, run, and the series' labels
    annotations: Mapping[str, str] = field(default_factory=dict)  # summary, description, runbook_url
    starts_at: float = 0.0
    # Firing: when the receiver may consider it over without news (Alertmanager);
    # resolved: when it resolved.
    ends_at: float | None = None
    value: float = float("nan")
    generator_url: str = ""
    repeat: bool = False  # a re-send of a firing alert, for receivers that expire alerts

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")

    @property
    def firing(self) -> bool:
        return self.status == "firing"

    def dedup_key(self) -> str:
        return dedup_key(self.labels)


class NotifyError(TrainvitalsError):
    """A send failed; ``retryable`` says whether trying again can help."""

    def __init__(self, message: str, *, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class Notifier(ABC):
    """Sends notifications to one receiver. Called from one worker thread."""

    #: Receives periodic repeats of firing alerts (Alertmanager expires alerts without them).
    wants_repeats: bool = False
    #: Most notifications one ``send`` call takes.
    max_batch: int = 1

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def send(self, batch: Sequence[Notification]) -> None:
        """Deliver the batch or raise :class:`NotifyError`."""

    def close(self) -> None:
        """Release connections (none by default)."""
        return None

    def __repr__(self) -> str:  # never the URL or key: they may be secrets
        return f"<{type(self).__name__} {self.name!r}>"


class HttpNotifier(Notifier):
    """A notifier that POSTs JSON with httpx, with timeouts, and classifies answers."""

    def __init__(self, name: str, *, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(name)
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            headers={"User-Agent": _USER_AGENT, **(headers or {})},
            follow_redirects=False,
        )

    def post(self, url: str, payload: Any) -> httpx.Response:
        """POST JSON; 2xx returns the response, anything else raises NotifyError."""
        try:
            response = self._client.post(url, json=payload)
        except httpx.TimeoutException as exc:
            raise NotifyError(f"timed out ({type(exc).__name__})", retryable=True) from None
        except httpx.TransportError as exc:
            raise NotifyError(f"connection failed ({type(exc).__name__})", retryable=True) from None
        code = response.status_code
        if 200 <= code < 300:
            return response
        retry_after = _retry_after(response.headers.get("Retry-After"))
        retryable = code == 429 or code >= 500  # other 4xx: the request itself is wrong
        raise NotifyError(f"HTTP {code}", retryable=retryable, retry_after=retry_after)

    def close(self) -> None:
        self._client.close()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
