"""Connections and the live-settings routes under abuse, on a real collector: stalled
heads and bodies on keep-alive connections, bodies past a route's limit (declared or
chunked), TCP_NODELAY on the served socket, settings bodies that used to answer 500,
the settings 404, and settings outliving their run."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tests.monitor.helpers import body, report, serve_process
from tests.support import free_port, wait_until
from trainvitals.monitor.app import create_app
from trainvitals.monitor.server import bind, serve_in_thread, uvicorn_config
from trainvitals.monitor.settings import Settings

JSON = {"Content-Type": "application/json"}
STALLED = 120  # more than max_connections below: each one held a slot for ever


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        while True:
            data = s.recv(65536)
            if data == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset: closed too
        return True


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _answer(s: socket.socket, timeout: float = 20.0) -> bytes:
    """Read one HTTP answer's head and what came with it (the socket is blocking)."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def serve(tmp_path):
    """``trainvitals serve`` with short deadlines; yields (url, process)."""
    config = tmp_path / "collector.yaml"
    config.write_text(
        "state_path: memory\nheader_timeout_seconds: 1\nbody_timeout_seconds: 1\n"
        "keepalive_seconds: 600\nmax_connections: 100\n"
    )
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = serve_process(config, port, log)
        try:
            yield f"http://127.0.0.1:{port}", proc, log_path
        finally:
            proc.terminate()
            proc.wait(10)


def test_stalled_second_requests_on_keep_alive_connections_are_closed(serve):
    url, _proc, log_path = serve
    port = int(url.rsplit(":", 1)[1])
    socks = []
    firsts = []
    try:
        # First every connection asks once and stays open, idle, on keep-alive (600 s, far
        # longer than opening them takes on any machine): past max_connections they are
        # answered 503 and closed, however slowly they were opened.
        for _ in range(STALLED):
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            firsts.append(_answer(s).split(b" ", 2)[1])
            socks.append(s)
        # Then each open one starts a second request and stalls in its head: uvicorn stops
        # its keep-alive timer for the bytes and, alone, would hold the slot for ever.
        for s in socks:
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Stalled: ")  # and nothing more
            except OSError:  # one answered 503 and closed
                pass
            s.setblocking(False)
        wait_until(lambda: all(_closed_by_peer(s) for s in socks), 60, "stalled heads closed")
        with httpx.Client(base_url=url, timeout=30) as c:
            health = c.get("/healthz").status_code
            ingest = c.post("/v1/reports", content=body(report("through", 3, sender="s", seq=1)), headers=JSON)
            metrics = c.get("/metrics").text
    finally:
        for s in socks:
            s.close()
    # Past max_connections (100) while they were all open: what used to last for ever.
    assert set(firsts) == {b"200", b"503"}, set(firsts)
    assert health == 200
    assert ingest.json() == {"accepted": 1, "duplicates": []}
    assert 'trainvitals_step{run="through"} 3.0' in metrics
    text = log_path.read_text()
    assert "Traceback" not in text and len(text.splitlines()) < 30, text[-3000:]


def test_a_settings_put_whose_body_never_finishes_gets_408_and_no_traceback(serve):
    url, _proc, log_path = serve
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(base_url=url) as c:
        assert c.post("/v1/reports", content=body(report("r1", 1)), headers=JSON).status_code == 202
    answers = []
    for path, method in (("/v1/runs/r1/settings", b"PUT"), ("/healthz", b"GET"), ("/v1/reports", b"POST")):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(
                method + b" " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"every": '
            )
            head = _answer(s)
            answers.append(head.split(b"\r\n", 1)[0])
            # ... and the connection is not kept waiting for the rest.
            s.settimeout(20)
            while s.recv(65536):
                pass
    assert answers[0].startswith(b"HTTP/1.1 408") and answers[2].startswith(b"HTTP/1.1 408"), answers
    assert answers[1].startswith(b"HTTP/1.1 200"), answers  # answered, then closed on
    assert "Traceback" not in log_path.read_text()


