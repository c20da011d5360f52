"""Log-once warnings about tensor values, read without a host sync.

A problem visible only in the values (a sample whose label tokens mix modalities,
a non-finite loss) is logged once, never raised. Reading the value at once would
wait for the device; instead the value is copied to the host asynchronously and
looked at on a later call, once the copy has landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainvitals.hooks.signals.base import MonitorView

__all__ = ["LateValue", "LateWarnings"]


class LateValue:
    """One small tensor copied to the host asynchronously and read on a later call,
    once the copy has landed (on a CPU device at once): a fact about values that lets
    a later report skip work, learned without waiting for the device."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._ready: Any = None

    def start(self, value: torch.Tensor) -> None:
        """Copy ``value`` (a tensor the caller no longer writes) towards the host."""
        value = value.detach()
        self._ready = None
        if value.device.type == "cpu":
            self._host = value
        elif value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:  # other devices: no cheap completion test; never known
            self._host = None

    def get(self) -> list[Any] | None:
        """The values as a list once the copy has landed; None before that (or never started)."""
        if self._host is None or (self._ready is not None and not self._ready.query()):
            return None
        return self._host.reshape(-1).tolist()  # a host tensor whose copy has completed: no device sync


class LateWarnings:
    """Log-once warnings about values, read without a host sync: the value is copied
    to the host asynchronously and looked at on a later call, once it has landed."""

    def __init__(self) -> None:
        # (keys, messages, host values, completion event or None, positive_from)
        self._pending: list[tuple[tuple[str, ...], tuple[str, ...], torch.Tensor, Any, int | None]] = []
        self._done: set[str] = set()

    def add(self, key: str, message: str, value: torch.Tensor) -> None:
        """Log ``message % count`` once if ``value`` (one element) turns out > 0."""
        self.add_many([(key, message)], value.detach().reshape(1).clone())

    def add_many(
        self, warnings: Sequence[tuple[str, str]], values: torch.Tensor, *, positive_from: int | None = None
    ) -> None:
        """Several warnings at once, ``(key, message)`` each, with their counts in
        ``values`` (1-D, one element per warning): one copy to the host for all.
        ``values`` must be a tensor the caller no longer writes (it is kept as is
        on a CPU). With ``positive_from`` (one warning), its count is the number of
        ``values[positive_from:]`` that are > 0."""
        pending = {k for p in self._pending for k in p[0]}
        if all(k in self._done or k in pending for k, _ in warnings):
            return
        keys = tuple(k for k, _ in warnings)
        messages = tuple(msg for _, msg in warnings)
        if values.requires_grad:
            values = values.detach()
        if values.device.type == "cpu":
            self._pending.append((keys, messages, values, None, positive_from))
        elif values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._pending.append((keys, messages, host, ready, positive_from))
        # other devices: no cheap completion test; the event in the report remains

    def add_positive(self, key: str, message: str, flags: torch.Tensor, start: int = 0) -> None:
        """Log ``message % n`` once, ``n`` the number of ``flags[start:]`` that turn out
        > 0 (counted on the host, once the copy has landed)."""
        self.add_many([(key, message)], flags, positive_from=start)

    def poll(self, monitor: MonitorView) -> None:
        if not self._pending:
            return
        keep = []
        for keys, messages, host, ready, positive_from in self._pending:
            if ready is not None and not ready.query():
                keep.append((keys, messages, host, ready, positive_from))
                continue
            counts = host.tolist()  # a host tensor whose copy has completed: no device sync
            if positive_from is not None:
                counts = [sum(1 for v in counts[positive_from:] if v > 0)]
            for key, message, count in zip(keys, messages, counts, strict=True):
                if count > 0 and key not in self._done:
                    self._done.add(key)
                    monitor.warn_once(key, message, int(count))
        self._pending = keep
