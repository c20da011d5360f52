"""The public surface of trainvitals.alerts, and what importing it costs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trainvitals.alerts as alerts_pkg

EXPECTED = {
    "Alert",
    "AlertService",
    "AlertState",
    "Condition",
    "Dispatcher",
    "Engine",
    "EventRule",
    "LocalEvaluator",
    "Notification",
    "Notifier",
    "NotifierConfigError",
    "NotifyError",
    "RetryPolicy",
    "Rule",
    "RuleError",
    "SilenceRule",
    "ThresholdRule",
    "Transition",
    "build_notifiers",
    "export_prometheus",
    "load_rules",
    "resolve_rules",
}


def test_all_is_what_we_mean_and_resolves():
    assert set(alerts_pkg.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(alerts_pkg, name) is not None
    from trainvitals.alerts.cli import rules

    assert rules.name == "rules" and set(rules.commands) == {"check", "export"}


def test_no_torch_anywhere_in_alerts():
    folder = Path(alerts_pkg.__file__).parent
    for path in folder.rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path


def test_importing_everything_pulls_no_torch_and_the_evaluator_stays_light():
    code = (
        "import sys\n"
        "from trainvitals.alerts import LocalEvaluator\n"
        "LocalEvaluator('default')\n"
        "light = not any(m in sys.modules for m in ('httpx', 'prometheus_client', 'torch'))\n"
        "import trainvitals.alerts.service, trainvitals.alerts.cli, trainvitals.alerts.export\n"
        "print(light, [m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "[]"]