def test_settings_bodies_past_64_kib_are_refused_declared_or_while_reading(serve):
    url, proc, _log = serve
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(base_url=url) as c:
        assert c.post("/v1/reports", content=body(report("r1", 1)), headers=JSON).status_code == 202
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"PUT /v1/runs/r1/settings HTTP/1.1\r\nHost: t\r\nContent-Length: 67108864\r\n\r\n")
        declared = _answer(s)
    before = _rss_bytes(proc.pid)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"PUT /v1/runs/r1/settings HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        try:
            for _ in range(1024):  # 64 MiB, unless the collector answers and closes first
                s.sendall(chunk)
                sent += 65536
        except OSError:
            pass
        chunked = _answer(s)
    after = _rss_bytes(proc.pid)
    assert declared.startswith(b"HTTP/1.1 413"), declared
    assert chunked.startswith(b"HTTP/1.1 413"), chunked[:200]
    assert after - before < 32 * 1024 * 1024, (before, after, sent)


def test_the_served_socket_has_tcp_nodelay():
    app = create_app(Settings(state_path=None))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(app, app.state.settings, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 60, "started")
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}") as c:
            assert c.get("/healthz").status_code == 200
            served = [p.transport.get_extra_info("socket") for p in server.server_state.connections]
            flags = [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in served]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert flags and all(flags), flags


@pytest.mark.parametrize(
    "payload, status, named",
    [
        (b'{"every": 5, "ttl_seconds": ' + b"9" * 400 + b"}", 422, "ttl_seconds"),
        (b'{"every": ' + b"1" * 60 + b"}", 422, "every"),
        (b"[" * 20_000, 400, "deeper than"),
        (b'{"signals": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400, "deeper than"),
        (b'{"every": 5, "ttl_seconds": 1e999}', 422, "ttl_seconds"),
    ],
    ids=["400-digit-ttl", "60-digit-every", "20000-open-brackets", "3000-deep-value", "infinite-ttl"],
)
def test_settings_bodies_that_answered_500_are_refused_naming_the_problem(payload, status, named, caplog):
    caplog.set_level(logging.ERROR)
    with serve_in_thread(create_app(Settings(state_path=None))) as url, httpx.Client(base_url=url) as c:
        assert c.post("/v1/reports", content=body(report("r1", 1)), headers=JSON).status_code == 202
        answer = c.put("/v1/runs/r1/settings", content=payload, headers=JSON)
        assert c.get("/healthz").status_code == 200
    assert answer.status_code == status, answer.text
    assert named in answer.json()["detail"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_settings_404_names_no_other_run():
    settings = Settings(state_path=None, token="ingest-secret", read_token="read-secret")
    auth = {"Authorization": "Bearer ingest-secret", **JSON}
    with serve_in_thread(create_app(settings)) as url, httpx.Client(base_url=url) as c:
        for run in ("secret-project-a", "secret-project-b"):
            assert c.post("/v1/reports", content=body(report(run, 1)), headers=auth).status_code == 202
        missing = c.put("/v1/runs/nope/settings", json={"every": 2}, headers=auth)
        hidden = c.get("/v1/runs", headers=auth)
    assert missing.status_code == 404
    assert "secret-project" not in missing.text and "nope" in missing.json()["detail"]
    assert hidden.status_code == 401


def test_live_settings_die_with_their_run():
    settings = Settings(state_path=None, run_ttl_seconds=3600)
    app = create_app(settings)
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as c:
        assert c.post("/v1/reports", content=body(report("reused", 1)), headers=JSON).status_code == 202
        assert c.put("/v1/runs/reused/settings", json={"every": 7, "ttl_seconds": 600}).status_code == 200
        again = c.post("/v1/reports", content=body(report("reused", 2)), headers=JSON).json()
        # The store's expiry, run at a time the test picks (past run_ttl_seconds), not after
        # a real wait: with a 1 s TTL, a loaded machine could expire the run between the
        # requests above.
        assert app.state.store.expire(now=time.time() + 3601) == ["reused"]
        assert c.get("/v1/runs").json() == []
        new_job = c.post("/v1/reports", content=body(report("reused", 1)), headers=JSON).json()
        shown = c.get("/v1/runs/reused/settings").json()
    assert again["settings"]["reused"]["every"] == 7
    assert "settings" not in new_job, new_job
    assert shown["settings"] is None
