"""deploy/ checked with the real tools where they exist here (promtool, amtool,
kubectl kustomize, systemd-analyze) and statically where they do not (no Docker
daemon): configs valid, images pinned, every referenced file present, rule content
equal to ``trainvitals rules export``, the image's entrypoint and healthcheck run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.prometheus._stack import DASHBOARDS, DEPLOY, ROOT
from tests.reports import make_body, make_report, make_sample
from tests.support import free_port, require_tool, running_process
from trainvitals.monitor.app import create_app
from trainvitals.monitor.cli import main as trainvitals_cli
from trainvitals.monitor.cli import serve
from trainvitals.monitor.settings import DEFAULT_PORT, Settings

pytestmark = pytest.mark.integration

COMPOSE_FILES = [DEPLOY / "compose.yaml", DEPLOY / "scale-out" / "compose.scale-out.yaml"]
PROMETHEUS_CONFIGS = [
    DEPLOY / "prometheus.yml",
    DEPLOY / "scale-out" / "prometheus-sharded.yml",
    DEPLOY / "scale-out" / "prometheus-remote-write.yml",
]
STATE_FILE = "/var/lib/trainvitals/collector.sqlite3"  # on a volume in every deployment
COLLECTOR_CONFIGS = [
    DEPLOY / "collector.yaml",
    DEPLOY / "systemd" / "collector.yaml",
    DEPLOY / "scale-out" / "collector-stateless.yaml",
]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=cwd)


def _exported_rules() -> str:
    from click.testing import CliRunner

    result = CliRunner().invoke(trainvitals_cli, ["rules", "export"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _pinned(image: str) -> bool:
    """name:tag with a version-like tag (a digit in it), or a digest; never latest."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and any(c.isdigit() for c in tag)


