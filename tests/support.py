"""Test helpers shared across the suites: free ports, bounded polling, a server process
waited for and stopped, Debian's Alertmanager on loopback, a real collector in this
process and its /metrics read back, data-parallel ranks, a host-sync spy, and the system
tools some tests run (``needs_tools``, ``require_tool``: they skip without them). The
recording HTTP server is in ``tests.http_recorder``, wire report builders in
``tests.reports``."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings
from trainvitals.monitor.store import SeriesStore

# -- system tools ---------------------------------------------------------------------------
# The tests that run real Prometheus, Alertmanager, promtool or chromium skip where the tool
# is not on PATH, saying how to install it: one line here, the README's and .ci/run's.
TEST_TOOLS_INSTALL = "apt-get install prometheus prometheus-alertmanager chromium"
# tool -> (the names it goes by on PATH, how to install it)
_APT = f"apt: {TEST_TOOLS_INSTALL}"
_TOOLS: dict[str, tuple[tuple[str, ...], str]] = {
    "prometheus": (("prometheus",), f"Debian package prometheus; {_APT}"),
    "promtool": (("promtool",), f"Debian package prometheus; {_APT}"),
    "prometheus-alertmanager": (("prometheus-alertmanager",), f"Debian package prometheus-alertmanager; {_APT}"),
    "amtool": (("amtool",), f"Debian package prometheus-alertmanager; {_APT}"),
    "chromium": (("chromium", "chromium-browser"), f"Debian package chromium; {_APT}"),
    "kubectl": (("kubectl",), "https://kubernetes.io/docs/tasks/tools/"),
    "systemd-analyze": (("systemd-analyze",), "Debian package systemd"),
}


def tool_path(tool: str) -> str | None:
    """Where ``tool`` (a key of the table above) is on PATH, or None."""
    names, _ = _TOOLS[tool]
    return next((path for path in map(shutil.which, names) if path is not None), None)


def missing_tools(*tools: str) -> str | None:
    """Why a test needing ``tools`` cannot run here (naming how to install them), or None."""
    missing = [t for t in tools if tool_path(t) is None]
    if not missing:
        return None
    return "; ".join(f"{t} is not on PATH ({_TOOLS[t][1]})" for t in missing)


def needs_tools(*tools: str) -> pytest.MarkDecorator:
    """Mark a test, class or module to skip unless every one of ``tools`` is on PATH."""
    reason = missing_tools(*tools)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def require_tool(tool: str) -> str:
    """``tool``'s path; skips the test (naming how to install it) where it is missing. For
    a helper that needs the tool partway through a test: the test's checks before it ran."""
    path = tool_path(tool)
    if path is None:
        pytest.skip(missing_tools(tool) or "")
    return path


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_url() -> str:
    """An http:// URL on loopback that nothing listens on (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


def wait_until(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "", interval: float = 0.02) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail after ``timeout`` s. The
    timeout bounds a failure, it is not an expectation: a passing test returns as soon as
    the event happens, so give it room for a loaded machine (several workers and other
    work on two cores), never a tight margin."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'}: not seen within {timeout} s")
        time.sleep(interval)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block (tiny CPU jobs gain nothing from more,
    the machine is shared, and one thread sums matmuls in the order other ranks do)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- server processes -----------------------------------------------------------------------
def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, 10 s to exit, then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextmanager
def running_process(
    args: list[str],
    *,
    log: Path,
    ready_url: str,
    what: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen]:
    """Start ``args`` with stdout and stderr in the file ``log``; yield the process once
    ``ready_url`` answers 200 (failing, with the log's tail, if it exits first or is not
    ready within ``timeout`` s); stop it when the block exits."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            with httpx.Client(timeout=5.0) as client:

                def ready() -> bool:
                    if proc.poll() is not None:
                        raise AssertionError(f"{what} exited with {proc.returncode}: {log.read_text()[-3000:]}")
                    try:
                        return client.get(ready_url).status_code == 200
                    except httpx.TransportError:
                        return False

                wait_until(ready, timeout, f"{what} ready")
            yield proc
        finally:
            stop_process(proc)


ALERTMANAGER_CONFIG = """\
route:
  receiver: recorder
  group_by: [{group_by}]
  group_wait: 1s
  group_interval: 2s
  repeat_interval: 1h
receivers:
  - name: recorder
    webhook_configs:
      - url: "{url}/webhook"
        send_resolved: true
"""


