"""Collector throughput: ingest samples/s over HTTP, and scrape time at 100k series.

Run: ``python tests/benchmarks/bench_collector_ingest.py [--seconds 10]``.

The collector runs as uvicorn in a subprocess (one worker), pinned to one core
when the machine has two or more; the client is pinned to another. Throughput
is reported both per wall second and per second of the server's own CPU time
(utime + stime from /proc), the latter being the "on one core" figure and the
one that holds up when other work shares the machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

from trainvitals.wire import encode_body

SAMPLES_PER_REPORT = 2000
# As `trainvitals serve` runs it (default settings, tune_gc, one worker).
SERVER = """
import sys, uvicorn
from trainvitals.monitor.app import create_app, tune_gc
from trainvitals.monitor.server import uvicorn_config
from trainvitals.monitor.settings import Settings
settings = Settings(port=int(sys.argv[1]), log_level="warning", state_path=None)
app = create_app(settings)
tune_gc()
uvicorn.Server(uvicorn_config(app, settings)).run()
"""
_PARAM_METRICS = (
    "param_min",
    "param_max",
    "param_absmax",
    "param_drift_log2",
    "param_grad_relative_rms",
    "adam_eps_dominated_ratio",
    "adam_normalized_update_rms",
    "adam_exp_avg_norm",
)


def report(run: str, step: int) -> dict:
    """2,000 samples: 8 per-parameter signals over 250 1D parameters."""
    n_params = SAMPLES_PER_REPORT // len(_PARAM_METRICS)
    samples = [
        {
            "name": m,
            "labels": {"param": f"layers.{i // 2}.norm{i % 2}.weight"},
            "value": step * 1e-3 + i,
        }
        for i in range(n_params)
        for m in _PARAM_METRICS
    ]
    return {"run": run, "step": step, "time": time.time(), "rank": 0, "samples": samples}


def body(reports: list[dict]) -> bytes:
    """A wire body, put together by the encoder the hooks use."""
    return encode_body(json.dumps(r).encode() for r in reports)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cpu: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    if cpu is not None:
        os.sched_setaffinity(proc.pid, {cpu})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("collector did not start")
        time.sleep(0.1)


def ingest_rate(
    url: str, pid: int, reports_per_body: int, seconds: float, threads: int, gz: bool = False
) -> float:
    bodies = [
        body([report(f"bench-{t}-{k}", step) for k in range(reports_per_body)])
        for t in range(threads)
        for step in range(4)
    ]
    headers = {"Content-Type": "application/json"}
    if gz:  # as the hooks send bodies over 2 kB
        bodies = [gzip.compress(b, compresslevel=1) for b in bodies]
        headers["Content-Encoding"] = "gzip"
    counts = [0] * threads
    stop = threading.Event()

    def client(t: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            mine = bodies[t * 4 : (t + 1) * 4]
            i = 0
            while not stop.is_set():
                r = c.post("/v1/reports", content=mine[i % 4])
                if r.status_code != 202:
                    raise SystemExit(f"refused: {r.status_code} {r.text}")
                counts[t] += 1
                i += 1

    # Warm up (first requests create the series), then measure.
    with httpx.Client(base_url=url, headers=headers) as c:
        for b in bodies:
            c.post("/v1/reports", content=b)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    workers = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    samples = sum(counts) * reports_per_body * SAMPLES_PER_REPORT
    print(
        f"ingest, {reports_per_body} report(s) of {SAMPLES_PER_REPORT} samples per body "
        f"({len(bodies[0]) / 1e3:.0f} kB{' gzipped' if gz else ''}): {sum(counts) / wall:.1f} requests/s, "
        f"{samples / wall:,.0f} samples/s wall, {samples / cpu:,.0f} samples per server CPU-second "
        f"(server CPU {100 * cpu / wall:.0f}% of one core)"
    )
    return samples / cpu


def scrape_time(url: str, n_series: int, repeats: int) -> float:
    runs = n_series // SAMPLES_PER_REPORT
    with httpx.Client(base_url=url, headers={"Content-Type": "application/json"}, timeout=120) as c:
        for k in range(runs):
            r = c.post("/v1/reports", content=body([report(f"scrape-{k}", 1)]))
            assert r.status_code == 202, r.text
        times, size = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            resp = c.get("/metrics", headers={"Accept-Encoding": "identity"})
            times.append(time.perf_counter() - t0)
            size = len(resp.content)
        gz = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            c.get("/metrics", headers={"Accept-Encoding": "gzip"})
            gz.append(time.perf_counter() - t0)
    print(
        f"scrape of {n_series:,} store series ({size / 1e6:.1f} MB): "
        f"median {statistics.median(times):.3f} s, min {min(times):.3f} s; "
        f"gzipped median {statistics.median(gz):.3f} s"
    )
    return statistics.median(times)


def in_process_breakdown() -> dict[str, float]:
    from trainvitals.alerts import AlertService
    from trainvitals.monitor.decode import decode_batch
    from trainvitals.monitor.store import SeriesStore

    raw = body([report("breakdown", 1)])
    store = SeriesStore()
    batch = decode_batch(raw)
    store.ingest(batch)
    alerts = AlertService.from_config("default")
    alerts.observe_batch(batch)
    n = 30
    t0 = time.perf_counter()
    for _ in range(n):
        decode_batch(raw)
    t1 = time.perf_counter()
    for _ in range(n):
        store.ingest(batch)
    t2 = time.perf_counter()
    for _ in range(n):
        alerts.observe_batch(batch)
    t3 = time.perf_counter()
    per = n * SAMPLES_PER_REPORT
    out = {"decode_us": 1e6 * (t1 - t0) / per, "store_us": 1e6 * (t2 - t1) / per,
           "rules_us": 1e6 * (t3 - t2) / per}
    print(
        f"in process, per sample: wire decode+validation {out['decode_us']:.2f} us, "
        f"store ingest {out['store_us']:.2f} us, default rules {out['rules_us']:.2f} us"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time per ingest case")
    ap.add_argument("--series", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="ingest measurements per case (median taken)")
    args = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[0] if len(cpus) >= 2 else None
    if server_cpu is not None:
        os.sched_setaffinity(0, set(cpus[1:]))
    print(f"{len(cpus)} CPUs; server pinned to {server_cpu}; load average {os.getloadavg()}")
    parts = in_process_breakdown()
    cases = {"plain": (1, False), "gzip": (1, True), "4_reports": (4, False)}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    proc, url = start_server(server_cpu)
    try:
        for _ in range(args.runs):
            for name, (per_body, gz) in cases.items():
                rates[name].append(ingest_rate(url, proc.pid, per_body, args.seconds, threads=2, gz=gz))
    finally:
        proc.terminate()
        proc.wait(30)
    proc, url = start_server(server_cpu)
    try:
        scrape = scrape_time(url, args.series, args.repeats)
    finally:
        proc.terminate()
        proc.wait(30)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print()
    print("| case (2,000 samples per report, default rules) | samples per server CPU-second (median) |")
    print("|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value:,.0f} |")
    print()
    print(" ".join([f"{k}_samples_per_cpu_s={v:.0f}" for k, v in medians.items()]
                   + [f"{k}={v:.3f}" for k, v in parts.items()] + [f"scrape_s={scrape:.3f}"]))


if __name__ == "__main__":
    main()