# -- Prometheus and Alertmanager -----------------------------------------------------------
@pytest.mark.parametrize("config", PROMETHEUS_CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_promtool_accepts_the_config_and_its_rule_files(config: Path) -> None:
    result = _run(require_tool("promtool"), "check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool checks the rule files the config names; an empty glob would pass silently.
    assert re.search(r"SUCCESS: [1-9]\d* rule files found", result.stdout), result.stdout
    assert re.search(r"SUCCESS: 1[01] rules found|SUCCESS: [1-9]\d+ rules found", result.stdout), result.stdout


@pytest.mark.parametrize("config", PROMETHEUS_CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_prometheus_configs_keep_run_labels_and_converge_alerts(config: Path) -> None:
    data = yaml.safe_load(config.read_text())
    jobs = [j for j in data["scrape_configs"] if j["job_name"] == "trainvitals"]
    assert len(jobs) == 1 and jobs[0]["honor_labels"] is True
    dropped = [r for r in data["alerting"]["alert_relabel_configs"] if r["action"] == "labeldrop"]
    pattern = re.compile("|".join(f"(?:{r['regex']})" for r in dropped))
    for label in ("job", "instance", *data["global"].get("external_labels", {})):
        if label == "cluster":
            continue  # kept on purpose: collectors there send no alerts (docs/deploy.md)
        assert pattern.fullmatch(label), f"{config.name}: alerts keep {label!r}: two alerts per incident"


def test_amtool_accepts_alertmanager_yml_and_routes_by_severity() -> None:
    amtool = require_tool("amtool")
    config = str(DEPLOY / "alertmanager.yml")
    result = _run(amtool, "check-config", config)
    assert result.returncode == 0, result.stdout + result.stderr
    routes = {}
    for severity in ("page", "warning", "info"):
        out = _run(
            amtool,
            "config",
            "routes",
            "test",
            f"--config.file={config}",
            f"severity={severity}",
            "alertname=GradientDilution",
            "run=r",
        )
        assert out.returncode == 0, out.stderr
        routes[severity] = out.stdout.strip()
    assert routes == {"page": "pagerduty,slack", "warning": "slack", "info": "null"}
    receivers = yaml.safe_load(Path(config).read_text())["receivers"]
    kinds = {r["name"]: set(r) - {"name"} for r in receivers}
    assert kinds["pagerduty"] == {"pagerduty_configs"} and kinds["slack"] == {"slack_configs"}


def test_rule_files_equal_trainvitals_rules_export() -> None:
    export = _exported_rules()
    assert (DEPLOY / "rules" / "trainvitals.rules.yml").read_text() == export, (
        "deploy/rules is stale: run `python deploy/generate.py`"
    )
    resource = yaml.safe_load((DEPLOY / "k8s" / "prometheusrule.yaml").read_text())
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"] == yaml.safe_load(export), (
        "deploy/k8s/prometheusrule.yaml is stale: run `python deploy/generate.py`"
    )
    rules_dirs = {p.parent for p in DEPLOY.rglob("*.rules.yml")}
    assert rules_dirs == {DEPLOY / "rules"}, "one copy of the exported rules"


# -- collector settings -------------------------------------------------------------------
def _collector_configs() -> list[tuple[str, str]]:
    out = [(str(p.relative_to(DEPLOY)), p.read_text()) for p in COLLECTOR_CONFIGS]
    configmap = yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())
    out.append(("k8s/configmap.yaml", configmap["data"]["collector.yaml"]))
    return out


@pytest.mark.parametrize("name,text", _collector_configs(), ids=[n for n, _ in _collector_configs()])
def test_collector_settings_build_a_collector(name: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(text)
    settings = Settings.from_file(path)
    assert settings.port == DEFAULT_PORT, name
    # Every shipped config says where its state goes: the image's state volume, or memory.
    declared = yaml.safe_load(text)["state_path"]
    assert declared == "memory" or settings.state_path == Path(STATE_FILE), (name, declared)
    # Built here with its state in this test's folder (never a shared file).
    settings = Settings.from_file(path, state_path=str(tmp_path / "state.sqlite3"))
    app = create_app(settings)  # rules and notifiers are validated here
    assert app.state.settings is settings
    app.state.state_db.close()


# -- compose and Grafana provisioning ------------------------------------------------------
def _compose() -> dict[str, Any]:
    """The services of compose.yaml merged with the scale-out overlay's (by name)."""
    merged: dict[str, Any] = {}
    for path in COMPOSE_FILES:
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            merged.setdefault(name, {}).update(service)
    return merged


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        out.append((source, target))
    return out


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_pin_images_and_reference_existing_files(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    named_volumes = set(yaml.safe_load(COMPOSE_FILES[0].read_text()).get("volumes") or {})
    services = _compose()
    for name, service in data["services"].items():
        image = services[name].get("image")
        assert image and _pinned(image), f"{path.name}: service {name}: image {image!r} is not pinned"
        build = service.get("build")
        if build:
            # Compose resolves every file's relative paths against the first file's folder.
            context = (DEPLOY / build["context"]).resolve()
            assert context == ROOT and (context / build["dockerfile"]).is_file(), (name, build)
        for source, _ in _mounts(service):
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{path.name}: {name} mounts missing {source}"
            else:
                assert source in named_volumes, f"{path.name}: {name}: unknown volume {source}"
        for dep in service.get("depends_on") or {}:
            assert dep in services, f"{path.name}: {name} depends on unknown service {dep}"


def test_compose_wires_the_stack_together() -> None:
    services = _compose()
    base = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]
    assert set(base) == {"collector", "prometheus", "alertmanager", "grafana"}
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"collector:{DEFAULT_PORT}"]
    am_targets = prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am_targets == ["alertmanager:9093"]
    collector = yaml.safe_load((DEPLOY / "collector.yaml").read_text())
    assert collector["notifiers"] == [{"type": "alertmanager", "url": "http://alertmanager:9093"}]
    # Each config file a container is told to read is mounted there.
    for name, service in services.items():
        targets_mounted = {t for _, t in _mounts(service)}
        for arg in service.get("command") or []:
            flag = re.match(r"--(?:config\.file)=(.+)", arg)
            path = flag.group(1) if flag else (arg if arg.startswith("/etc/") else None)
            if path:
                assert any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets_mounted), (
                    f"{name}: reads {path}, which no volume provides"
                )
    # The prometheus rule glob resolves inside the container to the mounted rules.
    assert ("./rules", "/etc/prometheus/rules") in _mounts(base["prometheus"])
    # The collector's state file is on a named volume (it survives `compose down`/up).
    state_dir = str(Path(collector["state_path"]).parent)
    (source,) = [s for s, t in _mounts(base["collector"]) if t == state_dir]
    assert source in yaml.safe_load(COMPOSE_FILES[0].read_text())["volumes"]


