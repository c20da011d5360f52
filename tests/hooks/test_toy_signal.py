"""Adding a signal is one module and one line: a toy signal defined here (one ``Signal``
subclass with its ``SignalSpec``) and registered with one ``register(...)`` line shows,
with no other edit, in coverage (the start line, ``monitor.coverage``, the reports),
in live settings (``signals=`` and ``PUT /v1/runs/{run}/settings``), on a real
collector's ``/metrics`` (port 0), in the metric reference and on the dashboards.
Every figure is checked against the parameters read back in the test."""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from tests.support import metric_series, metric_value, one_torch_thread, running_collector, wait_until
from trainvitals.hooks import attach
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.registry import register, unregister
from trainvitals.hooks.step import StepContext
from trainvitals.wire.coverage import SIGNALS
from trainvitals.wire.live_settings import BUILTIN_SIGNALS, parse_request
from trainvitals.wire.metrics import METRICS, MetricSpec
from trainvitals.wire.reference import reference_markdown
from trainvitals.wire.signals import SignalSpec

REPO = Path(__file__).resolve().parents[2]


class ToyRms(Signal):
    """The toy: the RMS over every parameter element after the optimizer step."""

    spec = SignalSpec(
        "toy_rms",
        "the RMS of every parameter element (a test's toy)",
        "signals= leaves out 'toy_rms'",
        group="toy_rms",
        title="Toy: parameter RMS",
        dashboard="trainvitals-params.json",
        selectable=True,
        metrics=(MetricSpec("toy_param_rms", "gauge", "RMS over every parameter element (toy).", "value"),),
    )

    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._params = [p for p in monitor.model.parameters() if p.requires_grad]
        return []

    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        squares = torch.stack([p.detach().float().pow(2).sum() for p in self._params]).sum()
        count = sum(p.numel() for p in self._params)
        ctx.emit("toy_param_rms", (squares / count).sqrt())


@pytest.fixture
def toy() -> Iterator[type[ToyRms]]:
    register(ToyRms)  # the one line
    try:
        yield ToyRms
    finally:
        unregister(ToyRms)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _rms(model: nn.Module) -> float:
    """The truth, in float64 from the parameters' values read back one by one."""
    values = [float(v) for p in model.parameters() for v in p.detach().double().reshape(-1)]
    return math.sqrt(sum(v * v for v in values) / len(values))


def _entry(coverage: list[dict], signal: str) -> dict:
    (entry,) = [e for e in coverage if e["signal"] == signal]
    return entry


def _dashboards_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("toy_dashboards_generate", REPO / "dashboards" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_registered_toy_signal_is_known_everywhere_with_no_other_edit(toy, caplog):
    caplog.set_level(logging.INFO, logger="trainvitals")
    assert "toy_rms" in SIGNALS and "toy_rms" in BUILTIN_SIGNALS
    model, opt = _model()
    with running_collector() as c:
        mon = attach(model, opt, run="toy", collector=c.url, every=1)
        # coverage: the start line says it is watched, and each report says it is active
        start = next(r.getMessage() for r in caplog.records if "run 'toy'" in r.getMessage())
        assert "toy_rms" in start.split(";")[0] and start.split(";")[0].startswith("trainvitals: run 'toy'"), start
        for _ in range(3):
            _step(model, opt)
        assert mon.flush(60)
        assert _entry(mon.latest_coverage(), "toy_rms") == {"signal": "toy_rms", "active": True}
        # /metrics: its figure, the catalogue's help line, and the coverage gauge
        text = c.metrics()
        got = metric_value(text, "trainvitals_toy_param_rms", run="toy")
        assert got == pytest.approx(_rms(model), rel=1e-6)
        assert "# HELP trainvitals_toy_param_rms RMS over every parameter element (toy)." in text
        assert metric_value(text, "trainvitals_signal_active", run="toy", signal="toy_rms") == 1.0
        mon.close()
    closing = [r.getMessage() for r in caplog.records if "run 'toy' closed after" in r.getMessage()]
    assert len(closing) == 1 and "toy_rms" in closing[0], closing


def test_live_settings_choose_the_toy_signal_like_a_built_in_one(toy):
    """``signals=`` leaves it out (coverage: not_requested, with the spec's words); a
    live settings change through the collector turns it on; a name never registered is
    still refused."""
    assert parse_request({"signals": ["toy_rms"]}).values() == {"signals": ["toy_rms"]}
    refusal = "signals.0: Input should be 'optimizer', 'params', 'adam', 'packing' or 'toy_rms'"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        parse_request({"signals": ["toy"]})
    model, opt = _model()
    with running_collector() as c:
        mon = attach(model, opt, run="live", collector=c.url, every=1, signals=("optimizer",))
        _step(model, opt)
        assert mon.flush(60)
        off = _entry(mon.latest_coverage(), "toy_rms")
        assert off == {
            "signal": "toy_rms",
            "active": False,
            "reason": "not_requested",
            "detail": ToyRms.spec.how_to_ask,
        }
        put = c.client.put("/v1/runs/live/settings", json={"signals": ["toy_rms"]})
        assert put.status_code == 200, put.text

        def toy_on() -> bool:
            _step(model, opt)
            assert mon.flush(60)
            cov = mon.latest_coverage()
            return _entry(cov, "toy_rms")["active"] and not _entry(cov, "optimizer")["active"]

        wait_until(toy_on, what="the live settings turning the toy signal on")
        series = metric_series(c.metrics(), "trainvitals_toy_param_rms")
        assert [dict(k)["run"] for k in series] == ["live"]
        mon.close()


def test_the_reference_and_the_dashboards_list_the_toy_metric(toy):
    doc = reference_markdown()
    section = doc.split("## Toy: parameter RMS\n", 1)[1].split("\n## ", 1)[0]
    assert "| `trainvitals_toy_param_rms` | gauge | value | - | RMS over every parameter element (toy). |" in section
    rendered = _dashboards_module().render()
    assert "trainvitals_toy_param_rms" in rendered["trainvitals-params.json"]
    assert not any(
        "trainvitals_toy_param_rms" in text for name, text in rendered.items() if name != "trainvitals-params.json"
    )


def test_unregistering_the_toy_leaves_the_built_in_lists_as_they_were():
    before = (list(SIGNALS), list(BUILTIN_SIGNALS), set(METRICS), reference_markdown())
    register(ToyRms)
    assert "toy_param_rms" in METRICS and list(SIGNALS)[-1] == "toy_rms"
    unregister(ToyRms)
    assert (list(SIGNALS), list(BUILTIN_SIGNALS), set(METRICS), reference_markdown()) == before
    with pytest.raises(ValueError, match="is built in"):
        unregister(type("Fake", (Signal,), {"covers": "optimizer"}))
