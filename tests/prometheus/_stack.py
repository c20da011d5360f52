"""Real pieces of the deployed stack for the integration tests: Debian's Prometheus
on loopback, configured from ``deploy/prometheus.yml``, and Grafana's side of a
panel query. The collector, Alertmanager, bounded polling and the recording webhook
receiver come from ``tests.support`` and ``tests.http_recorder``."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support import free_port, require_tool, running_process, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARDS = ROOT / "dashboards"
SCRAPE_S = 1  # scrape and rule evaluation interval of the test Prometheus, seconds


def host_port(url: str) -> str:
    """``http://127.0.0.1:9477`` -> ``127.0.0.1:9477``."""
    return url.split("://", 1)[1].rstrip("/")


def prometheus_config(
    collector_url: str,
    *,
    rule_files: list[Path] | None = None,
    alertmanager_url: str | None = None,
    relabel: bool = True,
) -> dict[str, Any]:
    """``deploy/prometheus.yml`` pointed at the test's collector and Alertmanager, with a
    1 s scrape and evaluation cadence; everything else (``honor_labels``, the alert
    relabeling) as shipped. ``relabel=False`` drops the alert relabeling (a control)."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    cadence = f"{SCRAPE_S}s"
    config["global"].update(scrape_interval=cadence, scrape_timeout=cadence, evaluation_interval=cadence)
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == "trainvitals"]
    assert len(jobs) == 1, "deploy/prometheus.yml must have one scrape job named trainvitals"
    jobs[0].update(scrape_interval=cadence, static_configs=[{"targets": [host_port(collector_url)]}])
    config["rule_files"] = [str(p) for p in rule_files or []]
    alerting = config["alerting"]
    if alertmanager_url is None:
        del alerting["alertmanagers"]
    else:
        alerting["alertmanagers"] = [{"static_configs": [{"targets": [host_port(alertmanager_url)]}]}]
    if not relabel:
        del alerting["alert_relabel_configs"]
    return config


@dataclass
class Prometheus:
    url: str
    client: httpx.Client

    def _get(self, path: str, **params: Any) -> Any:
        response = self.client.get(path, params=params)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query at now: the result vector."""
        return self._get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = SCRAPE_S) -> list[dict[str, Any]]:
        """A range query: the result matrix (series with at least one point)."""
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def series(self, match: str, start: float) -> list[dict[str, str]]:
        """Label sets of the series matching ``match`` since ``start``."""
        return self._get("/api/v1/series", **{"match[]": match, "start": start, "end": time.time()})

    def label_values(self, label: str, match: str, start: float) -> list[str]:
        """What Grafana's ``label_values(match, label)`` lists."""
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": match, "start": start, "end": time.time()})

    def alerts(self) -> list[dict[str, Any]]:
        """Alerts of the rules Prometheus evaluates (pending and firing)."""
        return self._get("/api/v1/alerts")["alerts"]


@contextmanager
def running_prometheus(folder: Path, config: dict[str, Any]) -> Iterator[Prometheus]:
    """Debian's Prometheus on loopback with ``config``, storage in ``folder``; waits
    until it is ready and its scrape target is up; skips the test where Prometheus is not
    installed."""
    prometheus = require_tool("prometheus")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        running_process(
            [
                prometheus,
                f"--config.file={path}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            log=folder / "prometheus.log",
            ready_url=f"{url}/-/ready",
            what="prometheus",
        ),
        httpx.Client(base_url=url, timeout=5.0) as client,
    ):
        prom = Prometheus(url, client)
        wait_until(lambda: prom.query('up{job="trainvitals"} == 1'), 60, "prometheus scraping the collector")
        yield prom


# -- Grafana's side of a panel query ------------------------------------------------------
RATE_INTERVAL = f"{4 * SCRAPE_S}s"  # Grafana's $__rate_interval at this scrape interval
_LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>\w+)\)$")


def regex_value(values: list[str]) -> str:
    """A multi-value variable as Grafana writes it into a PromQL regex matcher:
    regex-escaped values joined by |, each backslash doubled for the string."""
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", v).replace("\\", "\\\\") for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, values: dict[str, list[str]]) -> str:
    """``expr`` with Grafana's variables replaced; fails on one it does not know."""
    out = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name in sorted(values, key=len, reverse=True):
        out = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", lambda _m, n=name: regex_value(values[n]), out)
    left = re.findall(r"\$\{?\w+", out)
    if left:
        raise AssertionError(f"query {expr!r}: no value for {left}")
    return out


def resolve_variables(prom: Prometheus, dashboard: dict[str, Any], start: float) -> dict[str, list[str]]:
    """Run each query variable of ``dashboard`` (``label_values(selector, label)``) in
    order, each with the variables before it substituted; fail naming one that lists
    nothing."""
    values: dict[str, list[str]] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
        parsed = _LABEL_VALUES.match(query)
        if parsed is None:
            raise AssertionError(f"{dashboard['title']}: variable {var['name']}: not a label_values() query: {query!r}")
        match = substitute(parsed["match"], values)
        found = prom.label_values(parsed["label"], match, start)
        if not found:
            raise AssertionError(
                f"{dashboard['title']}: variable {var['name']} lists no values "
                f"({query!r} -> label_values({match}, {parsed['label']}))"
            )
        values[var["name"]] = found
    return values


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data (rows and the panels inside collapsed rows)."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def load_dashboards() -> dict[str, dict[str, Any]]:
    """The committed dashboards, by file name."""
    found = {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}
    if not found:
        raise AssertionError(f"no dashboards in {DASHBOARDS}")
    return found
