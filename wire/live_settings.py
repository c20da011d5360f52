"""Live settings: what ``trainvitals configure`` may change in a running job, on both sides.

The collector takes ``PUT /v1/runs/{run}/settings`` bodies (:class:`SettingsRequest`,
:func:`parse_request`) and sends each run's entry in the answers to its reports; the
hooks read an entry with :func:`parse_entry` and apply it (``docs/wire.md``, "Live
settings"). The fields, the built-in signal names and the limits are defined here
once, for both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "BUILTIN_SIGNALS",
    "DEFAULT_TTL_SECONDS",
    "LIVE_FIELDS",
    "MAX_INTERVAL",
    "MAX_TTL_SECONDS",
    "SettingsRequest",
    "SignalName",
    "parse_entry",
    "parse_request",
]

LIVE_FIELDS = ("every", "signals", "per_param", "probe_every")
"""What may be set: the hooks' options of the same names (``trainvitals.hooks.config.Config``)."""

SignalName = Literal["optimizer", "params", "adam", "packing"]
BUILTIN_SIGNALS: tuple[str, ...] = get_args(SignalName)
"""The hooks' built-in signals, in their order (``signals=`` names some of them)."""

MAX_INTERVAL = 1_000_000
"""Largest report or probe interval (steps): the collector refuses larger, the hooks too."""
DEFAULT_TTL_SECONDS = 3600.0
MAX_TTL_SECONDS = 7 * 86400.0


class SettingsRequest(BaseModel):
    """The body of ``PUT /v1/runs/{run}/settings``. A field left out keeps the job's
    own value; ``signals: null`` means every built-in signal, ``probe_every: null``
    turns the probe off."""

    model_config = ConfigDict(extra="forbid", strict=True)

    every: int = Field(
        None,
        ge=1,
        le=MAX_INTERVAL,  # type: ignore[assignment]
        description="Report every N optimizer steps.",
    )
    signals: list[SignalName] | None = Field(None, description="Built-in signals to run; null: all.")
    per_param: bool = Field(
        None,  # type: ignore[assignment]
        description="Per-parameter series for parameters with ndim >= 2.",
    )
    probe_every: int | None = Field(
        None, ge=1, le=MAX_INTERVAL, description="Per-modality gradient probe interval; null: off."
    )
    ttl_seconds: float = Field(
        DEFAULT_TTL_SECONDS,
        gt=0,
        le=MAX_TTL_SECONDS,
        description="Seconds until the job goes back to its own settings.",
    )

    @field_validator("every", "per_param", mode="before")
    @classmethod
    def _not_null(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("null is not a value here; leave the field out to keep the job's own")
        return v

    @field_validator("every", "probe_every", mode="before")
    @classmethod
    def _whole(cls, v: Any) -> Any:
        # JSON has one number type: 5.0 is the integer 5 (as JSON Schema says); 5.5 is not.
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v

    @field_validator("ttl_seconds", mode="before")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be a finite number of seconds")
        return v

    def values(self) -> dict[str, Any]:
        """The settings given (the override), in the hooks' field names."""
        out = {}
        for name in LIVE_FIELDS:
            if name in self.model_fields_set:
                v = getattr(self, name)
                out[name] = [s for s in BUILTIN_SIGNALS if s in v] if name == "signals" and v else v
        return out


def parse_request(data: Any) -> SettingsRequest:
    """Validate a PUT body; ValueError with one line per problem, each naming its field."""
    try:
        req = SettingsRequest.model_validate(data)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False)
        ]
        raise ValueError("; ".join(problems)) from None
    if not req.values():
        raise ValueError(
            f"no settings given: set one of {', '.join(LIVE_FIELDS)} (DELETE goes back to the job's own settings)"
        )
    return req


def parse_entry(entry: Any) -> tuple[dict[str, Any], float]:
    """A run's entry of the answer's ``settings`` as (override, seconds left).

    ``{"every": 1, "signals": ["params"], "per_param": true, "probe_every": null,
    "expires_in": 3590.5}``: the fields present replace the job's own (``probe_every``
    null: off); ``expires_in`` (seconds, > 0) is required. Other keys are ignored
    (a newer collector may send more). Raises ValueError naming the field."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"settings entry must be an object, got {type(entry).__name__}")
    left = entry.get("expires_in")
    if isinstance(left, bool) or not isinstance(left, (int, float)) or not math.isfinite(left) or left <= 0:
        raise ValueError(f"expires_in must be a positive number of seconds, got {left!r}")
    out: dict[str, Any] = {}
    for name in LIVE_FIELDS:
        if name not in entry:
            continue
        v = entry[name]
        if name == "every":
            if not _interval(v):
                raise ValueError(f"every must be an integer in 1..{MAX_INTERVAL}, got {v!r}")
        elif name == "probe_every":
            if v is not None and not _interval(v):
                raise ValueError(f"probe_every must be null or an integer in 1..{MAX_INTERVAL}, got {v!r}")
        elif name == "per_param":
            if not isinstance(v, bool):
                raise ValueError(f"per_param must be true or false, got {v!r}")
        elif name == "signals":
            if v is not None:
                if not isinstance(v, list) or any(s not in BUILTIN_SIGNALS for s in v):
                    raise ValueError(f"signals must be null or a list of {list(BUILTIN_SIGNALS)}, got {v!r}")
                v = tuple(s for s in BUILTIN_SIGNALS if s in v)  # one order: equal sets compare equal
        out[name] = v
    return out, float(left)


def _interval(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_INTERVAL
