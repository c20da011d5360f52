"""Half-open connections: 300 sockets that connect and send nothing do not keep the
collector from answering, are closed after header_timeout_seconds, and its log stays a
few lines (`trainvitals serve`, as deployed)."""

from __future__ import annotations

import socket

import httpx

from tests.monitor.helpers import body, promtool_clean, report, serve_process
from tests.support import free_port, wait_until

JSON = {"Content-Type": "application/json"}
HALF_OPEN = 300


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset: closed too
        return True


def test_half_open_connections_neither_block_requests_nor_flood_the_log(tmp_path):
    config = tmp_path / "collector.yaml"
    config.write_text("state_path: memory\nheader_timeout_seconds: 5\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = serve_process(config, port, log)
        socks: list[socket.socket] = []
        try:
            for _ in range(HALF_OPEN):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.setblocking(False)
                socks.append(s)
            with httpx.Client(base_url=url, timeout=30) as c:
                assert c.get("/healthz").status_code == 200
                answer = c.post("/v1/reports", content=body(report("through", 2)), headers=JSON)
                assert answer.status_code == 202, answer.text
                # Answered while all 300 were still open: not after they timed out.
                still_open = sum(not _closed_by_peer(s) for s in socks)
                # The collector closes them all once their headers are late (5 s here).
                wait_until(lambda: all(_closed_by_peer(s) for s in socks), 60, "half-open connections closed")
                # A second wave is served and closed the same way; the collector still answers.
                for s in socks:
                    s.close()
                socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(HALF_OPEN)]
            # A new client: the first one's keep-alive connection sat idle through the wait
            # above and the collector may close it (keepalive_seconds) as it is reused.
            with httpx.Client(base_url=url, timeout=30) as c:
                assert c.get("/readyz").status_code == 200
                metrics = c.get("/metrics").content
        finally:
            for s in socks:
                s.close()
            proc.terminate()
            proc.wait(10)
    assert still_open == HALF_OPEN, f"{HALF_OPEN - still_open} were closed before the answer came"
    assert b'trainvitals_step{run="through"} 2.0' in metrics
    promtool_clean(metrics)
    lines = log_path.read_text().splitlines()
    assert len(lines) < 20, "\n".join(lines[:40])
