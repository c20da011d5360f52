"""In-process PyTorch hooks: ``attach(model, optimizer, ...)`` returns a :class:`Monitor`.

Importing this package imports torch, never the collector stack (fastapi, uvicorn).
"""

from __future__ import annotations

from trainvitals.hooks.attach import attach
from trainvitals.hooks.job_monitor import Monitor
from trainvitals.hooks.job_monitor import monitor_of as monitor_of
from trainvitals.hooks.sinks import TensorBoardSink as TensorBoardSink
from trainvitals.wire.schema import SCHEMA_VERSION

# monitor_of and TensorBoardSink import from here too (their modules moved), outside
# the star-import surface, which stays the three names it always was.
__all__ = ["SCHEMA_VERSION", "Monitor", "attach"]
