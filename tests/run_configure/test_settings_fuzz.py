"""The live-settings routes under the schema fuzzer: schemathesis (its CLI, every check)
against a real collector, from its own ``/openapi.json``, on ``/v1/runs/{run}/settings``
only: every answer documented, no server error, a body valid against the schema taken
and an invalid one refused (the collector's own routes: tests/monitor)."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.monitor.test_fuzz_and_load import EXCLUDED_CHECKS, SCHEMATHESIS, SCHEMATHESIS_CONFIG, _StatusCount
from tests.reports import make_body, make_report
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings


@pytest.mark.slow  # a fuzzer run: minutes
def test_schemathesis_finds_nothing_on_the_settings_routes(tmp_path):
    app = create_app(Settings(state_path=None))
    counted = _StatusCount(app)
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    report = tmp_path / "schemathesis.json"
    with serve_in_thread(counted, settings=app.state.settings) as url:
        # A run the fuzzer's first run names hit ("0"), so valid settings are also taken.
        httpx.post(f"{url}/v1/reports", json=make_body(make_report("0"))).raise_for_status()
        proc = subprocess.run(
            [
                *SCHEMATHESIS,
                "--config-file",
                str(config),
                "--no-color",
                "run",
                f"{url}/openapi.json",
                "--checks",
                "all",
                *EXCLUDED_CHECKS,
                "-n",
                "25",
                "--seed",
                "1",
                "--phases",
                "coverage,fuzzing",
                "--generation-database",
                "none",
                "--report",
                "json",
                "--report-json-path",
                str(report),
                "--include-path-regex",
                "/settings$",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
    result = json.loads(report.read_text())
    cases = result["test_cases"]
    server_errors = sum(n for status, n in counted.statuses.items() if status >= 500)
    figures = (
        f"{result['operations']['tested']} operations, {cases['generated']} cases, "
        f"{cases['with_failures']} with failures, {cases['errored']} errored; answers "
        f"{dict(sorted(counted.statuses.items()))}"
    )
    assert proc.returncode == 0 and cases["with_failures"] == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert server_errors == 0 and cases["errored"] == 0, figures
    assert result["operations"]["tested"] == 3 and cases["generated"] >= 50, figures
    # Both directions: answers given (200) and requests refused (422).
    assert counted.statuses[200] > 0 and counted.statuses[422] > 0, figures
