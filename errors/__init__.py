"""trainvitals' exception hierarchy: :class:`TrainvitalsError` and its three branches.

Defined in :mod:`trainvitals.wire.errors` (the contract both the hooks and the collector
import); this is its public name. See that module for the tree.
"""

from __future__ import annotations

from trainvitals.wire.errors import ConfigurationError, Refused, StateError, TrainvitalsError

__all__ = ["ConfigurationError", "Refused", "StateError", "TrainvitalsError"]