@contextmanager
def running_alertmanager(
    folder: Path, receiver_url: str, group_by: Iterable[str] = ("alertname", "run")
) -> Iterator[str]:
    """Debian's prometheus-alertmanager on loopback, no cluster, storage in ``folder``;
    its route sends every alert, grouped by ``group_by``, to ``receiver_url``/webhook.
    Yields its URL; skips the test where Alertmanager is not installed."""
    alertmanager = require_tool("prometheus-alertmanager")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "alertmanager.yml"
    config.write_text(ALERTMANAGER_CONFIG.format(url=receiver_url, group_by=", ".join(group_by)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_process(
        [
            alertmanager,
            f"--config.file={config}",
            f"--storage.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        log=folder / "alertmanager.log",
        ready_url=f"{url}/-/ready",
        what="alertmanager",
    ):
        yield url


# -- the collector, in this process ----------------------------------------------------------
@dataclass
class Collector:
    """A running collector: its URL, its app (``app.state`` holds the store, settings,
    alert service) and an httpx client bound to it."""

    url: str
    app: FastAPI
    client: httpx.Client

    def metrics(self) -> str:
        """The text of GET /metrics."""
        response = self.client.get("/metrics")
        response.raise_for_status()
        return response.text

    def alerts(self, run: str | None = None) -> list[dict[str, Any]]:
        """GET /v1/alerts, optionally only the alerts of one run."""
        response = self.client.get("/v1/alerts")
        response.raise_for_status()
        return [a for a in response.json() if run is None or a["labels"].get("run") == run]

    def firing(self, run: str | None = None) -> list[dict[str, Any]]:
        return [a for a in self.alerts(run) if a["state"] == "firing"]

    def wait_for(self, alertname: str, run: str, state: str = "firing", timeout: float = 60.0) -> dict[str, Any]:
        """The alert ``alertname`` of ``run`` once it is in ``state`` (bounded poll)."""

        def found() -> dict[str, Any] | None:
            for a in self.alerts(run):
                if a["alertname"] == alertname and a["state"] == state:
                    return a
            return None

        try:
            return wait_until(found, timeout, f"{alertname} {state} for run {run}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; alerts of the run: {self.alerts(run)}") from None


@contextmanager
def running_collector(
    settings: Settings | None = None, *, store: SeriesStore | None = None, **fields: Any
) -> Iterator[Collector]:
    """A real collector: ``create_app`` served by uvicorn on a thread of this process,
    127.0.0.1, port 0. Its settings are ``settings``, else ``Settings(**fields)`` (the
    environment fills the rest: the suite removes developers' TRAINVITALS_* variables);
    state in memory unless ``state_path`` is given (the default is a per-user file that
    tests must never share)."""
    if settings is not None and fields:
        raise TypeError(f"give settings or settings fields, not both (fields: {sorted(fields)})")
    fields.setdefault("state_path", None)
    app = create_app(settings if settings is not None else Settings(**fields), store=store)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield Collector(url, app, client)


# -- /metrics read back ---------------------------------------------------------------------
Series = tuple[str, frozenset[tuple[str, str]]]  # (sample name, label items)


def parse_metrics(text: str) -> dict[Series, float]:
    """Every sample of a Prometheus text exposition, parsed by prometheus_client:
    (sample name, frozenset of label items) -> value. Fails on a series listed twice."""
    out: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name`` with exactly ``labels``; None when absent."""
    return parse_metrics(text).get((name, frozenset(labels.items())))


def metric_series(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every series of the sample ``name``: label items -> value."""
    return {labels: v for (n, labels), v in parse_metrics(text).items() if n == name}


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum over the series of ``name`` that carry ``labels`` (among others)."""
    want = set(labels.items())
    return sum(v for labels_, v in metric_series(text, name).items() if want <= labels_)


# -- data-parallel ranks, host syncs ----------------------------------------------------------
def run_ranks(script: Path, out: Path, *extra: str, world: int = 2, timeout: float = 180) -> Any:
    """Run ``script RANK WORLD PORT OUT *extra`` as ``world`` processes (a gloo group on a
    free loopback port); fail the test on a non-zero exit or after ``timeout`` seconds
    (killing them all); return the JSON that rank 0 wrote to ``out``."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(port), str(out), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    finish_all(procs, timeout, "data-parallel ranks")
    return json.loads(out.read_text())


def finish_all(procs: list[subprocess.Popen], timeout: float, what: str) -> list[str]:
    """Wait for processes started with ``stdout=PIPE, stderr=STDOUT, text=True``; after
    ``timeout`` seconds kill them all and fail the test; fail with its output on a
    non-zero exit; return their outputs."""
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{what} did not finish within {timeout} s")
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log
    return logs


SYNCS = ("item", "tolist", "__float__", "__bool__", "__int__", "cpu", "numpy")


class HostSyncSpy:
    """Records the host-sync calls (.item(), .tolist(), float(t), ...) made on the
    thread that created it while recording; the sender thread's are ignored."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[str] = []
        self._monkeypatch = monkeypatch
        main = threading.get_ident()
        for name in SYNCS:
            orig = getattr(torch.Tensor, name)

            def spy(t, *a, _orig=orig, _name=name, **k):
                if threading.get_ident() == main:
                    self.calls.append(_name)
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)

    def stop(self) -> list[str]:
        """Stop recording; return what was recorded."""
        self._monkeypatch.undo()
        return self.calls
