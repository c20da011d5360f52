"""Test helpers shared across the suites: a free port, bounded polling, and Debian's
Alertmanager on loopback."""

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
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

ALERTMANAGER = shutil.which("prometheus-alertmanager")


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "",
               interval: float = 0.02) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'}: not seen within {timeout} s")
        time.sleep(interval)


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
def running_alertmanager(folder: Path, receiver_url: str,
                         group_by: Iterable[str] = ("alertname", "run")) -> Iterator[str]:
    """Debian's prometheus-alertmanager on loopback, no cluster, storage in ``folder``;
    its route sends every alert, grouped by ``group_by``, to ``receiver_url``/webhook.
    Yields its URL."""
    if ALERTMANAGER is None:
        raise RuntimeError("prometheus-alertmanager is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "alertmanager.yml"
    config.write_text(ALERTMANAGER_CONFIG.format(url=receiver_url, group_by=", ".join(group_by)))
    port = free_port()
    log_path = folder / "alertmanager.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [ALERTMANAGER, f"--config.file={config}", f"--storage.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=1.0) as client:
                def ready() -> bool:
                    if proc.poll() is not None:
                        raise AssertionError(f"alertmanager exited: {log_path.read_text()}")
                    try:
                        return client.get(f"{url}/-/ready").status_code == 200
                    except httpx.TransportError:
                        return False

                wait_until(ready, 30, "alertmanager ready")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def run_ranks(script: Path, out: Path, *extra: str, world: int = 2, timeout: float = 180) -> Any:
    """Run ``script RANK WORLD PORT OUT *extra`` as ``world`` processes (a gloo group on a
    free loopback port); fail the test on a non-zero exit or after ``timeout`` seconds
    (killing them all); return the JSON that rank 0 wrote to ``out``."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), str(out), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"data-parallel ranks did not finish within {timeout} s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log
    return json.loads(out.read_text())


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
