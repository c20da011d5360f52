"""A signal's declaration, :class:`SignalSpec`: plain data, no torch.

Apart from the registry (:mod:`trainvitals.wire.signals`) so that the generated
catalogue of the built-in signals (:mod:`trainvitals.wire.builtin_signals`) can name it
without importing the registry that reads that catalogue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainvitals.wire.metrics import MetricSpec

__all__ = ["OVERVIEW_DASHBOARD", "SignalSpec"]

OVERVIEW_DASHBOARD = "trainvitals-overview.json"
"""The dashboard a signal's uncurated metrics go on unless its spec names another."""

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class SignalSpec:
    """One signal, as everything but its own measuring code sees it."""

    name: str
    """Its coverage name (``trainvitals_signal_active{signal=...}``) and, when
    :attr:`selectable`, its ``signals=`` name: lower case, digits, ``_``; 32 at most."""
    covers: str
    """What it measures, in a few words (the coverage documentation)."""
    how_to_ask: str
    """The coverage detail while it does not run (reason ``not_requested``): what would start it."""
    group: str | None = None
    """Its group in the metric catalogue, its own name or None (:data:`trainvitals.wire.metrics.METRICS`), the
    figures whose arrival the verdict counts for it in reports from before coverage;
    None: it reports under another signal's group (``probe`` under ``loss``)."""
    title: str = ""
    """The heading of its group in the metric reference (``docs/metrics.md``)."""
    dashboard: str = OVERVIEW_DASHBOARD
    """The dashboard file its group's metrics without a curated panel go on."""
    selectable: bool = False
    """It runs from attach unless ``signals=`` (or a live settings change) leaves it out;
    False: a call of the job's starts it (``first_call``) or an option does."""
    first_call: str | None = None
    """The job's call that starts it (``track_loss()``): at attach it is "not requested yet"."""
    per_parameter_sums: bool = False
    """Its figures sum per-parameter pieces over ranks: it is withheld (coverage
    ``sharded``) when the parameters' layout over ranks is not understood."""
    per_param_series: bool = False
    """It chooses its per-parameter series when it binds (``per_param=``): a live settings
    change of ``per_param`` binds it again."""
    metrics: tuple[MetricSpec, ...] = field(default=())
    """Metrics it adds to the catalogue (their group is set to :attr:`group`). The
    built-in signals that predate this field keep theirs in the catalogue itself
    (:mod:`trainvitals.wire.metrics`), under their group; a new one declares them here."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"signal name {self.name!r}: lower case letters, digits and _ (a letter first), 32 at most"
            )
        if self.group not in (None, self.name):
            raise ValueError(f"signal {self.name!r}: its metric group is its name, or None (got {self.group!r})")
        if self.metrics and self.group is None:
            raise ValueError(f"signal {self.name!r}: metrics need a group to be listed under")
