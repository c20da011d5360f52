"""No secret reaches a log line or an error message: a webhook URL with a token in its
query string (delivered and failing), a password in a notifier URL and in the client's
collector URL. The collector runs as `trainvitals serve` at DEBUG with its access log on
(what an operator's terminal or journal shows); the hooks' records are captured at DEBUG
in this process."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import httpx
import pytest

from tests.monitor.helpers import Recorder, body, promtool_clean, report, serve_process
from tests.support import dead_url, free_port, wait_until
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.sinks import HttpSink
from trainvitals.monitor.app import create_app
from trainvitals.monitor.settings import Settings, SettingsError

JSON = {"Content-Type": "application/json"}
CLI = [sys.executable, "-c", "from trainvitals.monitor.cli import main; main()"]
# Distinct, greppable secrets (none is a substring of another word the logs could hold).
HOOK_TOKEN = "hooktok7Qx2"
HOOK_SIG = "deadsig9Zp4"
NOTIFIER_PW = "notipw3Kd8"
SLACK_PATH = "T0SLACK/B0SLACK/slk5Wq1"
CLIENT_PW = "clipw6Mv5"
DEAD_CLIENT_PW = "deadpw2Hs7"
QUERY_TOKEN = "qtok4Rb9"
SECRETS = (HOOK_TOKEN, HOOK_SIG, NOTIFIER_PW, SLACK_PATH, CLIENT_PW, DEAD_CLIENT_PW, QUERY_TOKEN)

RULES = """\
- alert: LossHigh
  metric: modality_loss
  above: 10
  clear: 5
  severity: page
  summary: "loss {value:.0f} on {modality} in {run}"
"""


class _Ready:
    """What Sender.put takes: a report already materialized."""

    def __init__(self, data: dict) -> None:
        self.data, self.step = data, data["step"]

    def materialize(self) -> dict:
        return self.data


def _report(run: str, step: int, loss: float) -> _Ready:
    return _Ready(
        {
            "run": run,
            "step": step,
            "time": time.time(),
            "rank": 0,
            "events": [],
            "samples": [{"name": "modality_loss", "labels": {"modality": "text"}, "value": loss}],
        }
    )


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def test_no_secret_in_the_logs_of_the_collector_or_the_hooks(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    dead = dead_url()
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    with Recorder() as hook:
        config = tmp_path / "collector.yaml"
        config.write_text(
            f"state_path: memory\nlog_level: debug\naccess_log: true\nrules: [{rules}]\n"
            "alerts: {tick_interval: 0.2, resend_interval: 1}\n"
            "notifiers:\n"
            f"  - {{type: webhook, url: '{hook.url}/hook?token={HOOK_TOKEN}'}}\n"
            f"  - {{type: webhook, url: 'http://tv:{NOTIFIER_PW}@{hook.url[7:]}/pw?sig={HOOK_SIG}'}}\n"
            f"  - {{type: webhook, url: 'http://tv:{NOTIFIER_PW}@{dead[7:]}/hook?sig={HOOK_SIG}', timeout: 1}}\n"
            f"  - {{type: slack, webhook_url: '{dead}/services/{SLACK_PATH}', timeout: 1}}\n"
            f"  - {{type: alertmanager, url: 'http://am:{NOTIFIER_PW}@{dead[7:]}', timeout: 1}}\n"
        )
        port = free_port()
        log_path = tmp_path / "serve.log"
        with open(log_path, "wb") as log:
            proc = serve_process(config, port, log)
            try:
                url = f"http://127.0.0.1:{port}"
                # The hooks: a collector URL with a password, a dead one with another.
                good = Sender(HttpSink(f"http://tv:{CLIENT_PW}@127.0.0.1:{port}"), backoff=(0.05, 0.2))
                bad = Sender(HttpSink(f"http://tv:{DEAD_CLIENT_PW}@{dead[7:]}", timeout=1), backoff=(0.05, 0.2))
                lost = Sender(HttpSink(f"http://tv:{CLIENT_PW}@127.0.0.1:{port}/wrong/path"))  # answers 404
                for step, loss in ((1, 50.0), (2, 45.0), (3, 1.0)):  # fires, then resolves
                    for sender in (good, bad, lost):
                        sender.put(_report("leaky", step, loss))
                    assert good.flush(60)
                    time.sleep(0.5)
                lost.close(5)
                good.put(_Ready({**_report("leaky", 4, 1.0).data, "step": -1}))  # refused by the schema
                good.flush(5)
                refused = httpx.post(url + "/v1/reports", content=body(report("leaky", 5, [])) + b"x", headers=JSON)
                assert refused.status_code == 400
                # A token where it does not belong: in the query (the access log shows paths).
                assert httpx.get(f"{url}/v1/runs?token={QUERY_TOKEN}").status_code == 200
                # Delivered to the recorder with their secrets; the dead notifiers retried and failed.
                wait_until(
                    lambda: sorted(s for s, _, _ in hook.alerts()) == ["firing"] * 2 + ["resolved"] * 2,
                    60,
                    "pages and resolves",
                )
                assert sorted(set(hook.paths)) == [f"/hook?token={HOOK_TOKEN}", f"/pw?sig={HOOK_SIG}"]
                # The failing notifiers' retries and warnings: waited for in the log, as a
                # loaded machine takes longer to reach them.
                wait_until(lambda: "gave up" in log_path.read_text(), 60, "a dead notifier giving up")
                bad.close(1)
                good.close(5)
                metrics = httpx.get(url + "/metrics").content
            finally:
                proc.terminate()
                proc.wait(10)
    served = log_path.read_text()
    # It did log those paths: alerts, deliveries (httpx: each URL), failures, requests.
    assert "LossHigh" in served and "gave up" in served and "/pw?sig=***" in served, served[-3000:]
    assert "GET /v1/runs?token=***" in served, served[-3000:]
    assert _leaks(served) == [], served
    records = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    # The hooks did log their failures (and httpx every request URL).
    assert "unreachable" in records and "/wrong/path/v1/reports answered 404" in records
    assert "http://tv:***@127.0.0.1" in records
    assert _leaks(records) == [], records
    assert _leaks(repr(good) + repr(bad)) == []
    promtool_clean(metrics)


@pytest.mark.parametrize(
    "notifier",
    [
        {"type": "webhook", "url": f"http://127.0.0.1:1/hook?token={HOOK_TOKEN}", "timeout": "soon"},
        {"type": "webhook", "url": f"ftp://tv:{NOTIFIER_PW}@127.0.0.1/hook?token={HOOK_TOKEN}"},
        {"type": "slack", "webhook_url": f"ftp://127.0.0.1/services/{SLACK_PATH}"},
        {"type": "alertmanager", "url": f"http://tv:{NOTIFIER_PW}@127.0.0.1:1", "colour": "red"},
    ],
)
def test_a_bad_notifier_config_is_refused_without_its_secrets(notifier, tmp_path):
    with pytest.raises(SettingsError) as refused:
        create_app(Settings(notifiers=[notifier], state_path=None))
    assert "notifiers" in str(refused.value) and _leaks(str(refused.value)) == [], str(refused.value)
    config = tmp_path / "collector.yaml"
    config.write_text(f"state_path: memory\nport: 0\nnotifiers: [{notifier!r}]\n".replace("'", '"'))
    # A process of its own: serve installs log filters process-wide.
    result = subprocess.run([*CLI, "serve", "--config", str(config)], capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output and "notifiers" in output, output
    assert _leaks(output) == [], output
