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


def test_demo_ends_naming_the_pages_to_open_and_its_start_line_tells_the_truth():
    res = CliRunner().invoke(main, ["demo", "--no-serve", "--port", "0", "--steps", "25"])
    assert res.exit_code == 0, res.output
    tail = res.output[res.output.index("The demo's collector stops now") :]
    for page in ("/ ", "/runs/demo ", "/v1/alerts ", "/metrics "):
        assert f"http://127.0.0.1:PORT{page}" in tail, tail
    # loss is reported from the first step: the start line must not say it was not requested
    assert "not requested: loss" not in res.output and "not requested: loss" not in res.stderr
