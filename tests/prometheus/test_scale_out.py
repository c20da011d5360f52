"""Scale-out, run for real on one host (``deploy/scale-out``): two collectors sharded by
run, one Prometheus scraping both and remote-writing (the shipped
``prometheus-remote-write.yml``) to a second Prometheus that receives it, and a two-peer
Alertmanager cluster on loopback that every collector notifies.

One incident is one notification at the receiver; with one Alertmanager killed, still
one; the second Prometheus holds both runs' series; a run moved to the other collector
(its job restarted against the other shard) does not page twice."""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.monitor.helpers import Recorder, body, report, serve_process
from tests.prometheus._stack import DEPLOY, host_port
from tests.support import free_port, needs_tools, require_tool, running_process, stop_process, wait_until

pytestmark = needs_tools("prometheus", "prometheus-alertmanager")
JSON = {"Content-Type": "application/json"}
AM_CONFIG = """\
route:
  receiver: recorder
  group_by: [alertname, run]
  group_wait: 1s
  group_interval: 2s
  repeat_interval: 1h
receivers:
  - name: recorder
    webhook_configs:
      - url: "{url}/webhook"
        send_resolved: false
"""


@contextmanager
def _alertmanager_peer(folder: Path, receiver: str, port: int, gossip: int, peer: int):
    folder.mkdir(parents=True)
    (folder / "am.yml").write_text(AM_CONFIG.format(url=receiver))
    with running_process(
        [
            require_tool("prometheus-alertmanager"),
            f"--config.file={folder / 'am.yml'}",
            f"--storage.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--cluster.listen-address=127.0.0.1:{gossip}",
            f"--cluster.peer=127.0.0.1:{peer}",
            "--cluster.peer-timeout=2s",
            "--cluster.settle-timeout=3s",
            "--cluster.gossip-interval=100ms",
            "--cluster.pushpull-interval=2s",
        ],
        log=folder / "am.log",
        ready_url=f"http://127.0.0.1:{port}/-/ready",
        what="alertmanager",
    ) as proc:
        yield proc


def _prometheus(folder: Path, config: dict, *, receiver: bool = False):
    folder.mkdir(parents=True)
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    args = [
        require_tool("prometheus"),
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    if receiver:
        args.append("--web.enable-remote-write-receiver")
    url = f"http://127.0.0.1:{port}"
    return url, running_process(args, log=folder / "prometheus.log", ready_url=f"{url}/-/ready", what="prometheus")


def _scraper_config(collectors: list[str], remote: str) -> dict:
    """The shipped remote-write Prometheus, pointed at our collectors and receiver."""
    config = yaml.safe_load((DEPLOY / "scale-out" / "prometheus-remote-write.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config.pop("rule_files", None)
    config.pop("alerting", None)
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "trainvitals"]
    job.update(scrape_interval="1s", static_configs=[{"targets": [host_port(u) for u in collectors]}])
    config["scrape_configs"] = [job]
    for target in config["remote_write"]:
        target.pop("headers", None)
        target["url"] = f"{remote}/api/v1/write"
        target.setdefault("queue_config", {})["batch_send_deadline"] = "1s"
    return config


def _query(url: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _incident(url: str, run: str, step: int, seq: int) -> None:
    event = {"kind": "optimizer_state_reset", "detail": "an incident"}
    one = report(run, step, events=[event], sender=f"job-{run}-{url[-5:]}", seq=seq)
    answer = httpx.post(url + "/v1/reports", content=body(one), headers=JSON, timeout=10)
    assert answer.status_code == 202, answer.text


def _notifications(hook: Recorder, run: str) -> int:
    """Webhook posts from the Alertmanager cluster that carry a firing alert of ``run``."""
    with hook.lock:
        return sum(
            any(a["status"] == "firing" and a["labels"].get("run") == run for a in b["alerts"]) for b in hook.bodies
        )


@pytest.mark.slow
def test_two_sharded_collectors_behind_a_two_peer_alertmanager_page_once(tmp_path):
    gossip = [free_port(), free_port()]
    am_ports = [free_port(), free_port()]
    with Recorder() as hook, ExitStack() as stack:
        peers = [
            stack.enter_context(
                _alertmanager_peer(tmp_path / f"am{i}", hook.url, am_ports[i], gossip[i], gossip[1 - i])
            )
            for i in (0, 1)
        ]
        am_urls = [f"http://127.0.0.1:{p}" for p in am_ports]
        wait_until(
            lambda: all(
                len(httpx.get(f"{u}/api/v2/status", timeout=5).json()["cluster"]["peers"]) == 2 for u in am_urls
            ),
            60,
            "the two Alertmanagers joined",
        )
        collectors = []
        for i in (0, 1):
            config = tmp_path / f"collector{i}.yaml"
            notifiers = [{"type": "alertmanager", "name": f"am{j}", "url": am_urls[j]} for j in (0, 1)]
            config.write_text(
                yaml.safe_dump(
                    {
                        "state_path": str(tmp_path / f"state{i}.sqlite3"),
                        "notifiers": notifiers,
                        "alerts": {"tick_interval": 0.2},
                    }
                )
            )
            port = free_port()
            log = stack.enter_context(open(tmp_path / f"collector{i}.log", "wb"))
            proc = serve_process(config, port, log)
            stack.callback(stop_process, proc)
            collectors.append(f"http://127.0.0.1:{port}")
        remote_url, remote = _prometheus(tmp_path / "remote", {"global": {"scrape_interval": "1s"}}, receiver=True)
        stack.enter_context(remote)
        _, scraper = _prometheus(tmp_path / "scraper", _scraper_config(collectors, remote_url))
        stack.enter_context(scraper)

        # One incident on each shard (sharded by run: r-a on collector 0, r-b on collector 1).
        _incident(collectors[0], "r-a", 10, 1)
        wait_until(lambda: _notifications(hook, "r-a"), 60, "r-a's notification")
        time.sleep(5)  # the other peer's turn (peer_timeout 2 s) and a group interval: nothing more
        once = _notifications(hook, "r-a")

        # One Alertmanager killed: the other alone still pages, once.
        os.kill(peers[0].pid, signal.SIGKILL)
        peers[0].wait(10)
        _incident(collectors[1], "r-b", 10, 1)
        wait_until(lambda: _notifications(hook, "r-b"), 60, "r-b's notification")
        time.sleep(5)
        killed_once = _notifications(hook, "r-b")

        # The receiving Prometheus holds both runs' series, written by the scraping one.
        stored = wait_until(
            lambda: (
                {s["metric"]["run"] for s in _query(remote_url, "trainvitals_step")} >= {"r-a", "r-b"}
                and _query(remote_url, "trainvitals_step")
            ),
            60,
            "the runs' series in the remote-write receiver",
        )

        # r-a moves: its job restarts against collector 1 and reports the same incident.
        _incident(collectors[1], "r-a", 20, 1)
        time.sleep(6)  # group_wait, group_interval and the peer timeout, twice over
        moved = _notifications(hook, "r-a")
        firing_on_both = [a["labels"]["run"] for a in httpx.get(f"{am_urls[1]}/api/v2/alerts", timeout=5).json()]
    assert once == 1, hook.bodies
    assert killed_once == 1, hook.bodies
    assert {s["metric"]["run"] for s in stored} >= {"r-a", "r-b"}
    assert moved == 1, hook.bodies
    assert sorted(firing_on_both) == ["r-a", "r-b"]
