"""The command line when something is wrong: a rule on a metric no report carries, a
port already taken. One clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from trainvitals.monitor.cli import main

CLI = [sys.executable, "-c", "from trainvitals.monitor.cli import main; main()"]

RULE = """\
- alert: Fine
  metric: loss
  above: 1e6
  severity: info
  summary: fine
- alert: Typo
  metric: {primary}
  above: 10
  and:
    - metric: {condition}
      above: 2
  severity: page
  summary: "{{run}}"
"""


@pytest.mark.parametrize(
    "primary,condition,field,wrong,closest",
    [
        ("modality_los", "grad_norm", "metric", "modality_los", "modality_loss"),
        ("modality_loss", "grad_nrom", "and[0].metric", "grad_nrom", "grad_norm"),
    ],
)
def test_rules_check_refuses_an_unknown_metric_naming_file_rule_field_and_closest(
    tmp_path, primary, condition, field, wrong, closest
):
    path = tmp_path / "mine.yaml"
    path.write_text(RULE.format(primary=primary, condition=condition))
    result = CliRunner().invoke(main, ["rules", "check", str(path)])
    assert result.exit_code == 1
    assert result.output == (
        f"error: {path}: rule 'Typo' (#2): field '{field}': unknown metric '{wrong}': no report "
        f"carries it, so the rule would never fire; did you mean '{closest}'? (metrics: docs/metrics.md)\n"
    )


def test_rules_check_without_a_close_name_gives_no_suggestion(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(RULE.format(primary="zzzzqqq", condition="grad_norm"))
    result = CliRunner().invoke(main, ["rules", "check", str(path)])
    assert result.exit_code == 1 and "unknown metric 'zzzzqqq'" in result.output
    assert "did you mean" not in result.output


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [["serve"], ["demo", "--no-serve", "--steps", "25"]])
def test_a_taken_port_is_one_clear_line(command, taken_port, tmp_path):
    # XDG_STATE_HOME: serve's default state file would go there (it must not get that far).
    env = {"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [*CLI, *command, "--port", str(taken_port)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 1
    assert proc.stdout == ""  # serve prints its banner only once it listens
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"Error: 127.0.0.1:{taken_port} is already in use"), proc.stderr
    assert "--port" in line and "Traceback" not in proc.stderr
    if command[0] == "demo":
        assert "`trainvitals demo --port 0` picks a free port" in line
    assert not (tmp_path / "xdg").exists()  # nothing created before the bind failed


def test_an_unusable_state_location_is_one_clear_line(tmp_path):
    """The default state file under a folder that cannot be made: serve says where and what
    to do, before listening; memory, or a path of one's own, is the way out."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = {"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(blocker), "HOME": str(tmp_path)}
    proc = subprocess.run([*CLI, "serve", "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    state = blocker / "trainvitals" / "collector.sqlite3"
    assert line.startswith(f"Error: state_path '{state}': cannot create its folder"), proc.stderr
    assert "'memory'" in line and "Traceback" not in proc.stderr