def test_grafana_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    grafana = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]["grafana"]
    mounts = dict((t, s) for s, t in _mounts(grafana))
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "trainvitals.yaml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["uid"] == "trainvitals-prometheus" and ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "trainvitals.yaml").read_text())
    (provider,) = providers["providers"]
    folder = provider["options"]["path"]
    assert (DEPLOY / mounts[folder]).resolve() == DASHBOARDS
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(folder + "/") and (DASHBOARDS / Path(home).name).is_file()


# -- Kubernetes ---------------------------------------------------------------------------
def _kustomize() -> list[dict[str, Any]]:
    result = _run(require_tool("kubectl"), "kustomize", str(DEPLOY / "k8s"))
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_kubernetes_manifests_build_and_fit_together() -> None:
    docs = {d["kind"]: d for d in _kustomize()}
    assert set(docs) == {
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
    }
    deployment, service, monitor = docs["Deployment"], docs["Service"], docs["ServiceMonitor"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert _pinned(container["image"]), container["image"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] != 0
    assert set(service["spec"]["selector"].items()) <= set(pod["metadata"]["labels"].items())
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(service["metadata"]["labels"].items())
    ports = {p["name"] for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container_ports == {"http": DEFAULT_PORT}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert set(volumes) == set(mounts) == {"config", "state"}
    assert volumes["config"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    config_arg = container["args"][container["args"].index("--config") + 1]
    assert config_arg == f"{mounts['config']}/collector.yaml" and "collector.yaml" in docs["ConfigMap"]["data"]
    # The state file lives on the claim, writable by the pod's user (fsGroup).
    state_path = yaml.safe_load(docs["ConfigMap"]["data"]["collector.yaml"])["state_path"]
    assert Path(state_path).parent == Path(mounts["state"])
    claim = volumes["state"]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsGroup"]
    assert docs["PrometheusRule"]["spec"] == yaml.safe_load(_exported_rules())


# -- the image ----------------------------------------------------------------------------
def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_slim_pinned_non_root_with_healthcheck() -> None:
    instructions = _dockerfile()
    args = {k: v for k, v in (a.split("=", 1) for i, a in instructions if i == "ARG")}
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], a.split()[0]) for i, a in instructions if i == "FROM"]
    assert bases and all(_pinned(b) and re.match(r"python:[\d.]+-slim", b) for b in bases), bases
    final = instructions[max(n for n, (i, _) in enumerate(instructions) if i == "FROM") :]
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    last_user = max(n for n, (i, _) in enumerate(final) if i == "USER")
    assert all(i != "RUN" for i, _ in final[last_user:]), "nothing runs as root after USER"
    (healthcheck,) = [a for i, a in final if i == "HEALTHCHECK"]
    assert "/healthz" in healthcheck
    assert ("EXPOSE", str(DEFAULT_PORT)) in final
    assert json.loads(next(a for i, a in final if i == "ENTRYPOINT")) == ["trainvitals"]


