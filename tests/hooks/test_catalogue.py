"""The catalogue of built-in signals the collector reads (``wire/builtin_signals.py``) is
generated from the specs the signal classes declare: it is current, and a built-in-style
declaration (with metrics of its own) goes through the generator into the torch-free
registry, the metric catalogue and the reference unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainvitals.hooks.signals.base import Signal
from trainvitals.hooks.signals.builtin import BUILTIN
from trainvitals.hooks.signals.catalogue import REGENERATE, catalogue_source, declared_specs
from trainvitals.wire.builtin_signals import BUILTIN_SPECS
from trainvitals.wire.metrics import MetricSpec
from trainvitals.wire.signals import SignalSpec, spec_of

REPO = Path(__file__).resolve().parents[2]


class ToyBuiltin(Signal):
    """A new signal declared the way a built-in one is: its spec and its metrics on the class."""

    spec = SignalSpec(
        "toy_act",
        'per-layer activation RMS (a test\'s "toy")',
        "signals= leaves out 'toy_act'",
        group="toy_act",
        title="Toy: activations",
        dashboard="trainvitals-params.json",
        selectable=True,
        per_param_series=True,
        metrics=(
            MetricSpec("toy_act_rms", "gauge", "RMS of a layer's output (toy).", "value", ("layer",)),
            MetricSpec("toy_act_dead_total", "counter", "Layers whose output was all zero.", "count", ("a", "b")),
        ),
    )
    covers = spec.name


def test_the_generated_catalogue_is_current():
    text = (REPO / "wire" / "builtin_signals.py").read_text(encoding="utf-8")
    assert text == catalogue_source(), f"wire/builtin_signals.py is out of date; run: {REGENERATE}"


def test_the_registry_holds_each_built_in_class_spec_in_coverage_order():
    assert BUILTIN_SPECS == declared_specs(BUILTIN)
    for cls in BUILTIN:
        assert cls.spec is not None and spec_of(cls.spec.name) == cls.spec
        if issubclass(cls, Signal):
            assert cls.covers == cls.spec.name


def test_a_built_in_style_declaration_round_trips_through_the_generator(tmp_path):
    source = catalogue_source((*BUILTIN, ToyBuiltin))
    namespace: dict[str, object] = {}
    exec(compile(source, "builtin_signals.py", "exec"), namespace)
    generated = namespace["BUILTIN_SPECS"]
    assert isinstance(generated, tuple) and generated[:-1] == BUILTIN_SPECS
    toy = generated[-1]
    # the same declaration, its metrics filed under its group
    assert toy == SignalSpec(
        **{f: getattr(ToyBuiltin.spec, f) for f in ToyBuiltin.spec.__dataclass_fields__ if f != "metrics"},
        metrics=(
            MetricSpec("toy_act_rms", "gauge", "RMS of a layer's output (toy).", "value", ("layer",), group="toy_act"),
            MetricSpec(
                "toy_act_dead_total",
                "counter",
                "Layers whose output was all zero.",
                "count",
                ("a", "b"),
                "hooks",
                "toy_act",
            ),
        ),
    )
    # a collector's process with this catalogue in place of the file knows the signal and its
    # metrics (torch-free: the wire side only)
    (tmp_path / "catalogue.py").write_text(source, encoding="utf-8")
    probe = f"""
import importlib.util, json, sys
class Catalogue:  # the generated text stands in for wire/builtin_signals.py
    def find_spec(self, name, path=None, target=None):
        if name == "trainvitals.wire.builtin_signals":
            return importlib.util.spec_from_file_location(name, {str(tmp_path / "catalogue.py")!r})
        return None
sys.meta_path.insert(0, Catalogue())
from trainvitals.wire.coverage import SIGNALS
from trainvitals.wire.live_settings import BUILTIN_SIGNALS
from trainvitals.wire.metrics import METRICS
from trainvitals.wire.reference import reference_markdown
print(json.dumps({{
    "signals": list(SIGNALS), "selectable": list(BUILTIN_SIGNALS),
    "metrics": {{n: [m.group, list(m.labels)] for n, m in METRICS.items() if n.startswith("toy_")}},
    "reference": "Toy: activations" in reference_markdown() and "toy_act_dead_total" in reference_markdown(),
    "torch": "torch" in sys.modules,
}}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    seen = json.loads(out.stdout)
    assert seen == {
        "signals": [s.name for s in BUILTIN_SPECS] + ["toy_act"],
        "selectable": [s.name for s in BUILTIN_SPECS if s.selectable] + ["toy_act"],
        "metrics": {"toy_act_rms": ["toy_act", ["layer"]], "toy_act_dead_total": ["toy_act", ["a", "b"]]},
        "reference": True,
        "torch": False,
    }


def test_a_built_in_class_without_a_spec_is_refused_by_name():
    class Bare(Signal):
        pass

    with pytest.raises(ValueError, match="Bare: a built-in signal declares its SignalSpec"):
        catalogue_source((*BUILTIN, Bare))
    with pytest.raises(ValueError, match="ToyBuiltin: signal 'toy_act' is declared twice"):
        catalogue_source((ToyBuiltin, ToyBuiltin))
