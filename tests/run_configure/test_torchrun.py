"""``trainvitals run -- torchrun --nproc-per-node 2 ...`` (gloo, CPU): a monitor per rank.
Ranks in one process group combine their figures and the run reports once per report
step, from rank 0; ranks that never form a group report apart, each under its rank."""

from __future__ import annotations

import sys

import pytest

from tests.run_configure._helpers import recording_collector, trainvitals
from tests.support import metric_value

pytestmark = pytest.mark.slow  # two ranks and a launcher, each a Python that imports torch

# torchrun as a module of this Python: a ``torchrun`` script on PATH may be another
# environment's (its shebang names another Python, without this checkout).
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")


def _torchrun(got, run: str, *job: str):
    return trainvitals(
        "run",
        "--run",
        run,
        "--collector",
        got.collector.url,
        "--every",
        "2",
        "--",
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "ddp.py",
        *job,
    )


def test_ddp_ranks_report_once_per_step_from_rank_0():
    with recording_collector() as got:
        proc = _torchrun(got, "ddp")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        reports = got.of("ddp")
        ranks = [r.rank for r in got.reports if r.run == "ddp"]
    # Each rank attached (rank from the process group, as the environment says) ...
    assert "as run 'ddp', rank 0 of 2" in proc.stderr
    assert "as run 'ddp', rank 1 of 2" in proc.stderr
    # ... and the run reported each report step once, from rank 0, with DDP's module.
    # prefix gone from the names.
    assert [g.step for g in reports] == [1, 2, 4, 6]
    assert set(ranks) == {0}
    assert reports[-1].labels_of("param_max", "param") == {"0.bias", "1.weight", "1.bias", "3.bias"}
    assert reports[-1].value("grad_norm") > 0


def test_ranks_without_a_process_group_report_apart_under_their_rank():
    with recording_collector() as got:
        proc = _torchrun(got, "alone", "--no-group")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        r0, r1 = got.of("alone", rank=0), got.of("alone", rank=1)
        series = got.collector.metrics()
    assert "rank 1 of 2 (no process group: it reports on its own)" in proc.stderr
    assert [g.step for g in r0] == [g.step for g in r1] == [1, 2, 4, 6]
    # Their own data, their own series (rank 0 without the label, as always).
    assert r0[-1].value("grad_norm") != r1[-1].value("grad_norm")
    assert metric_value(series, "trainvitals_grad_norm", run="alone", rank="1") == r1[-1].value("grad_norm")
    assert metric_value(series, "trainvitals_grad_norm", run="alone") == r0[-1].value("grad_norm")
