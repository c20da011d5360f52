"""The collector under a schema fuzzer and under many senders at once.

- schemathesis (its CLI, every check) against a real collector on a loopback port,
  from its own ``/openapi.json``: every answer documented, no server error, a body
  valid against the schema accepted and an invalid one refused; /metrics promtool-clean
  after it all.
- 50 senders (the hooks' own Sender and HttpSink, one per simulated job) against
  `trainvitals serve` with its state file: every report acknowledged and applied once,
  none lost, answer times and the collector's CPU recorded.

Both run short by default (CI). ``TV_FULL_LENGTH=1`` runs them at full length
(schemathesis: 1,000 cases per operation, a random seed, every phase; load: 60 s) and
prints the figures docs/collector.md records:

    TV_FULL_LENGTH=1 python -m pytest -p no:cacheprovider -s tests/monitor/test_fuzz_and_load.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.monitor.helpers import promtool_clean
from tests.support import free_port, metric_value, parse_metrics, wait_until
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings

# Read at import (collection), before the suite's fixture clears TRAINVITALS_* variables.
FULL = os.environ.get("TV_FULL_LENGTH", "") not in ("", "0")

SCHEMATHESIS = [
    sys.executable,
    "-c",
    "import sys; from schemathesis.cli import schemathesis; sys.argv[0] = 'schemathesis'; sys.exit(schemathesis())",
]
# What counts as refusing a body (negative data) and as taking one (positive data).
# 413 refuses a body over max_body_bytes, which the schema cannot say; 404 takes a valid
# request about a run that has not reported (live settings); no 5xx either way.
SCHEMATHESIS_CONFIG = """\
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422"]
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "404", "413"]
"""
# DELETE /v1/runs/{run}/settings puts a run back on its job's own settings; the run's
# settings view stays (GET answers 200 with "settings": null), as documented, so the
# stateful phase's "deleted resource still available" (use_after_free) does not apply.
# (A config-file `enabled = false` is overridden by `--checks all`.)
# The run-name pattern of the settings path (parts that are not empty, "." or "..") is an
# alternation the generator satisfies by filtering; whether a seed's draws trip
# hypothesis's filter_too_much health check varies, and what it filters is never sent.
# too_slow times the generator itself (a report body with its nested coverage and
# sample lists) on whatever else the machine runs: it says nothing of the collector.
EXCLUDED_CHECKS = ["--exclude-checks", "use_after_free", "--suppress-health-check", "filter_too_much,too_slow"]


class _StatusCount:
    """ASGI middleware: counts the status of every answer the collector gives."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.statuses: Counter[int] = Counter()
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                with self.lock:
                    self.statuses[message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counted)


@pytest.mark.slow  # a fuzzer run: minutes
def test_schemathesis_finds_nothing(tmp_path):
    app = create_app(Settings(state_path=None))
    counted = _StatusCount(app)
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    report = tmp_path / "schemathesis.json"
    if FULL:
        length = ["-n", "1000"]  # cases per operation, random seed, every phase
    else:
        length = ["-n", "10", "--seed", "1", "--phases", "coverage,fuzzing"]
    with serve_in_thread(counted, settings=app.state.settings) as url:
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
                *length,
                "--generation-database",
                "none",
                "--report",
                "json",
                "--report-json-path",
                str(report),
            ],
            capture_output=True,
            text=True,
            timeout=3000 if FULL else 600,
            cwd=tmp_path,
        )
        metrics = httpx.get(url + "/metrics").content
    result = json.loads(report.read_text())
    cases = result["test_cases"]
    server_errors = sum(n for status, n in counted.statuses.items() if status >= 500)
    figures = (
        f"schemathesis {result['schemathesis_version']}, seed {result['seed']}: "
        f"{result['operations']['tested']} operations, {cases['generated']} cases, "
        f"{cases['with_failures']} with failures ({cases['unique_failures']} unique), "
        f"{cases['errored']} errored, {server_errors} server errors; answers "
        f"{dict(sorted(counted.statuses.items()))}; {result['running_time']:.0f} s"
    )
    print(figures)
    assert proc.returncode == 0 and cases["with_failures"] == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert server_errors == 0 and cases["errored"] == 0, figures
    assert result["operations"]["tested"] >= 9 and cases["generated"] >= 100, figures
    # Both directions were tried on the ingest: bodies accepted and bodies refused.
    assert counted.statuses[202] > 0 and counted.statuses[422] > 0, figures
    promtool_clean(metrics)


