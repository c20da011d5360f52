"""Log-once warnings about tensor values, read without a host sync.

A problem visible only in the values (a sample whose label tokens mix modalities,
a non-finite loss) is logged once, never raised. Reading the value at once would
wait for the device; instead the value is copied to the host asynchronously and
looked at on a later call, once the copy has landed.
"""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.signals.base import MonitorView

__all__ = ["LateWarnings"]


class LateWarnings:
    """Log-once warnings about values, read without a host sync: the value is copied
    to the host asynchronously and looked at on a later call, once it has landed."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, str, torch.Tensor, Any]] = []
        self._done: set[str] = set()

    def add(self, key: str, message: str, value: torch.Tensor) -> None:
        if key in self._done or any(p[0] == key for p in self._pending):
            return
        value = value.detach().reshape(())
        if value.device.type == "cpu":
            self._pending.append((key, message, value.clone(), None))
        elif value.device.type == "cuda":
            host = torch.empty((), dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._pending.append((key, message, host, ready))
        # other devices: no cheap completion test; the event in the report remains

    def poll(self, monitor: MonitorView) -> None:
        keep = []
        for key, message, host, ready in self._pending:
            if ready is not None and not ready.query():
                keep.append((key, message, host, ready))
                continue
            count = float(host)  # a host tensor whose copy has completed: no device sync
            if count > 0:
                self._done.add(key)
                monitor.warn_once(key, message, int(count))
        self._pending = keep
