"""The state file under faults, on a real collector: a full disk (a 1 MiB tmpfs), the
file deleted, replaced or reached through links while a collector holds it, and files
that cannot be used at start (damaged, foreign, read-only).

Each case checks the two promises: every page that should go out goes out, and no
acknowledged report is lost or applied twice (each report carries an
``optimizer_state_reset`` event: the alert's value counts the events applied).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.monitor.helpers import Recorder, body, report
from tests.support import wait_until
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import serve_in_thread
from trainvitals.monitor.settings import Settings, SettingsError

JSON = {"Content-Type": "application/json"}
RULES = """\
- alert: LossHigh
  metric: modality_loss
  above: 10
  clear: 5
  severity: page
  summary: "loss {value:.0f} on {modality} in {run}"
"""
_MAIN = "from trainvitals.monitor.cli import main; main()"
MODALITIES = ("text", "image", "audio", "video", "code")


def _settings(tmp_path: Path, state: Path, hook: Recorder, **more) -> Settings:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    return Settings(
        state_path=state,
        rules=[str(rules), "default"],
        notifiers=[{"type": "webhook", "url": hook.url}],
        alerts={"tick_interval": 0.1},
        state_check_seconds=0.1,
        **more,
    )


def _report(run: str, seq: int, loss: float = 50.0) -> dict:
    samples = [{"name": "modality_loss", "labels": {"modality": m}, "value": loss} for m in MODALITIES]
    event = {"kind": "optimizer_state_reset", "detail": f"seq {seq}"}
    return report(run, seq, samples, events=[event], sender="job-a", seq=seq)


def _events_applied(c: httpx.Client, run: str) -> float:
    """How many optimizer_state_reset events the collector applied for ``run``."""
    for a in c.get("/v1/alerts").json():
        if a["alertname"] == "OptimizerStateReset" and a["labels"]["run"] == run:
            return a["value"]
    return 0


def _pages(hook: Recorder, run: str) -> list[tuple[str, str]]:
    return sorted(
        (status, labels.get("modality", "")) for status, name, labels in hook.alerts() if labels["run"] == run
    )


@contextmanager
def _tmpfs(folder: Path, size: str = "1m"):
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (the full disk) needs root; this test runs as a user")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needed for the full disk): {proc.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to the last byte; return the filler file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as fh:
        for chunk in (b"\0" * 4096, b"\0"):
            try:
                while fh.write(chunk):
                    pass
            except OSError:
                pass
    return filler


def test_a_full_disk_pages_answers_503_and_applies_every_report_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainvitals.monitor.state")
    with _tmpfs(tmp_path / "disk") as disk, Recorder() as hook:
        settings = _settings(tmp_path, disk / "state.sqlite3", hook)
        bodies = [body(_report("full", seq)) for seq in range(1, 201)]
        app = create_app(settings)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/reports", content=body(report("warmup", 1)), headers=JSON).status_code == 202
            filler = _fill(disk)
            first = [c.post("/v1/reports", content=b, headers=JSON) for b in bodies]
            # Every page went out although nothing could be written.
            wait_until(lambda: len(_pages(hook, "full")) >= 6, 60, "the pages of a full disk")
            ready = c.get("/readyz")
            metrics = c.get("/metrics").text
            # The disk freed, the job retries what was refused: recognised, applied once.
            filler.unlink()
            retried = [c.post("/v1/reports", content=b, headers=JSON) for b in bodies]
            wait_until(lambda: c.get("/readyz").status_code == 200, 60, "ready again")
            applied = _events_applied(c, "full")
        # A restart: the memory of what was applied was written.
        app = create_app(settings)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            after_restart = [c.post("/v1/reports", content=b, headers=JSON).json() for b in bodies]
        pages = _pages(hook, "full")
    assert {r.status_code for r in first} == {503}, {r.status_code for r in first}
    assert "state file" in first[0].json()["detail"] and first[0].headers["retry-after"]
    assert ready.status_code == 503 and ready.json()["status"] == "degraded", ready.text
    assert 'trainvitals_collector_state_write_errors_total{write="seqs"}' in metrics
    assert 'trainvitals_collector_reports_total{outcome="state_unwritable"} 200.0' in metrics
    assert pages.count(("firing", "")) == 1  # OptimizerStateReset
    assert sorted(m for s, m in pages if s == "firing" and m) == sorted(MODALITIES)
    assert [r.status_code for r in retried] == [202] * 200
    assert all(r.json() == {"accepted": 0, "duplicates": [0]} for r in retried)
    assert applied == 200
    assert all(a == {"accepted": 0, "duplicates": [0]} for a in after_restart)
    logged = [r.getMessage() for r in caplog.records if r.name == "trainvitals.monitor.state"]
    assert any("cannot record the reports applied" in m for m in logged), logged
    assert any("cannot save the alert states" in m for m in logged), logged


def test_a_state_file_deleted_while_running_is_written_back(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainvitals.monitor.state")
    state = tmp_path / "state" / "collector.sqlite3"
    with Recorder() as hook:
        settings = _settings(tmp_path, state, hook)
        bodies = [body(_report("deleted", seq)) for seq in range(1, 21)]
        app = create_app(settings)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            answers = [c.post("/v1/reports", content=b, headers=JSON).status_code for b in bodies[:10]]
            wait_until(lambda: len(_pages(hook, "deleted")) == 6, 60, "pages")
            shutil.rmtree(state.parent)  # the file, its WAL and its folder
            wait_until(state.exists, 60, "the state file written back")
            answers += [c.post("/v1/reports", content=b, headers=JSON).status_code for b in bodies[10:]]
            applied = _events_applied(c, "deleted")
        app = create_app(settings)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            again = [c.post("/v1/reports", content=b, headers=JSON).json() for b in bodies]
            runs = [r["run"] for r in c.get("/v1/runs").json()]
            firing = {(a["alertname"], a["labels"].get("modality")) for a in c.get("/v1/alerts").json()}
        pages = _pages(hook, "deleted")
    assert answers == [202] * 20
    assert all(a == {"accepted": 0, "duplicates": [0]} for a in again)
    assert runs == ["deleted"] and applied == 20
    assert {("LossHigh", m) for m in MODALITIES} <= firing
    assert len(pages) == 6  # nothing paged twice across the restart
    logged = [r.getMessage() for r in caplog.records if r.name == "trainvitals.monitor.state"]
    assert any("was deleted while the collector runs" in m for m in logged), logged
    assert any("written back" in m for m in logged), logged


def test_a_state_file_replaced_while_running_is_moved_aside_and_written_back(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainvitals.monitor.state")
    state = tmp_path / "collector.sqlite3"
    with Recorder() as hook:
        settings = _settings(tmp_path, state, hook)
        app = create_app(settings)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/reports", content=body(_report("replaced", 1)), headers=JSON).status_code == 202
            other = tmp_path / "other.sqlite3"
            sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
            os.replace(other, state)
            wait_until(lambda: list(tmp_path.glob("collector.sqlite3.replaced-*")), 60, "the other file moved aside")
            wait_until(lambda: app.state.state_db.problem is None, 60, "written back")
            assert c.post("/v1/reports", content=body(_report("replaced", 2)), headers=JSON).status_code == 202
        app = create_app(settings)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            again = c.post("/v1/reports", content=body(_report("replaced", 1), _report("replaced", 2)), headers=JSON)
    assert again.json() == {"accepted": 0, "duplicates": [0, 1]}
    [aside] = tmp_path.glob("collector.sqlite3.replaced-*")
    assert sqlite3.connect(aside).execute("SELECT name FROM sqlite_master").fetchall() == [("t",)]


def _second_serve(state: Path) -> subprocess.CompletedProcess:
    """``trainvitals serve`` on ``state`` (any free port): it must refuse to start."""
    return subprocess.run(
        [sys.executable, "-c", _MAIN, "serve", "--port", "0", "--state-path", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("way", ["same path", "symlink", "hardlink", "folder deleted"])
def test_a_second_collector_on_the_same_state_is_refused_whatever_the_path(tmp_path, way):
    state = tmp_path / "a" / "collector.sqlite3"
    app = create_app(Settings(state_path=state))
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as c:
        held = c.post("/v1/reports", content=body(report("held", 1, sender="s", seq=1)), headers=JSON)
        assert held.status_code == 202
        if way == "same path":
            other = state
        elif way == "symlink":
            other = tmp_path / "link.sqlite3"
            other.symlink_to(state)
        elif way == "hardlink":
            other = tmp_path / "hard.sqlite3"
            os.link(state, other)
        else:
            shutil.rmtree(state.parent)
            other = state
        proc = _second_serve(other)
        # The first one still holds it and still acknowledges.
        held = c.post("/v1/reports", content=body(report("held", 2, sender="s", seq=2)), headers=JSON)
        assert held.status_code == 202
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(lines) == 1 and "is in use by another running collector" in lines[0], proc.stderr
    assert f"(pid {os.getpid()})" in lines[0]


def _damaged(path: Path) -> None:
    sqlite3.connect(path).executescript("CREATE TABLE x (a); INSERT INTO x VALUES (1);").close()
    data = bytearray(path.read_bytes())
    data[100:4096] = b"\xff" * (4096 - 100)  # the first page's header and schema
    path.write_bytes(bytes(data))


def _not_sqlite(path: Path) -> None:
    path.write_bytes(b"this is not a database\n" * 100)


def _foreign(path: Path) -> None:
    sqlite3.connect(path).executescript("CREATE TABLE runs (name TEXT, owner TEXT);").close()


def _bad_json(path: Path) -> None:
    create_app(Settings(state_path=path)).state.state_db.close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO alerts VALUES ('x', '{not json')")
    db.commit()
    db.close()


def _read_only(path: Path) -> None:
    create_app(Settings(state_path=path)).state.state_db.close()
    path.chmod(0o444)


@pytest.mark.parametrize(
    "make, expected",
    [
        (_damaged, "is not a usable SQLite file"),
        (_not_sqlite, "is not a usable SQLite file"),
        (_foreign, "was written by something else: its table 'runs' has the columns (name, owner)"),
        (_bad_json, "is damaged: a row of its table 'alerts' is not JSON"),
        (_read_only, "is read-only"),
    ],
    ids=["damaged", "not-sqlite", "foreign", "bad-json", "read-only"],
)
def test_an_unusable_state_file_is_one_line_at_start_and_left_as_it_is(tmp_path, make, expected):
    state = tmp_path / "collector.sqlite3"
    make(state)
    before = state.read_bytes()
    proc = _second_serve(state)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0] and repr(str(state)) in lines[0], lines[0]
    assert f"mv {str(state)!r} {str(state) + '.bad'!r}" in lines[0], lines[0]
    assert state.read_bytes() == before  # nothing overwritten
    with pytest.raises(SettingsError, match="move it aside"):
        create_app(Settings(state_path=state))
    # Moved aside as the line says: the collector starts with an empty state.
    state.rename(str(state) + ".bad")
    create_app(Settings(state_path=state)).state.state_db.close()


def test_a_bad_json_row_is_found_whatever_the_table(tmp_path):
    state = tmp_path / "collector.sqlite3"
    create_app(Settings(state_path=state)).state.state_db.close()
    db = sqlite3.connect(state)
    db.execute("INSERT INTO run_settings VALUES ('r', ?, 0, 1)", (json.dumps({"every": 1})[:-1],))
    db.commit()
    db.close()
    with pytest.raises(SettingsError, match="table 'run_settings' is not JSON"):
        create_app(Settings(state_path=state))


def test_readyz_recovers_when_the_disk_does_even_with_nothing_to_write(tmp_path):
    with _tmpfs(tmp_path / "disk") as disk, Recorder() as hook:
        settings = _settings(tmp_path, disk / "state.sqlite3", hook)
        with serve_in_thread(create_app(settings)) as url, httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/readyz").status_code == 200
            filler = _fill(disk)
            # No seq: nothing the ingest must remember, but the alert states cannot be saved.
            event = {"kind": "optimizer_state_reset", "detail": "no seq"}
            assert c.post("/v1/reports", content=body(report("plain", 1, events=[event])), headers=JSON).is_success
            wait_until(lambda: _pages(hook, "plain"), 60, "the page")
            degraded = wait_until(lambda: c.get("/readyz").status_code == 503, 60, "degraded")
            filler.unlink()
            wait_until(lambda: c.get("/readyz").status_code == 200, 60, "ready once the disk takes writes")
    assert degraded
