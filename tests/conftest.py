"""Fixtures for every suite. Helpers to import are in ``tests.support``,
``tests.http_recorder`` and ``tests.reports``."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.support import one_torch_thread as _one_torch_thread

# Whole modules out of the quick loop (``pytest -m "not slow"``), beside the tests marked
# ``@pytest.mark.slow`` in place: each of their tests starts processes (a job, a
# framework's Trainer, a collector, Prometheus) or runs for many seconds. A module here
# takes its own marks as well; a new slow module is added here or marked in place.
SLOW_MODULES = (
    "tests/prometheus/",  # real Prometheus and Alertmanager processes
    "tests/e2e/",  # training jobs in fresh Pythons against a collector
    "tests/integrations/test_transformers.py",  # HF Trainer jobs in fresh Pythons
    "tests/integrations/test_lightning.py",
    "tests/integrations/test_zero_code.py",
    "tests/monitor/test_restart.py",  # collectors killed and started again
    "tests/monitor/test_secrets.py",
    "tests/monitor/test_demo.py",
    "tests/monitor/test_promtool_conventions.py",  # promtool on a few hundred generated bodies
    "tests/run_configure/test_configure.py::test_trainvitals_",  # the CLI against running jobs
    "tests/hooks/test_long_run.py",  # 300 steps with every signal on every step (70 s)
    "tests/hooks/test_param_resume.py::test_the_collector_judges_drift_over_a_resumed_runs_life",
    "tests/integrations/test_readme_examples.py",  # the README's Trainer and Lightning examples
    "tests/monitor/test_cli_failures.py",  # collectors started as processes
    "tests/monitor/test_connections.py",
    "tests/monitor/test_connection_faults.py",
    "tests/alerts/test_alertmanager_integration.py",  # a real Alertmanager
    "tests/local/test_report_page.py::test_the_collectors_live_pages_in_chromium",  # headless chromium
    "tests/local/test_report_page.py::test_the_report_file_in_chromium",
)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Several workers share the cores: torch on one thread in each, and in the jobs
        # they start, so no worker's threads spin waiting on another's.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW_MODULES):
            item.add_marker(pytest.mark.slow)
    # Files with slow tests first (each file's own order kept): with -n, the long tests
    # start first and the short ones fill in around them, so no long test is left
    # running alone at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores. Most of the suite's time is spent
    waiting on the jobs, collectors and Prometheus it starts, so a core per worker
    would leave the cores idle; one more keeps them busy without oversubscribing."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1


@pytest.fixture(scope="session", autouse=True)
def _no_trainvitals_environment() -> Iterator[None]:
    """Keep a developer's TRAINVITALS_* variables out of the whole session: the
    collector's Settings and the hooks' default sink read them. Session-wide, so
    module-scoped fixtures (a collector started once per module) run without them too;
    a test that sets one with ``monkeypatch`` gets it back removed afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("TRAINVITALS_")]:
            mp.delenv(key)
        yield


@pytest.fixture(scope="session", autouse=True)
def _work_in_a_scratch_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run every test from a scratch folder: a job writes its reports where it runs by
    default (``./trainvitals-<run>.jsonl``, also the reports a collector never took), and
    none of that may land in the checkout. Tests reach the repository's files through
    ``Path(__file__)``, never the working directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test (see ``tests.support.one_torch_thread``)."""
    with _one_torch_thread():
        yield


@pytest.fixture(params=["on_host", "on_device"])
def loss_emission(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Loss accounting's figures made both ways on one rank: from the host copy on the
    sender thread (the default) and as tensor ops on the training thread (the path of
    several ranks and of the probe's steps). A module takes it with
    ``pytestmark = pytest.mark.usefixtures("loss_emission")``."""
    from trainvitals.hooks.signals.loss.report import LossReport

    monkeypatch.setattr(LossReport, "on_host", request.param == "on_host")
    return str(request.param)
