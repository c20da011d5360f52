"""One rank meets a fault the others do not: the job never hangs and rank 0 never
reports figures combined from different things. Two gloo ranks on the CPU train the
FSDP2 tiny model on the same batch (``_fault_ranks.py``), so what the ranks combine is
what one process reports; each run is bounded by a timeout (a hang fails the test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.hooks._fault_ranks import FAIL_AT, single_process
from tests.support import finish_all, free_port, run_ranks, running_collector, wait_until
from trainvitals.wire.metrics import METRICS

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_fault_ranks.py"
TIMEOUT_S = 150

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]

FIGURES = ("grad_norm", "param_", "adam_", "optimizer_state")


def keyed(samples: list[dict], prefix: tuple[str, ...] = FIGURES) -> dict[tuple, float]:
    return {
        (s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in samples if s["name"].startswith(prefix)
    }


def of_signal(samples: list[dict], *signals: str) -> dict[tuple, float]:
    """The samples of ``signals``' metrics (their group in the wire's metric table)."""
    return {
        (s["name"], tuple(sorted(s["labels"].items()))): s["value"]
        for s in samples
        if getattr(METRICS.get(s["name"]), "group", None) in signals
    }


def coverage(entries: list[dict]) -> dict[str, dict]:
    return {e["signal"]: e for e in entries}


def same(got: float, want: float) -> bool:
    if math.isnan(want) or math.isinf(want):
        return math.isnan(got) if math.isnan(want) else got == want
    return got == pytest.approx(want, rel=1e-5, abs=1e-7)


def assert_exact(
    got: list[dict], want: list[dict], what: str, prefix: tuple[str, ...] = FIGURES, but: tuple[str, ...] = ()
) -> None:
    g, w = keyed(got, prefix), keyed(want, prefix)
    g, w = ({k: v for k, v in d.items() if not k[0].startswith(but or ("\0",))} for d in (g, w))
    assert g.keys() == w.keys(), (what, sorted(set(g) ^ set(w)))
    assert g, what
    bad = {k: (g[k], v) for k, v in w.items() if not same(g[k], v)}
    assert not bad, (what, bad)


def run(tmp_path: Path, mode: str) -> dict:
    return run_ranks(WORKER, tmp_path / "out.json", mode, timeout=TIMEOUT_S)


# "+apart": the headers over the monitor's own gloo group, as under NCCL
APART = pytest.mark.parametrize("how", ["", "+apart"], ids=["one-gather", "header-apart"])


@APART
def test_a_signal_failing_on_one_rank_is_turned_off_on_every_rank(tmp_path, how):
    got = run(tmp_path, "fail" + how)
    want = single_process("fail")
    assert got["steps"] == want["steps"] == [1, 2, 4, 6]
    for k, step in enumerate(got["steps"]):
        cov = coverage(got["coverage"][k])
        if step < FAIL_AT:  # before the failure: everything, exact
            assert_exact(got["reports"][k], want["reports"][k], f"step {step}")
            assert cov["params"]["active"], cov["params"]
            continue
        # The failing report and after: no params figure on rank 0 either, said why,
        # naming the rank; the others go on, exact.
        assert not of_signal(got["reports"][k], "params"), f"step {step}"
        assert cov["params"]["reason"] == "failed" and "rank 1" in cov["params"]["detail"], cov["params"]
        assert of_signal(got["reports"][k], "adam", "optimizer"), f"step {step}"
        assert_exact(got["reports"][k], want["reports"][k], f"step {step}", ("grad_norm", "adam_"))
        assert cov["adam"]["active"] and cov["optimizer"]["active"], cov


def test_a_non_finite_gradient_on_one_rank_reads_as_one_process_reads_it(tmp_path):
    got = run(tmp_path, "nonfinite")
    want = single_process("nonfinite")
    assert got["steps"] == want["steps"] == [1, 2, 4, 6]
    for k, step in enumerate(got["steps"]):
        assert_exact(got["reports"][k], want["reports"][k], f"step {step}")
    # The infinity reached the update: the figures after it say non-finite, as one
    # process's do (compared above), not averaged away nor a hang.
    at2 = {s["name"]: s["value"] for s in got["reports"][1] if not s["labels"]}
    assert math.isnan(at2["param_norm"]) and math.isnan(at2["update_ratio"]), at2


@APART
def test_an_empty_shard_on_one_rank_is_exact(tmp_path, how):
    got = run(tmp_path, "empty" + how)
    assert got["sharded"]
    want = single_process("empty")
    assert got["steps"] == want["steps"] == [1, 2, 4, 6]
    for k, step in enumerate(got["steps"]):
        assert_exact(got["reports"][k], want["reports"][k], f"step {step}")
        assert any(s["labels"].get("param") == "scale" for s in got["reports"][k]), step


@APART
def test_step_counters_one_off_are_withheld_then_realigned(tmp_path, how):
    """Rank 0's monitor resumed one step ahead of rank 1's: both report the first step
    (steps 2 and 1); that report's cross-rank figures are withheld, said why, and every
    rank goes on from the larger step, so the later reports pair and are exact."""
    got = run(tmp_path, "ahead" + how)
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    want = single_process("ahead")
    assert got["steps"] == want["steps"] == r1["steps"] == [2, 4, 6]
    cov = coverage(got["coverage"][0])
    for signal in ("optimizer", "params", "adam"):
        assert cov[signal]["reason"] == "ranks_disagree", cov[signal]
        assert "rank 0 at step 2" in cov[signal]["detail"] and "rank 1 at step 1" in cov[signal]["detail"]
    # Nothing combined across ranks is left (a count of this rank's own optimizer
    # state resets is all).
    assert {s["name"] for s in got["reports"][0]} <= {"optimizer_state_resets_total"}, got["reports"][0]
    for k in (1, 2):
        # The drift figures count from the first report the ranks combined (step 4
        # here, step 2 in one process): the rest is the one process's, exactly.
        assert_exact(got["reports"][k], want["reports"][k], f"step {got['steps'][k]}", but=("param_drift",))
        assert keyed(got["reports"][k], ("param_drift_log2",)), k
        assert all(e["active"] for s, e in coverage(got["coverage"][k]).items() if s in ("params", "adam"))


def test_a_report_interval_set_on_one_rank_only_is_withheld_then_rank0s(tmp_path):
    """Rank 1 attaches with every=3, rank 0 with every=2: both report step 1, whose
    cross-rank figures are withheld, said why; every rank takes rank 0's interval, so
    the later reports pair and are exact."""
    got = run(tmp_path, "interval")
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    want = single_process("interval")
    assert got["steps"] == want["steps"] == r1["steps"] == [1, 2, 4, 6]
    assert r1["every"] == got["every"] == [2] * 6
    cov = coverage(got["coverage"][0])
    for signal in ("optimizer", "params", "adam"):
        assert cov[signal]["reason"] == "ranks_disagree", cov[signal]
        assert "rank 0 every 2, rank 1 every 3" in cov[signal]["detail"], cov[signal]
    assert {s["name"] for s in got["reports"][0]} <= {"optimizer_state_resets_total"}, got["reports"][0]
    for k in (1, 2, 3):
        assert_exact(got["reports"][k], want["reports"][k], f"step {got['steps'][k]}", but=("param_drift",))
        assert all(e["active"] for s, e in coverage(got["coverage"][k]).items() if s in ("params", "adam"))


def test_live_settings_reaching_rank0_first_switch_both_ranks_at_once(tmp_path):
    out = tmp_path / "out.json"
    with running_collector(state_path=None) as collector:
        port = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(r), "2", str(port), str(out), "live", collector.url],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        try:
            wait_until(
                lambda: (
                    (
                        collector.client.get("/v1/runs").status_code == 200
                        and "faults" in collector.client.get("/v1/runs").text
                    )
                    or any(p.poll() is not None for p in procs)
                ),
                120,
                "the first report",
            )
            resp = collector.client.put("/v1/runs/faults/settings", json={"every": 1})
            assert resp.status_code == 200, resp.text
        finally:
            finish_all(procs, TIMEOUT_S, "data-parallel ranks")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["every"] == r1["every"] and r0["steps"] == r1["steps"]
    switch = r0["every"].index(1)
    assert set(r0["every"][:switch]) == {4} and set(r0["every"][switch:]) == {1}
    assert r0["steps"][-6:] == list(range(r0["steps"][-6], r0["steps"][-6] + 6))
    for k, report in enumerate(r0["reports"]):  # every report's figures agreed
        assert all(e["active"] for e in r0["coverage"][k] if e["signal"] in ("params", "adam")), k
        assert of_signal(report, "params") and of_signal(report, "adam"), k
