"""In-process PyTorch hooks: ``attach(model, optimizer, ...)`` returns a :class:`Monitor`.

Importing this package imports torch, never the collector stack (fastapi, uvicorn).
"""

from __future__ import annotations

from trainvitals.hooks.attach import attach
from trainvitals.hooks.job_monitor import Monitor, monitor_of
from trainvitals.hooks.sinks import TensorBoardSink
from trainvitals.wire.schema import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "Monitor", "TensorBoardSink", "attach", "monitor_of"]
