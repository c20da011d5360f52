"""In-process PyTorch hooks: ``attach(model, optimizer, ...)`` and the signals.

Attributes are loaded lazily so that ``trainvitals.wire`` (the shared wire
schema) can be imported by the collector without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Monitor", "attach", "SCHEMA_VERSION"]

if TYPE_CHECKING:  # pragma: no cover
    from trainvitals.hooks.monitor import Monitor, attach
    from trainvitals.wire import SCHEMA_VERSION


def __getattr__(name: str) -> Any:
    if name in ("Monitor", "attach"):
        from trainvitals.hooks import monitor

        return getattr(monitor, name)
    if name == "SCHEMA_VERSION":
        from trainvitals.wire.schema import SCHEMA_VERSION

        return SCHEMA_VERSION
    raise AttributeError(f"module 'trainvitals.hooks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
