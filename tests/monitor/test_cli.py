"""The trainvitals CLI: serve and replay, against a real collector."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner

from tests.reports import make_body, make_report
from trainvitals.monitor.cli import main
from trainvitals.monitor.settings import Settings


def sample(name: str, value: float, **labels: str) -> dict:
    return {"name": name, "labels": labels, "value": value}


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


def test_replay_sends_both_line_forms(tmp_path, running_collector):
    lines = [
        make_report("replayed", 10, [sample("loss", 2.0, modality="text")]),
        make_body(
            make_report("replayed", 20, [sample("grad_norm", math.nan, group="all")]),
            make_report("replayed", 30, [sample("loss", 1.0, modality="text")]),
        ),
    ]
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")  # NaN as JSON NaN
    with running_collector() as (url, app):
        result = CliRunner().invoke(
            main, ["replay", str(path), "--collector", url, "--batch-size", "2"]
        )
        assert result.exit_code == 0, result.output
        assert "3 reports" in result.output
        [run] = app.state.store.runs()
        assert run.step == 30
        assert math.isnan(app.state.store.get("replayed", "grad_norm", {"group": "all"}))


def test_replay_with_token(tmp_path, running_collector):
    path = write_jsonl(tmp_path / "run.jsonl", [make_report("a", 1)])
    token_file = tmp_path / "token"
    token_file.write_text("tok\n")
    with running_collector(Settings(token="tok")) as (url, _):
        refused = CliRunner().invoke(main, ["replay", path, "--collector", url])
        assert refused.exit_code == 1
        assert "HTTP 401: missing bearer token" in refused.output
        assert "Traceback" not in refused.output
        ok = CliRunner().invoke(
            main, ["replay", path, "--collector", url, "--token-file", str(token_file)]
        )
        assert ok.exit_code == 0, ok.output
        ok = CliRunner().invoke(main, ["replay", path, "--collector", url, "--token", "tok"])
        assert ok.exit_code == 0, ok.output


def test_replay_reports_a_refusal_with_lines_and_detail(tmp_path, running_collector):
    reports = [make_report("a", i, [sample("param_max", 1.0, param=f"p{i}")]) for i in range(6)]
    path = write_jsonl(tmp_path / "run.jsonl", reports)
    with running_collector(Settings(max_series=5)) as (url, _):
        result = CliRunner().invoke(main, ["replay", path, "--collector", url, "--batch-size", "2"])
    assert result.exit_code == 1
    assert "refused lines 3-4" in result.output and "series limit" in result.output
    assert "(2 reports accepted before)" in result.output


def test_replay_names_a_bad_line(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(
        json.dumps(make_report("a", 1)) + "\n" + '{"run": "a", "step": -1, "time": 1}\n'
    )
    result = CliRunner().invoke(main, ["replay", str(path), "--collector", "http://127.0.0.1:1"])
    assert result.exit_code == 1
    assert f"{path}:2: step: Input should be greater than or equal to 0" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_replay_connection_error_is_a_clear_message(tmp_path):
    path = write_jsonl(tmp_path / "run.jsonl", [make_report("a", 1)])
    url = f"http://127.0.0.1:{_free_port()}"
    result = CliRunner().invoke(main, ["replay", path, "--collector", url])
    assert result.exit_code == 1
    assert f"cannot reach the collector at {url}/v1/reports" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_serve_runs_the_collector(tmp_path):
    port = _free_port()
    token_file = tmp_path / "token"
    token_file.write_text("tok-5f3a9c")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    cmd = [sys.executable, "-c", "from trainvitals.monitor.cli import main; main()"]
    proc = subprocess.Popen(
        [*cmd, "serve", "--port", str(port), "--token-file", str(token_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            while True:
                try:
                    if c.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.1)
            assert c.post("/v1/reports", json=make_body()).status_code == 401
            ok = c.post(
                "/v1/reports", json=make_body(), headers={"Authorization": "Bearer tok-5f3a9c"}
            )
            assert ok.status_code == 202
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}" in out.decode()
    assert "tok-5f3a9c" not in out.decode()
