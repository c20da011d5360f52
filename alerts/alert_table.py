"""The alerts the engine holds: one instance per (rule, series), bounded per rule and run.

:class:`AlertTable` keys each :class:`~trainvitals.alerts.instances.AlertInstance` by
``(rule index, run, rank, label items)``, keeps the counts the ingest loop reads (how
many instances each rule holds anywhere: with none, a healthy value needs no lookup)
and the bound: past ``max_alerts_per_rule`` alerts of one rule in one run, a rule keyed
on a free label (one alert per value) opens no more; they are counted in
:attr:`~AlertTable.suppressed` and said once per rule and run. Event rules' instances
are also filed per (run, rank), for their holds. Not thread-safe: the engine's lock
guards it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from trainvitals.alerts.instances import AlertInstance
from trainvitals.alerts.model import Rule
from trainvitals.alerts.state import LabelItems
from trainvitals.wire import series_labels

__all__ = ["DEFAULT_MAX_ALERTS_PER_RULE", "AlertKey", "AlertTable"]

log = logging.getLogger("trainvitals.alerts")

DEFAULT_MAX_ALERTS_PER_RULE = 64
"""Alerts one rule may hold in one run (firing, pending or recently resolved) before more
are only counted: a rule keyed on a free label otherwise opens one alert per value."""

AlertKey = tuple[int, str, int, LabelItems]
"""(rule index, run, rank, the series' labels as sorted items)."""


class AlertTable:
    """Instances by key, their counts per rule and per (rule, run), the bound."""

    def __init__(self, rule_count: int, max_alerts_per_rule: int = DEFAULT_MAX_ALERTS_PER_RULE) -> None:
        if max_alerts_per_rule < 1:
            raise ValueError(f"max_alerts_per_rule must be at least 1, got {max_alerts_per_rule}")
        self.max_alerts_per_rule = max_alerts_per_rule
        self.instances: dict[AlertKey, AlertInstance] = {}
        # Instances per rule: with none, a value short of the threshold needs no state lookup.
        self.live = [0] * rule_count
        # (run, rank) -> event-rule instances of that run, for holds.
        self.event_instances: dict[tuple[str, int], dict[tuple[Any, ...], AlertInstance]] = {}
        # (rule index, run) -> alerts held; past the bound new ones are counted, not opened.
        self._per_rule_run: dict[tuple[int, str], int] = {}
        self._flooded: set[tuple[int, str]] = set()  # said once per rule and run
        self.suppressed: dict[str, int] = {}
        """Alerts not opened past ``max_alerts_per_rule``, by alert name."""

    def bounded(
        self, key: tuple[Any, ...], rule: Rule, labels: Mapping[str, str], run: str, rank: int
    ) -> AlertInstance | None:
        """A new alert of ``rule`` in ``run``, unless the rule holds ``max_alerts_per_rule``
        there already (a rule on a free label: one alert per value): then None, counted in
        :attr:`suppressed` and logged once per rule and run."""
        held = self._per_rule_run.get((key[0], run), 0)
        if held >= self.max_alerts_per_rule:
            self.suppressed[rule.alert] = self.suppressed.get(rule.alert, 0) + 1
            if (key[0], run) not in self._flooded:
                self._flooded.add((key[0], run))
                log.warning(
                    "rule %s holds %d alerts in run %r (max_alerts_per_rule): further ones in this run "
                    "are not opened or paged, only counted in trainvitals_alerts_suppressed_total",
                    rule.alert,
                    held,
                    run,
                )
            return None
        return self.new(key, rule, series_labels(run, rank, labels), run)

    def new(self, key: tuple[Any, ...], rule: Rule, labels: dict[str, str], run: str) -> AlertInstance:
        """A new alert, whatever the bound (RunSilent's one per run; a restart's)."""
        inst = self.instances[key] = AlertInstance(rule, key[0], labels, run, key)
        self.live[key[0]] += 1
        per = (key[0], run)
        self._per_rule_run[per] = self._per_rule_run.get(per, 0) + 1
        return inst

    def file_event(self, key: tuple[Any, ...], inst: AlertInstance) -> None:
        """File an event rule's alert under its run and rank, for its hold."""
        self.event_instances.setdefault((key[1], key[2]), {})[key] = inst

    def drop(self, key: tuple[Any, ...], inst: AlertInstance) -> None:
        """Forget one alert (inactive again, expired, or its run forgotten)."""
        del self.instances[key]
        self.live[key[0]] -= 1
        per = (key[0], inst.run)
        left = self._per_rule_run.get(per, 0) - 1
        if left > 0:
            self._per_rule_run[per] = left
        else:
            self._per_rule_run.pop(per, None)
        per_run = self.event_instances.get((key[1], key[2]))
        if per_run is not None:
            per_run.pop(key, None)

    def forget_run(self, run: str) -> None:
        """After the run's alerts were dropped: what the table kept about the run goes too."""
        self._flooded = {f for f in self._flooded if f[1] != run}
        for run_rank in [k for k in self.event_instances if k[0] == run]:
            del self.event_instances[run_rank]
