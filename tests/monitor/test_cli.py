"""The trainvitals CLI: serve and replay, against a real collector."""

from __future__ import annotations

import json
import math
import os
import sys

import httpx
import pytest
from click.testing import CliRunner

from tests.reports import make_body, make_report, make_sample
from tests.support import dead_url, free_port, running_collector, running_process
from trainvitals.monitor.cli import main
from trainvitals.monitor.settings import Settings


def write_jsonl(path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_serve_help():
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--config", "--host", "--port", "--token-file", "9477"):
        assert option in result.output


def test_serve_with_a_bad_config_names_the_file_and_field(tmp_path):
    config = tmp_path / "collector.yaml"
    config.write_text("port: not-a-port\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 1
    assert f"{config}: port: Input should be a valid integer" in result.output
    assert "Traceback" not in result.output


def test_replay_sends_both_line_forms(tmp_path):
    lines = [
        make_report("replayed", 10, [make_sample("loss", 2.0, modality="text")]),
        make_body(
            make_report("replayed", 20, [make_sample("grad_norm", math.nan, group="all")]),
            make_report("replayed", 30, [make_sample("loss", 1.0, modality="text")]),
        ),
    ]
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")  # NaN as JSON NaN
    with running_collector() as collector:
        result = CliRunner().invoke(main, ["replay", str(path), "--collector", collector.url, "--batch-size", "2"])
        assert result.exit_code == 0, result.output
        assert "3 reports" in result.output
        store = collector.app.state.store
        [run] = store.runs()
        assert run.step == 30
        assert math.isnan(store.get("replayed", "grad_norm", {"group": "all"}))


def test_replay_with_token(tmp_path):
    path = write_jsonl(tmp_path / "run.jsonl", [make_report("a", 1)])
    token_file = tmp_path / "token"
    token_file.write_text("tok\n")
    with running_collector(Settings(token="tok", state_path=None)) as collector:
        url = collector.url
        refused = CliRunner().invoke(main, ["replay", path, "--collector", url])
        assert refused.exit_code == 1
        assert "HTTP 401: missing bearer token" in refused.output
        assert "Traceback" not in refused.output
        ok = CliRunner().invoke(main, ["replay", path, "--collector", url, "--token-file", str(token_file)])
        assert ok.exit_code == 0, ok.output
        ok = CliRunner().invoke(main, ["replay", path, "--collector", url, "--token", "tok"])
        assert ok.exit_code == 0, ok.output


def test_replay_reports_a_refusal_with_lines_and_detail(tmp_path):
    reports = [make_report("a", i, [make_sample("param_max", 1.0, param=f"p{i}")]) for i in range(6)]
    path = write_jsonl(tmp_path / "run.jsonl", reports)
    with running_collector(Settings(max_series=5, state_path=None)) as collector:
        result = CliRunner().invoke(main, ["replay", path, "--collector", collector.url, "--batch-size", "2"])
    assert result.exit_code == 1
    assert "refused lines 3-4" in result.output and "series limit" in result.output
    assert "(2 reports accepted before)" in result.output


def test_replay_names_a_bad_line(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(make_report("a", 1)) + "\n" + '{"run": "a", "step": -1, "time": 1}\n')
    result = CliRunner().invoke(main, ["replay", str(path), "--collector", "http://127.0.0.1:1"])
    assert result.exit_code == 1
    assert f"{path}:2: step: Input should be greater than or equal to 0" in result.output


def test_replay_connection_error_is_a_clear_message(tmp_path):
    path = write_jsonl(tmp_path / "run.jsonl", [make_report("a", 1)])
    url = dead_url()
    result = CliRunner().invoke(main, ["replay", path, "--collector", url])
    assert result.exit_code == 1
    assert f"cannot reach the collector at {url}/v1/reports" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_serve_runs_the_collector(tmp_path):
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("tok-5f3a9c")
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", "from trainvitals.monitor.cli import main; main()"]
    # The default state file lives under XDG_STATE_HOME: here, this test's folder.
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")}
    with (
        running_process(
            [*cmd, "serve", "--port", str(port), "--token-file", str(token_file)],
            log=log,
            ready_url=f"http://127.0.0.1:{port}/readyz",
            what="trainvitals serve",
            timeout=60,
            env=env,
        ),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c,
    ):
        assert c.post("/v1/reports", json=make_body()).status_code == 401
        ok = c.post("/v1/reports", json=make_body(), headers={"Authorization": "Bearer tok-5f3a9c"})
        assert ok.status_code == 202
    out = log.read_text()
    assert f"http://127.0.0.1:{port}" in out
    state = tmp_path / "xdg" / "trainvitals" / "collector.sqlite3"
    assert f"state in {state}" in out and state.is_file()
    assert "tok-5f3a9c" not in out