# -- many senders ----------------------------------------------------------------------------
SENDERS = 50
PROCESSES = 5  # jobs are processes: 10 senders per process, not 50 threads behind one GIL
SECONDS = 60.0 if FULL else 5.0
INTERVAL = 0.25  # seconds between one sender's reports (a report every 10 steps of 25 ms)
PARAMS = 31  # per-parameter signals: 8 metrics x 31 parameters + the loss = 249 samples

# One client process: SENDERS / PROCESSES simulated jobs, each the hooks' own Sender and
# HttpSink (timed), a report every INTERVAL s; prints what it put, sent, dropped and timed.
CLIENT = """
import json, sys, threading, time
from trainvitals.hooks.sender import Sender
from trainvitals.hooks.sinks import HttpSink

url, first, count, seconds, interval, params = sys.argv[1:]
first, count, params = int(first), int(count), int(params)
seconds, interval = float(seconds), float(interval)
METRICS = ("param_min", "param_max", "param_absmax", "param_drift_log2", "param_grad_relative_rms",
           "adam_eps_dominated_ratio", "adam_normalized_update_rms", "adam_exp_avg_norm")
times, lock = [], threading.Lock()


class Ready:
    def __init__(self, data):
        self.data, self.step = data, data["step"]

    def materialize(self):
        return self.data


class TimedSink(HttpSink):
    def deliver(self, batch):
        t0 = time.perf_counter()
        try:
            return super().deliver(batch)
        finally:
            with lock:
                times.append(time.perf_counter() - t0)


def report(run, step):
    samples = [{"name": m, "labels": {"param": f"layers.{i}.weight"}, "value": step * 1e-3 + i}
               for i in range(params) for m in METRICS]
    samples.append({"name": "loss", "labels": {}, "value": 2.0 / step})
    return Ready({"run": run, "step": step, "time": time.time(), "rank": 0, "samples": samples,
                  "events": []})


senders = [Sender(TimedSink(url), backoff=(0.05, 1.0)) for _ in range(count)]
put = [0] * count
stop = threading.Event()


def job(i):
    stop.wait((first + i) * interval / 50)  # staggered starts, as jobs are
    while not stop.is_set():
        put[i] += 1
        senders[i].put(report(f"load-{first + i}", put[i]))
        stop.wait(interval)


jobs = [threading.Thread(target=job, args=(i,)) for i in range(count)]
print("ready", flush=True)
sys.stdin.readline()  # start together
for j in jobs:
    j.start()
time.sleep(seconds)
stop.set()
for j in jobs:
    j.join()
drained = all(s.flush(60) for s in senders)
for s in senders:
    s.close(5)
print(json.dumps({"put": put, "sent": sum(s.sent for s in senders), "drained": drained,
                  "dropped": sum(s.dropped for s in senders), "times": times}), flush=True)
"""


# The collector as `trainvitals serve` runs it (its config, tune_gc, uvicorn_config), with
# each POST /v1/reports timed inside it (from the request's arrival at the app to the
# last byte of the answer, seconds); GET /load-test/times answers them.
SERVER = """
import json, sys, time, uvicorn
from trainvitals.monitor import logs
from trainvitals.monitor.app import create_app, tune_gc
from trainvitals.monitor.server import uvicorn_config
from trainvitals.monitor.settings import Settings

settings = Settings.from_file(sys.argv[1], port=int(sys.argv[2]))
app = create_app(settings)
times = []


class Timed:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/load-test/times":
            body = json.dumps(times).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return await send({"type": "http.response.body", "body": body})
        if scope["type"] != "http" or scope["path"] != "/v1/reports":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()

        async def timed(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                times.append(time.perf_counter() - t0)

        await self.app(scope, receive, timed)


tune_gc()
config = uvicorn_config(Timed(app), settings)
logs.install()
uvicorn.Server(config).run()
"""


