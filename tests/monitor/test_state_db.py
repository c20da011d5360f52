"""The collector's SQLite state: the duplicate-report memory it keeps is bounded, and a
report at or below a sender's forgotten tail still counts as applied after a reload."""

from __future__ import annotations

import sqlite3

from trainvitals.monitor.decode import decode_batch
from trainvitals.monitor.state_db import SEQ_WINDOW, StateDB
from trainvitals.monitor.store import SeriesStore
from trainvitals.wire import encode_body, encode_report
from trainvitals.wire.schema import Report


def _batch(run: str, seqs: range, sender: str = "s1", rank: int = 0):
    reports = [Report(run=run, step=q, time=1.0, rank=rank, sender=sender, seq=q) for q in seqs]
    return decode_batch(encode_body(encode_report(r) for r in reports))


def test_seq_memory_is_bounded_and_its_floor_survives_a_reload(tmp_path):
    path = tmp_path / "state.sqlite3"
    db = StateDB(path)
    total = 3 * SEQ_WINDOW + 5
    for start in range(1, total + 1, 500):
        db.record_seqs(_batch("r", range(start, min(start + 500, total + 1))), now=10.0)
    db.record_seqs(_batch("r", range(1, 3), sender="other", rank=1), now=11.0)
    db.close()
    rows = sqlite3.connect(path).execute("SELECT count(*) FROM seqs").fetchone()[0]
    assert rows <= 2 * SEQ_WINDOW + 2, rows

    db = StateDB(path)
    store = SeriesStore()
    for run, seen, step, ended in db.load_runs():
        store.restore_run(run, step, seen, ended)
    assert [(r.run, r.step) for r in store.runs(now=12.0)] == [("r", 2)]  # the last body's step
    for run, rank, sender, floor, seqs in db.load_seqs():
        store.restore_seqs(run, rank, sender, floor, seqs)
    db.close()
    old, recent, new = (
        _batch("r", range(3, 4)),
        _batch("r", range(total, total + 1)),
        _batch("r", range(total + 1, total + 2)),
    )
    assert store.apply(old, now=12.0).duplicates == (0,)  # below the floor: counted as applied
    assert store.apply(recent, now=12.0).duplicates == (0,)
    assert store.apply(new, now=12.0).accepted == 1
    assert store.apply(_batch("r", range(1, 3), sender="other", rank=1), now=12.0).duplicates == (0, 1)


def test_an_expired_run_takes_its_seq_memory_along(tmp_path):
    db = StateDB(tmp_path / "state.sqlite3")
    db.record_seqs(_batch("gone", range(1, 4)), now=1.0)
    db.save_runs([("gone", None, None, None)])
    assert db.load_seqs() == [] and db.load_runs() == []
    db.close()
