"""`trainvitals demo` end to end: the I1 alert fires on the bug and resolves on the fix."""

from __future__ import annotations

from click.testing import CliRunner

from trainvitals.monitor.cli import main


def test_demo_fires_then_resolves_and_nothing_else_fires():
    res = CliRunner().invoke(main, ["demo", "--no-serve", "--port", "0", "--steps", "30"])
    assert res.exit_code == 0, res.output
    assert "GradientDilution fired by step" in res.output
    assert "resolved by step" in res.output
    assert "Other alerts seen" not in res.output
    assert " 17.0x" in res.output and "16.00%" in res.output