def _ready(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, "the collector exited"
    try:
        return httpx.get(url + "/readyz").status_code == 200
    except httpx.TransportError:
        return False


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow  # fifty sender processes
def test_fifty_senders_every_report_applied_once(tmp_path: Path):
    config = tmp_path / "collector.yaml"
    config.write_text(f"state_path: {tmp_path / 'state.sqlite3'}\n")  # as deployed: durable
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    per = SENDERS // PROCESSES
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(config), str(port)], stdout=log, stderr=subprocess.STDOUT
        )
        clients = []
        try:
            wait_until(lambda: _ready(url, proc), 60, "collector ready")
            clients = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        CLIENT,
                        url,
                        str(k * per),
                        str(per),
                        str(SECONDS),
                        str(INTERVAL),
                        str(PARAMS),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for k in range(PROCESSES)
            ]
            for c in clients:
                assert c.stdout.readline().strip() == "ready"
            cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
            for c in clients:
                c.stdin.write("go\n")
                c.stdin.flush()
            results = [json.loads(c.communicate(timeout=SECONDS + 120)[0]) for c in clients]
            wall, cpu = time.perf_counter() - t0, _cpu_seconds(proc.pid) - cpu0
            text = httpx.get(url + "/metrics", timeout=30).text
            healthy = httpx.get(url + "/healthz").status_code
            inside = sorted(httpx.get(url + "/load-test/times", timeout=30).json())
        finally:
            for c in clients:
                if c.poll() is None:
                    c.kill()
            proc.terminate()
            proc.wait(30)
    put = [n for r in results for n in r["put"]]
    sent = sum(put)
    acknowledged = sum(r["sent"] for r in results)
    dropped = sum(r["dropped"] for r in results)
    times = sorted(t for r in results for t in r["times"])
    applied = metric_value(text, "trainvitals_collector_reports_total", outcome="accepted")
    duplicates = metric_value(text, "trainvitals_collector_reports_total", outcome="duplicate")
    refused = sum(
        v
        for (name, labels), v in parse_metrics(text).items()
        if name == "trainvitals_collector_reports_total" and dict(labels)["outcome"] not in ("accepted", "duplicate")
    )
    steps = {i: metric_value(text, "trainvitals_step", run=f"load-{i}") for i in range(SENDERS)}
    p50, p99 = statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]
    figures = (
        f"load: {SENDERS} senders in {PROCESSES} processes x {SECONDS:.0f} s, {PARAMS * 8 + 2} "
        f"samples per report: sent {sent}, acknowledged {acknowledged}, applied {applied:.0f}, "
        f"lost {sent - applied:.0f}, dropped {dropped}, duplicates {duplicates:.0f}, refused "
        f"{refused:.0f}; {len(times)} requests, answer p50 {1e3 * p50:.1f} ms, p99 "
        f"{1e3 * p99:.1f} ms at the client, p50 {1e3 * statistics.median(inside):.1f} ms, p99 "
        f"{1e3 * inside[int(0.99 * (len(inside) - 1))]:.1f} ms in the collector; "
        f"collector CPU {cpu:.1f} s in {wall:.1f} s "
        f"({100 * cpu / wall:.0f}% of one core), {applied / cpu:.0f} reports per CPU-second; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(figures)
    assert healthy == 200 and all(r["drained"] for r in results), figures
    assert sent > SENDERS * (SECONDS / INTERVAL) * 0.5, figures  # the jobs did run
    assert (acknowledged, applied, dropped, refused) == (sent, sent, 0, 0), figures
    assert steps == {i: float(put[i]) for i in range(SENDERS)}, figures  # each run's last step
    promtool_clean(text.encode())
