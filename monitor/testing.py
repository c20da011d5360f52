"""Transitional: the test data builders moved to ``tests/reports.py`` and the
in-thread server to :mod:`trainvitals.monitor.server`.

Kept only while ``tests/e2e/test_alerts_e2e.py`` still imports ``make_body`` and
``make_report`` from here; delete this module once that import reads
``from tests.reports import make_body, make_report``. Works in a source checkout
only (``tests`` is not shipped).
"""

from __future__ import annotations

from tests.reports import make_body, make_report

__all__ = ["make_body", "make_report"]
