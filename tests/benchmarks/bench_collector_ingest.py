"""Collector throughput: ingest samples/s over HTTP, and scrape time at 100k series.

Run: ``python tests/benchmarks/bench_collector_ingest.py [--seconds 10] [--runs 3]``.

The collector runs as ``trainvitals serve`` does (default settings and rules, its
SQLite state file, tune_gc, one uvicorn worker) in a subprocess pinned to one core
when the machine has two or more; the client is pinned to another. Every report
carries ``sender``/``seq`` as the hooks send them (each request a new ``seq``, so
nothing is skipped as a duplicate). Throughput is reported per wall second and per
second of the server's own CPU time (utime + stime from /proc): the latter is the
"on one core" figure, the one that holds up when other work shares the machine.

The in-process breakdown decodes a fresh body each time (rotating bodies of two runs,
as the HTTP cases do: re-ingesting one decoded batch measures hot caches, not ingest)
and reads each thread's CPU time, medians of several rounds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from trainvitals.wire import encode_body

SAMPLES_PER_REPORT = 2000
BUDGET = 300_000  # samples per server CPU-second, end to end, on one core
# As `trainvitals serve` runs it (default settings, tune_gc, one worker).
SERVER = """
import sys, uvicorn
from trainvitals.monitor.app import create_app, tune_gc
from trainvitals.monitor.server import uvicorn_config
from trainvitals.monitor.settings import Settings
settings = Settings(port=int(sys.argv[1]), log_level="warning", state_path=sys.argv[2])
app = create_app(settings)
tune_gc()
uvicorn.Server(uvicorn_config(app, settings)).run()
"""
# A report's seq, padded with spaces (valid JSON) so each request can carry a new one.
_SEQ = b"SEQ_PLACEHOLDER"
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


def report(run: str, step: int, sender: str | None = None) -> dict:
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
    out = {"run": run, "step": step, "time": time.time(), "rank": 0, "samples": samples}
    if sender is not None:
        out.update(sender=sender, seq=0)
    return out


def body(reports: list[dict]) -> bytes:
    """A wire body, put together by the encoder the hooks use; a report with a ``seq``
    gets the placeholder a request fills in (:func:`numbered`)."""
    return encode_body(json.dumps(r).encode().replace(b'"seq": 0', b'"seq": ' + _SEQ) for r in reports)


def numbered(template: bytes, seq: int) -> bytes:
    """``template`` with every report's seq set to ``seq`` (same length, padded)."""
    return template.replace(_SEQ, str(seq).rjust(len(_SEQ)).encode())


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cpu: int | None, state: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), state])
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


