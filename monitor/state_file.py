"""The state file itself: its schema, and opening it as the one collector that uses it.

One collector per file, whatever path leads to it: the file itself is locked
(``flock`` on its inode, so a symbolic or hard link to it is refused too) and its
resolved path is claimed (an abstract socket named after it, Linux), so a second
collector started after the first one's folder was deleted is refused as well. A file
that is damaged, written by something else or read-only is refused with one line that
says how to move it aside; nothing is written to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import stat
import struct
import sys
from pathlib import Path

from trainvitals.wire.errors import StateError

try:
    import fcntl
except ImportError:  # Windows: no advisory lock, the file is still usable
    fcntl = None  # type: ignore[assignment]

__all__ = ["SCHEMA", "StateInUse", "StateUnusable", "claim_name", "connect", "open_locked"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run TEXT PRIMARY KEY,
    last_seen REAL NOT NULL,
    last_step INTEGER NOT NULL,
    ended INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS alerts (
    id TEXT PRIMARY KEY,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS notified (
    notifier TEXT NOT NULL,
    id TEXT NOT NULL,
    status TEXT NOT NULL,
    at REAL NOT NULL,
    notification TEXT NOT NULL,
    PRIMARY KEY (notifier, id)
);
CREATE TABLE IF NOT EXISTS seqs (
    run TEXT NOT NULL,
    rank INTEGER NOT NULL,
    sender TEXT NOT NULL,
    seq INTEGER NOT NULL,
    PRIMARY KEY (run, rank, sender, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS seq_floors (
    run TEXT NOT NULL,
    rank INTEGER NOT NULL,
    sender TEXT NOT NULL,
    floor INTEGER NOT NULL,
    PRIMARY KEY (run, rank, sender)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS drift_refs (
    run TEXT NOT NULL,
    rank INTEGER NOT NULL,
    param TEXT NOT NULL,
    ref REAL NOT NULL,
    scale REAL NOT NULL,
    PRIMARY KEY (run, rank, param)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS drift_runs (
    run TEXT PRIMARY KEY,
    seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS run_settings (
    run TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    set_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
"""


class StateInUse(StateError):
    """Another running collector holds the state file."""


class StateUnusable(StateError):
    """The state file cannot be used as it is (damaged, foreign, read-only); nothing was
    written to it. The message is one line: what is wrong, the path, how to move it aside."""


# The columns each table must have: a file with other columns was written by something else.
_COLUMNS = {
    "runs": ("run", "last_seen", "last_step", "ended"),
    "alerts": ("id", "data"),
    "notified": ("notifier", "id", "status", "at", "notification"),
    "seqs": ("run", "rank", "sender", "seq"),
    "seq_floors": ("run", "rank", "sender", "floor"),
    "run_settings": ("run", "data", "set_at", "expires_at"),
    "drift_refs": ("run", "rank", "param", "ref", "scale"),
    "drift_runs": ("run", "seen"),
}
# (table, JSON column) read back at start: a row that is not JSON is a damaged file.
_JSON_COLUMNS = (("alerts", "data"), ("notified", "notification"), ("run_settings", "data"))


def _move_aside(path: Path, why: str, fix: str = "") -> StateUnusable:
    shown = str(path)
    return StateUnusable(
        f"state_path {shown!r} {why}; nothing was written to it: {fix}move it aside "
        f"(mv {shown!r} {shown + '.bad'!r}) to start with an empty state, or set state_path to another file"
    )


def claim_name(path: Path) -> socket.socket | None:
    """Claim the resolved path (an abstract Unix socket named after its hash, Linux), so a
    second collector is refused even where the first one's file was deleted with its folder
    (a lock on the file cannot see that). None where there are no abstract sockets."""
    if not sys.platform.startswith("linux"):
        return None
    resolved = os.path.realpath(path)
    name = b"\0trainvitals-state-" + hashlib.sha256(resolved.encode()).hexdigest()[:40].encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen(8)
    except OSError:
        sock.close()
        raise StateInUse(
            f"state_path {str(path)!r} is in use by another running collector{_holder_of_name(name)} "
            f"(it resolves to {resolved!r}): give each collector its own state_path, or state_path: memory"
        ) from None
    return sock


def _holder_of_name(name: bytes) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(name)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        return f" (pid {pid})" if pid > 0 else ""
    except OSError:
        return ""


def _holder_of_lock(st: os.stat_result) -> str:
    """The pid holding an flock on this inode, from /proc/locks (Linux), as ' (pid N)'."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii") as fh:
            for line in fh:
                parts = line.split()
                if "FLOCK" in parts and len(parts) >= 6 and parts[5] == wanted:
                    return f" (pid {parts[4]})"
    except OSError:
        pass
    return ""


def open_locked(path: Path) -> int:
    """Open the file itself (created when missing) and hold an exclusive ``flock`` on it:
    a link to it, of any kind, leads to the same lock. StateInUse when another holds it,
    StateUnusable when it is read-only or not a file."""
    shown = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OSError(f"state_path {shown!r}: cannot read it: {exc.strerror}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise _move_aside(path, "is not a regular file")
        # Root may write a 0444 file, but a file made read-only says to leave it alone.
        if not st.st_mode & 0o222 or not os.access(path, os.W_OK):
            raise _move_aside(path, "is read-only", f"make it writable (chmod u+w {shown!r}), or ")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        if st is not None:
            raise _move_aside(path, f"cannot be opened for writing ({exc.strerror})") from None
        raise OSError(
            f"state_path {shown!r}: cannot create it: {exc.strerror}; set state_path to a writable file, or 'memory'"
        ) from None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder_of_lock(os.fstat(fd))
            os.close(fd)
            raise StateInUse(
                f"state_path {shown!r} is in use by another running collector{holder} (the same file, "
                "perhaps through a link): give each collector its own state_path, or state_path: memory"
            ) from None
    return fd


def connect(path: Path) -> sqlite3.Connection:
    """Open, check and (when new) create the SQLite state; StateUnusable with one line
    when the file is damaged, written by something else, or refuses writes."""
    shown = str(path)
    db = sqlite3.connect(shown, check_same_thread=False, isolation_level=None)
    try:
        try:
            check = db.execute("PRAGMA quick_check").fetchone()
        except sqlite3.DatabaseError as exc:
            raise _move_aside(path, f"is not a usable SQLite file ({exc})") from None
        if check is None or check[0] != "ok":
            raise _move_aside(path, f"is damaged (SQLite integrity check: {check[0] if check else 'no answer'})")
        tables = {
            name: tuple(row[1] for row in db.execute(f"PRAGMA table_info({name})"))
            for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        for name, columns in _COLUMNS.items():
            if name in tables and tables[name] != columns:
                raise _move_aside(
                    path,
                    f"was written by something else: its table {name!r} has the columns "
                    f"({', '.join(tables[name])}), a trainvitals state has ({', '.join(columns)})",
                )
        for table, column in _JSON_COLUMNS:
            if table not in tables:
                continue
            for (text,) in db.execute(f"SELECT {column} FROM {table}"):
                try:
                    json.loads(text)
                except (TypeError, ValueError):
                    raise _move_aside(path, f"is damaged: a row of its table {table!r} is not JSON") from None
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            db.execute("BEGIN IMMEDIATE")  # a file that takes no write lock is one we cannot use
            db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            raise _move_aside(path, f"cannot be written ({exc})") from None
    except BaseException:
        db.close()
        raise
    return db