def test_dockerfile_copies_only_existing_files_the_context_keeps() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, "the context is a whitelist"
    copied = 0
    for instruction, arguments in _dockerfile():
        if instruction != "COPY" or "--from" in arguments:
            continue
        sources = [a for a in shlex.split(arguments) if not a.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file"
            assert source.rstrip("/") in kept, f"COPY {source}: excluded by Dockerfile.dockerignore"
            copied += 1
    assert copied >= 5


def test_image_requirements_are_the_packages_minus_torch() -> None:
    """The RUN line that writes the image's requirements, run here on pyproject.toml."""
    run = next(a for i, a in _dockerfile() if i == "RUN" and "tomllib" in a)
    snippet = re.search(r'python -c "(.+?)" >', run).group(1)  # type: ignore[union-attr]
    out = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT, timeout=30, check=True
    ).stdout.split()
    names = {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower() for r in out}
    assert "torch" not in names
    assert {"fastapi", "uvicorn", "prometheus-client", "pydantic", "pyyaml", "httpx", "click"} <= names


def test_entrypoint_serves_without_torch_and_the_healthcheck_sees_it(tmp_path: Path) -> None:
    """What the container runs: `trainvitals serve --config <compose's collector.yaml>`
    with torch absent (the image does not install it); then the HEALTHCHECK command
    itself, passing while the collector answers and failing once it is gone."""
    port = free_port()
    env = {
        **os.environ,
        "TRAINVITALS_HOST": "127.0.0.1",
        "TRAINVITALS_PORT": str(port),
        "TRAINVITALS_LOG_LEVEL": "warning",
        "TRAINVITALS_STATE_PATH": str(tmp_path / "state.sqlite3"),
    }
    no_torch = "import sys; sys.modules['torch'] = None; from trainvitals.monitor.cli import main; main()"
    log = tmp_path / "collector.log"
    healthcheck = json.loads(next(a for i, a in _dockerfile() if i == "HEALTHCHECK").split("CMD", 1)[1])
    assert healthcheck[0] == "python"
    check = [sys.executable, *healthcheck[1:]]
    with running_process(
        [sys.executable, "-c", no_torch, "serve", "--config", str(DEPLOY / "collector.yaml")],
        log=log,
        ready_url=f"http://127.0.0.1:{port}/readyz",
        what="the collector without torch",
        env=env,
        cwd=tmp_path,
    ):
        body = make_body(make_report("img", 1, [make_sample("loss", 1.5)], time=time.time()))
        assert httpx.post(f"http://127.0.0.1:{port}/v1/reports", json=body).status_code == 202
        assert 'trainvitals_loss{run="img"} 1.5' in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert subprocess.run(check, env=env, timeout=10).returncode == 0
    assert "No module named 'torch'" not in log.read_text()
    failed = subprocess.run(check, env=env, timeout=10, capture_output=True)
    assert failed.returncode != 0


# -- systemd ------------------------------------------------------------------------------
def test_systemd_unit_verifies_and_its_command_parses(tmp_path: Path) -> None:
    unit_path = DEPLOY / "systemd" / "trainvitals-collector.service"
    text = unit_path.read_text()
    exec_start = re.search(r"^ExecStart=(.+)$", text, re.M).group(1)  # type: ignore[union-attr]
    program, *argv = shlex.split(exec_start)
    assert program == "/opt/trainvitals/bin/trainvitals"
    # The arguments are what `trainvitals serve` accepts (the config: the shipped one).
    argv = [str(DEPLOY / "systemd" / "collector.yaml") if a == "/etc/trainvitals/collector.yaml" else a for a in argv]
    assert argv[0] == "serve"
    ctx = serve.make_context("serve", argv[1:])
    assert ctx.params["config_file"] == DEPLOY / "systemd" / "collector.yaml"
    # The state file is in the unit's StateDirectory (created for the dynamic user, kept).
    state_dir = re.search(r"^StateDirectory=(\S+)$", text, re.M).group(1)  # type: ignore[union-attr]
    state_path = yaml.safe_load((DEPLOY / "systemd" / "collector.yaml").read_text())["state_path"]
    assert Path(state_path).parent == Path("/var/lib") / state_dir
    # systemd-analyze checks the executable exists: point it at this environment's.
    here = shutil.which("trainvitals") or str(Path(sys.executable).parent / "trainvitals")
    local = tmp_path / unit_path.name
    local.write_text(text.replace("/opt/trainvitals/bin/trainvitals", here))
    result = _run(require_tool("systemd-analyze"), "verify", str(local))
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