def ingest_rate(url: str, pid: int, reports_per_body: int, seconds: float, threads: int, gz: bool = False) -> float:
    tag = os.urandom(4).hex()  # a fresh sender per case: its seq starts again at 1
    templates = [
        body([report(f"bench-{t}-{k}", step, sender=f"bench{tag}{t}{k}") for k in range(reports_per_body)])
        for t in range(threads)
        for step in range(4)
    ]
    headers = {"Content-Type": "application/json"}
    if gz:  # as the hooks send bodies over 2 kB
        headers["Content-Encoding"] = "gzip"
    counts = [0] * threads
    seqs = [0] * threads
    stop = threading.Event()

    def request(t: int, template: bytes) -> bytes:
        seqs[t] += 1
        raw = numbered(template, seqs[t])
        return gzip.compress(raw, compresslevel=1) if gz else raw

    def client(t: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            mine = templates[t * 4 : (t + 1) * 4]
            i = 0
            while not stop.is_set():
                r = c.post("/v1/reports", content=request(t, mine[i % 4]))
                if r.status_code != 202 or r.json()["duplicates"]:
                    print(f"refused: {r.status_code} {r.text}", file=sys.stderr)
                    os._exit(1)  # from a thread: SystemExit would end only the thread
                counts[t] += 1
                i += 1

    # Warm up (first requests create the series), then measure.
    with httpx.Client(base_url=url, headers=headers) as c:
        for t in range(threads):
            for b in templates[t * 4 : (t + 1) * 4]:
                c.post("/v1/reports", content=request(t, b))
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
        f"({len(request(0, templates[0])) / 1e3:.0f} kB{' gzipped' if gz else ''}): "
        f"{sum(counts) / wall:.1f} requests/s, "
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


def in_process_breakdown(rounds: int = 7, n: int = 40) -> dict[str, float]:
    """Per sample, thread CPU time: decode (msgspec and the wire checks), store, rules."""
    from trainvitals.alerts import AlertService
    from trainvitals.monitor.app import tune_gc
    from trainvitals.monitor.decode import decode_batch
    from trainvitals.monitor.store import SeriesStore

    raws = [body([report(f"breakdown-{k}", step)]) for k in range(2) for step in range(4)]
    store = SeriesStore(stale_reports=100)  # the collector's defaults
    alerts = AlertService.from_config("default")
    for raw in raws:
        batch = decode_batch(raw)
        store.apply(batch)
        alerts.observe_batch(batch)
    tune_gc()
    totals: dict[str, list[float]] = {"decode_us": [], "store_us": [], "rules_us": []}
    clock = time.thread_time
    for _ in range(rounds):
        spent = [0.0, 0.0, 0.0]
        for i in range(n):
            t0 = clock()
            batch = decode_batch(raws[i % len(raws)])
            t1 = clock()
            store.apply(batch)
            t2 = clock()
            alerts.observe_batch(batch)
            t3 = clock()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[2] += t3 - t2
        for key, value in zip(totals, spent, strict=True):
            totals[key].append(1e6 * value / (n * SAMPLES_PER_REPORT))
    out = {k: statistics.median(v) for k, v in totals.items()}
    print(
        f"in process, per sample (thread CPU, median of {rounds}): wire decode+validation "
        f"{out['decode_us']:.2f} us, store ingest {out['store_us']:.2f} us, default rules "
        f"{out['rules_us']:.2f} us; sum {sum(out.values()):.2f} us = "
        f"{1e6 / sum(out.values()):,.0f} samples per CPU-second before HTTP"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time per ingest case")
    ap.add_argument("--series", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="ingest measurements per case (median taken)")
    ap.add_argument(
        "--server-cpu",
        type=int,
        default=None,
        help="CPU to pin the collector to (default: the first); the client gets the others",
    )
    args = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = (cpus[0] if args.server_cpu is None else args.server_cpu) if len(cpus) >= 2 else None
    if server_cpu is not None:
        os.sched_setaffinity(0, set(cpus) - {server_cpu})
    print(f"{len(cpus)} CPUs; server pinned to {server_cpu}; load average {os.getloadavg()}")
    parts = in_process_breakdown()
    cases = {"plain": (1, False), "gzip": (1, True), "4_reports": (4, False)}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    state = tempfile.mkdtemp(prefix="tv-bench-")
    proc, url = start_server(server_cpu, os.path.join(state, "ingest.sqlite3"))
    try:
        for _ in range(args.runs):
            for name, (per_body, gz) in cases.items():
                rates[name].append(ingest_rate(url, proc.pid, per_body, args.seconds, threads=2, gz=gz))
    finally:
        proc.terminate()
        proc.wait(30)
    proc, url = start_server(server_cpu, os.path.join(state, "scrape.sqlite3"))
    try:
        scrape = scrape_time(url, args.series, args.repeats)
    finally:
        proc.terminate()
        proc.wait(30)
    shutil.rmtree(state, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print()
    print(
        f"| case (2,000 samples per report, default rules, state file) | samples per server CPU-second "
        f"(median of {args.runs}) | runs | budget {BUDGET:,} |"
    )
    print("|---|---|---|---|")
    for name, value in medians.items():
        shown = " · ".join(f"{v:,.0f}" for v in rates[name])
        print(f"| {name} | {value:,.0f} | {shown} | {'met' if value >= BUDGET else 'not met'} |")
    print()
    print(
        " ".join(
            [f"{k}_samples_per_cpu_s={v:.0f}" for k, v in medians.items()]
            + [f"budget_samples_per_cpu_s={BUDGET}"]
            + [f"{k}={v:.3f}" for k, v in parts.items()]
            + [f"scrape_s={scrape:.3f}"]
            + [f"load_average={os.getloadavg()[0]:.1f}"]
        )
    )


if __name__ == "__main__":
    main()
