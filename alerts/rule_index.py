"""The engine's rules, indexed for the ingest loop: matchers compiled, rules by what they read.

:class:`RuleIndex` checks that it was given rule objects, compiles every label matcher
into a predicate once, and files the rules by what a report carries: threshold rules
by metric (:class:`CompiledRule`), event rules by event kind, silence rules apart. Its
``interest`` map answers, with one dict lookup per sample, which threshold rules watch
a metric and whether an ``and`` condition reads it (:mod:`trainvitals.alerts.engine`
walks a report's samples through it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from os import PathLike

from trainvitals.alerts.conditions import LabelPredicate
from trainvitals.alerts.model import RULE_TYPES, Condition, EventRule, Matcher, Rule, SilenceRule, ThresholdRule

__all__ = ["CompiledRule", "RuleIndex", "compile_matchers", "rule_objects"]


@dataclass(eq=False)
class CompiledRule:
    """A threshold rule with its matchers compiled."""

    index: int
    rule: ThresholdRule
    match: LabelPredicate | None
    conditions: list[tuple[Condition, LabelPredicate | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # For the ingest loop: a plain-value rule can skip a sample on its value alone.
        self.plain = self.rule.transform == "value"
        self.above = self.rule.above
        self.below = self.rule.below


def compile_matchers(matchers: Iterable[Matcher]) -> LabelPredicate:
    """One predicate over a series' labels: every matcher holds (a label absent reads as "")."""
    preds = [(m.name, m.compile()) for m in matchers]
    if not preds:
        return lambda labels: True
    return lambda labels: all(pred(labels.get(name)) for name, pred in preds)


def rule_objects(rules: Iterable[Rule]) -> list[Rule]:
    """``rules`` as a list, refusing anything that is not a rule object (a name, a path)."""
    if rules is None or isinstance(rules, str | bytes | PathLike):
        raise TypeError(
            f"Engine takes rule objects, not {rules!r}: resolve names, files and folders first with resolve_rules()"
        )
    out = list(rules)
    for i, rule in enumerate(out, start=1):
        if not isinstance(rule, RULE_TYPES):
            raise TypeError(
                f"Engine rule #{i} is a {type(rule).__name__}, not a rule object "
                "(ThresholdRule, EventRule or SilenceRule); see resolve_rules()"
            )
    return out


class RuleIndex:
    """The rules by what they read; a rule's index is its position in ``rules``."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules: list[Rule] = rule_objects(rules)
        self.by_metric: dict[str, list[CompiledRule]] = {}
        self.by_event: dict[str, list[tuple[int, EventRule, LabelPredicate]]] = {}
        self.silence: list[tuple[int, SilenceRule]] = []
        and_metrics: set[str] = set()
        for i, rule in enumerate(self.rules):
            if isinstance(rule, ThresholdRule):
                c = CompiledRule(
                    i,
                    rule,
                    compile_matchers(rule.labels) if rule.labels else None,
                    [(cond, compile_matchers(cond.labels) if cond.labels else None) for cond in rule.and_],
                )
                self.by_metric.setdefault(rule.metric, []).append(c)
                and_metrics.update(cond.metric for cond in rule.and_)
            elif isinstance(rule, EventRule):
                self.by_event.setdefault(rule.event, []).append((i, rule, compile_matchers(rule.labels)))
            else:
                self.silence.append((i, rule))
        # metric -> (threshold rules on it, whether `and` conditions read it): one
        # dict lookup per sample on the ingest path.
        self.interest: dict[str, tuple[list[CompiledRule], bool]] = {
            name: (self.by_metric.get(name, []), name in and_metrics) for name in set(self.by_metric) | and_metrics
        }
        self.has_events = any(isinstance(r, EventRule) for r in self.rules)
        self.by_name: dict[str, list[int]] = {}
        """Alert name -> the indexes of the rules of that name (a restart finds its rule by it)."""
        for i, rule in enumerate(self.rules):
            self.by_name.setdefault(rule.alert, []).append(i)
