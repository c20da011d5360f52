"""Layout guards: the wheel holds only trainvitals/..., the hooks stay light,
and nothing imports the bare folder names."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_importing_hooks_does_not_import_the_collector_stack():
    code = (
        "import sys, trainvitals.hooks; from trainvitals.hooks import attach; "
        "bad = [m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_collector_runs_no_hooks_code_and_no_torch():
    """The collector and the alerts package stand on the wire contract alone."""
    code = (
        "import sys, trainvitals.monitor.cli, trainvitals.alerts; "
        "from trainvitals.monitor.app import create_app; "
        "from trainvitals.monitor.settings import Settings; create_app(Settings(state_path='memory')); "
        "bad = [m for m in sys.modules if m.startswith('trainvitals.hooks') or m == 'torch']; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_wire_schema_imports_without_torch():
    code = "import sys, trainvitals.wire; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_public_api_is_what_we_mean():
    import trainvitals.hooks as hooks

    assert sorted(hooks.__all__) == ["Monitor", "SCHEMA_VERSION", "attach"]


@pytest.mark.slow
def test_wheel_contains_only_the_trainvitals_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("trainvitals-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if ".dist-info/" not in n]
    assert code and all(n.startswith("trainvitals/") for n in code), code
    assert "trainvitals/wire/schema.py" in code
    assert any(n.startswith("trainvitals/alerts/rules/") and n.endswith(".yaml") for n in code)


def test_ruff_bans_bare_folder_imports(tmp_path):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed")
    bad = tmp_path / "bad.py"
    bad.write_text("import hooks\nfrom monitor import app\n")
    out = subprocess.run(
        [ruff, "check", "--config", str(ROOT / "pyproject.toml"), "--select", "TID251", str(bad)],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and out.stdout.count("TID251") == 2, out.stdout


def test_ruff_is_clean_on_the_project():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed")
    out = subprocess.run(
        [ruff, "check", "hooks", "monitor", "alerts", "wire", "demo", "audit", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout


# The packages' layers, bottom up: what each may import of the others (anywhere in a
# module, TYPE_CHECKING blocks and function bodies included). alerts defines the
# persistence interface the collector implements, so it never imports the collector.
LAYERS = {
    "wire": set(),
    "alerts": {"wire"},
    "hooks": {"wire", "alerts"},
    "monitor": {"wire", "alerts", "demo", "audit"},  # the CLI registers the demo's and audit's commands
    "demo": {"wire", "alerts", "hooks", "monitor"},
    "audit": {"errors", "wire", "alerts", "hooks", "monitor"},
}


def _imports_of(package: str) -> dict[str, list[str]]:
    import ast

    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("trainvitals.") and name.split(".")[1] != package:
                    out.setdefault(name.split(".")[1], []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_packages_import_only_the_layers_below(package):
    wrong = {k: v for k, v in _imports_of(package).items() if k not in LAYERS[package]}
    assert not wrong, f"{package} imports {wrong}"


def test_alerts_never_names_the_collector():
    mentions = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "alerts").rglob("*"))
        if p.is_file() and p.suffix in (".py", ".md", ".yaml")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "trainvitals.monitor" in line
    ]
    assert not mentions, mentions


@pytest.mark.parametrize(
    ("message", "ok"),
    [
        ("Wire: one check_run\n\nwhy it matters\n", True),
        ("x" * 72 + "\n", True),
        ("x" * 73 + "\n\nbody\n", False),
        ("subject\nbody without the blank line\n", False),
    ],
)
def test_the_commit_msg_hook_holds_subjects_to_72_characters(tmp_path, message, ok):
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    done = subprocess.run([str(ROOT / ".ci" / "commit-subject"), str(path)], capture_output=True, text=True)
    assert (done.returncode == 0) == ok, done.stderr
