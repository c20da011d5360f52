"""The signal registry: the built-in declarations are the lists the wire used to spell
out, and a bad registration is refused with a clear error, changing nothing."""

from __future__ import annotations

import pytest

from trainvitals.wire.coverage import SIGNALS
from trainvitals.wire.live_settings import BUILTIN_SIGNALS
from trainvitals.wire.metrics import METRICS, MetricSpec
from trainvitals.wire.signals import (
    SignalSpec,
    metric_groups,
    register_spec,
    signal_specs,
    spec_of,
    unregister_spec,
)


def _snapshot() -> tuple[object, ...]:
    return (signal_specs(), dict(METRICS), list(SIGNALS), list(BUILTIN_SIGNALS))


def test_the_built_in_declarations_give_the_lists_the_wire_spelled_out():
    assert list(SIGNALS) == ["optimizer", "params", "adam", "loss", "probe", "softmax", "packing"]
    assert SIGNALS == ("optimizer", "params", "adam", "loss", "probe", "softmax", "packing")
    assert list(BUILTIN_SIGNALS) == ["optimizer", "params", "adam", "packing"]
    assert [s.name for s in metric_groups()] == ["optimizer", "loss", "params", "adam", "softmax", "packing"]
    # every signal group has metrics in the catalogue, and every catalogue group is a signal or the rest
    groups = {m.group for m in METRICS.values()}
    assert {s.group for s in metric_groups()} <= groups
    assert groups - {s.name for s in metric_groups()} == {"run", "client", "collector"}


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: SignalSpec("Toy", "x", "y"), "lower case"),
        (lambda: SignalSpec("toy", "x", "y", group="other"), "its metric group is its name"),
        (lambda: SignalSpec("toy", "x", "y", metrics=(MetricSpec("toy_x", "gauge", "h", "value"),)), "need a group"),
    ],
)
def test_a_malformed_spec_is_refused_where_it_is_made(make, problem):
    with pytest.raises(ValueError, match=problem):
        make()


@pytest.mark.parametrize(
    "spec, problem",
    [
        (SignalSpec("loss", "another loss", "y"), "'loss' is registered already"),
        (
            SignalSpec("toy", "x", "y", group="toy", metrics=(MetricSpec("grad_norm", "gauge", "h", "norm"),)),
            "metric 'grad_norm' is in the catalogue already",
        ),
        (
            SignalSpec(
                "toy",
                "x",
                "y",
                group="toy",
                metrics=(MetricSpec("toy_x", "gauge", "h", "value"), MetricSpec("toy_x", "gauge", "h", "value")),
            ),
            "declared twice",
        ),
    ],
)
def test_a_clashing_registration_is_refused_changing_nothing(spec, problem):
    before = _snapshot()
    with pytest.raises(ValueError, match=problem):
        register_spec(spec)
    assert _snapshot() == before


def test_registering_adds_the_metrics_under_the_signal_and_unregistering_takes_them_back():
    before = _snapshot()
    spec = register_spec(
        SignalSpec("toy", "x", "y", group="toy", selectable=True, metrics=(MetricSpec("toy_x", "gauge", "h", "x"),))
    )
    try:
        assert METRICS["toy_x"].group == "toy" and spec.metrics == (METRICS["toy_x"],)
        assert spec_of("toy") is spec and "toy" in SIGNALS and "toy" in BUILTIN_SIGNALS
        assert register_spec(spec) is spec  # the same declaration again: a no-op
    finally:
        unregister_spec("toy")
    assert _snapshot() == before
    with pytest.raises(ValueError, match="built in"):
        unregister_spec("loss")


def test_every_coverage_reason_is_documented_and_has_a_headline_word():
    """The closed list of reasons is the wire's: each one has a row in docs/wire.md's
    table and a few words for a verdict's headline (a reason added, e.g.
    ``ranks_disagree``, is said everywhere a user reads it)."""
    from pathlib import Path

    from trainvitals.alerts.verdict_text import _WHY_NOT
    from trainvitals.wire.coverage import REASONS

    table = (Path(__file__).resolve().parents[2] / "docs" / "wire.md").read_text()
    assert "ranks_disagree" in REASONS
    missing = [r for r in REASONS if f"| `{r}` |" not in table]
    assert not missing, f"docs/wire.md has no row for the coverage reasons {missing}"
    assert set(_WHY_NOT) == set(REASONS)
