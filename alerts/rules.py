"""Temporary: the names ``trainvitals.monitor.app`` still imports from here.

The rule model moved to :mod:`trainvitals.alerts.model` and loading to
:mod:`trainvitals.alerts.loading`; this module goes once the monitor imports
``RuleError`` from :mod:`trainvitals.alerts`.
"""

from trainvitals.alerts.loading import RuleError

__all__ = ["RuleError"]
