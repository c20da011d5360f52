"""The errors trainvitals raises on purpose, in one hierarchy (``trainvitals.errors``).

::

    TrainvitalsError
    ├── ConfigurationError (ValueError)   a setting, argument, rule or file that cannot be
    │                                      used; raised at once, nothing changed
    ├── Refused                           a request the collector will not take: its HTTP
    │                                      status, the outcome it is counted under, headers
    └── StateError (OSError)              the collector's state file cannot be used

Each module keeps its own subclasses (``EnvError``, ``RuleError``, ``IngestRefused``,
``StateInUse``, ...), so ``except RuleError`` still works, and ``except
TrainvitalsError`` catches them all. ``ConfigurationError`` is a ``ValueError`` and
``StateError`` an ``OSError``, as the errors they replace were. The collector answers
every :class:`Refused` with one exception handler: ``{"detail": ...}``, its status and
headers.

Here, in the wire contract, because both sides raise them: the hooks (which must not
import fastapi) and the collector.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ConfigurationError", "Refused", "StateError", "TrainvitalsError"]


class TrainvitalsError(Exception):
    """Every error trainvitals raises on purpose."""


class ConfigurationError(TrainvitalsError, ValueError):
    """A setting, an argument, a rule or a file that cannot be used; nothing was changed.
    The message names what to fix."""


class Refused(TrainvitalsError):
    """A request the collector will not take; nothing was changed.

    ``status``: the HTTP status of the answer; ``outcome``: the label it is counted under
    (``trainvitals_collector_reports_total{outcome}`` for an ingest); ``detail``: the
    message the client sees; ``headers``: extra answer headers (``Retry-After``,
    ``WWW-Authenticate``). Subclasses set the defaults of ``status`` and ``outcome``.
    """

    status: int = 422
    outcome: str = "invalid"

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        outcome: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
        if outcome is not None:
            self.outcome = outcome
        self.headers: dict[str, str] | None = dict(headers) if headers else None


class StateError(TrainvitalsError, OSError):
    """The collector's state file cannot be opened, locked or written; the message names the path."""
