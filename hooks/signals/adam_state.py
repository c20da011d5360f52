"""Adam state statistics (I4). Placeholder until issue 4 lands."""

from __future__ import annotations

from trainvitals.hooks.signals.base import Signal


class AdamState(Signal):
    pass
