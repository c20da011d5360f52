"""``trainvitals run -- python script.py``: unmodified PyTorch scripts report gradient,
parameter and Adam signals under their own parameter names (every optimizer they step),
loss accounting where the logits can be found, through ``python -m`` too, next to the
job's own ``sitecustomize``; the job's exit code and signals pass through unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.run_configure._helpers import (
    JOBS,
    TRAINVITALS,
    finite,
    job_env,
    printed,
    recording_collector,
    trainvitals,
)
from tests.support import wait_until

pytestmark = pytest.mark.slow  # each job is a fresh Python that imports torch


def test_plain_script_reports_gradient_parameter_and_adam_signals_under_its_names():
    with recording_collector() as got:
        proc = trainvitals(
            "run",
            "--run",
            "plain-job",
            "--collector",
            got.collector.url,
            "--every",
            "3",
            "--",
            sys.executable,
            "plain.py",
            "6",
            "--exit",
            "3",
        )
        assert proc.returncode == 3, proc.stderr  # the job's own exit code
        assert got.steps("plain-job") == [1, 3, 6]  # each once, at the interval asked
        assert got.ended("plain-job")  # closed at exit: the collector knows it ended on purpose
        last = got.of("plain-job")[-1]
    # The 1D parameters by the names model.named_parameters() gives them.
    one_d = {"body.0.bias", "body.1.weight", "body.1.bias", "head.bias"}
    for name in ("param_drift_log2", "param_max", "param_weight_decay", "param_grad_relative_rms"):
        assert last.labels_of(name, "param") == one_d, name
    # Gradient: the norm the job itself took before the step.
    assert last.value("grad_norm") == pytest.approx(printed(proc.stdout, 6, "grad_norm"), rel=1e-5)
    # Parameter: head.bias after the step, as the job printed it.
    assert last.value("param_max", param="head.bias") == pytest.approx(
        printed(proc.stdout, 6, "head.bias.max"), rel=1e-6
    )
    # Adam: its moments are read (AdamW is an Adam).
    assert finite(last.value("adam_exp_avg_norm", group="0"))
    assert {"update_ratio", "adam_normalized_update_rms"} <= last.names
    assert "watching AdamW (6 parameter tensors of Net) as run 'plain-job'" in proc.stderr


def test_a_script_with_two_optimizers_gets_both_watched_as_two_runs():
    with recording_collector() as got:
        proc = trainvitals(
            "run",
            "--run",
            "gan",
            "--collector",
            got.collector.url,
            "--every",
            "2",
            "--",
            sys.executable,
            "two_optimizers.py",
        )
        assert proc.returncode == 0, proc.stderr
        disc, gen = got.of("gan"), got.of("gan:opt2")  # in the order they first stepped
    assert [g.step for g in disc] == [g.step for g in gen] == [1, 2, 4]
    assert disc[-1].labels_of("param_max", "param") == {"features.bias", "norm.weight", "norm.bias", "out.bias"}
    assert gen[-1].labels_of("param_max", "param") == {"net.0.bias", "net.2.bias", "scale"}
    for g in (disc[-1], gen[-1]):
        assert finite(g.value("grad_norm")) and finite(g.value("adam_exp_avg_norm", group="0"))
    assert "of Discriminator) as run 'gan'" in proc.stderr
    assert "of Generator) as run 'gan:opt2'" in proc.stderr


def test_an_optimizer_that_replaces_another_continues_its_run():
    with recording_collector() as got:
        proc = trainvitals(
            "run",
            "--run",
            "finder",
            "--collector",
            got.collector.url,
            "--every",
            "2",
            "--",
            sys.executable,
            "replace.py",
            "finder",
        )
        assert proc.returncode == 0, proc.stderr
        reports = got.of("finder")
        ends = [g.step for g in got.reports if g.run == "finder" and "run_end" in g.events]
    # SGD for steps 1-3, then AdamW: one run, its steps counted on, one end.
    assert [g.step for g in reports] == [1, 2, 4, 6, 8]
    assert ends == [9]
    assert "AdamW replaces SGD (all its parameters): run 'finder' goes on with it from step 3" in proc.stderr
    assert reports[1].value("adam_exp_avg_norm", group="0") is None  # SGD: no moments
    assert finite(reports[-1].value("adam_exp_avg_norm", group="0"))
    assert reports[-1].value("optimizer_state_resets_total") == 0  # new moments, not a reset mid-run


def test_optimizers_sharing_some_parameters_are_two_runs():
    with recording_collector() as got:
        proc = trainvitals(
            "run",
            "--run",
            "overlap",
            "--collector",
            got.collector.url,
            "--every",
            "1",
            "--",
            sys.executable,
            "replace.py",
            "overlap",
        )
        assert proc.returncode == 0, proc.stderr
        assert got.steps("overlap") == got.steps("overlap:opt2") == [1, 2]
        assert got.of("overlap")[-1].labels_of("param_max", "param") == {"0.bias", "1.weight", "1.bias"}
        assert got.of("overlap:opt2")[-1].labels_of("param_max", "param") == {"1.weight", "1.bias", "2.bias"}


def test_an_optimizer_stepped_inside_another_is_not_watched_twice():
    with recording_collector() as got:
        proc = trainvitals(
            "run",
            "--run",
            "wrapped",
            "--collector",
            got.collector.url,
            "--every",
            "2",
            "--",
            sys.executable,
            "replace.py",
            "wrapper",
        )
        assert proc.returncode == 0, proc.stderr
        assert got.steps("wrapped") == [1, 2, 4]
        assert not [g for g in got.reports if g.run.startswith("wrapped:")]
    assert "AdamW is stepped inside the step of Wrapper (run 'wrapped'): not watched twice" in proc.stderr


def test_a_closure_stepped_optimizer_is_measured_after_its_closure_ran():
    with recording_collector() as got:
        proc = trainvitals(
            "run",
            "--run",
            "closure",
            "--collector",
            got.collector.url,
            "--every",
            "1",
            "--",
            sys.executable,
            "closure.py",
        )
        assert proc.returncode == 0, proc.stderr
        reports = got.of("closure")
    assert [g.step for g in reports] == [1, 2, 3, 4]
    for g in reports:  # the gradients of this step's closure, not the previous step's
        assert g.value("grad_norm") == pytest.approx(printed(proc.stdout, g.step, "grad_norm"), rel=1e-5)


def test_zero_code_loss_accounting_where_the_logits_can_be_found():
    with recording_collector() as got:
        proc = trainvitals(
            "run", "--run", "lm", "--collector", got.collector.url, "--every", "1", "--", sys.executable, "tiny_lm.py"
        )
        assert proc.returncode == 0, proc.stderr
        reports = got.of("lm")
    assert "loss accounting from the logits of 'lm_head'" in proc.stderr
    # Attached at the first step's pre-step hook: its forward was already done, so loss
    # figures start with step 2 (the weights of each micro-batch are 1/2 of its token mean).
    assert [g.step for g in reports] == [1, 2, 3]
    assert reports[0].value("loss_weight_mass", objective="main") is None
    for g in reports[1:]:
        assert g.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-5)
        assert g.value("microbatches") == 2


def test_python_m_and_the_jobs_own_sitecustomize(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text(
        textwrap.dedent("""\
        import os
        os.environ["JOB_SITECUSTOMIZE_RAN"] = "yes"
        """)
    )
    script = "import os, sys, runpy; print('own sitecustomize:', os.environ.get('JOB_SITECUSTOMIZE_RAN'))"
    with recording_collector() as got:
        env = job_env(PYTHONPATH=str(own))
        proc = trainvitals(
            "run",
            "--run",
            "as-module",
            "--collector",
            got.collector.url,
            "--every",
            "5",
            "--",
            sys.executable,
            "-c",
            script,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert "own sitecustomize: yes" in proc.stdout  # chained behind the shim
        proc = trainvitals(
            "run",
            "--run",
            "as-module",
            "--collector",
            got.collector.url,
            "--every",
            "5",
            "--",
            sys.executable,
            "-m",
            "plain",
            "5",
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert got.steps("as-module") == [1, 5]


def test_exit_codes_and_signals_pass_through(tmp_path):
    proc = trainvitals("run", "--collector", "null", "--", sys.executable, "-c", "raise SystemExit(7)")
    assert proc.returncode == 7
    assert trainvitals("run", "--collector", "null", "--", "no-such-command-here").returncode == 127
    # The command replaces `trainvitals run`: a signal sent to its pid reaches the job, and
    # the job's death by a signal is the parent's to see.
    job = subprocess.Popen(
        [
            TRAINVITALS,
            "run",
            "--collector",
            "null",
            "--",
            sys.executable,
            "plain.py",
            "2",
            "--wait-signal",
            str(tmp_path),
        ],
        cwd=JOBS,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        ready = tmp_path / "ready"
        wait_until(lambda: ready.exists() or job.poll() is not None, 120, "the job ready")
        assert job.poll() is None, job.communicate()[0]
        assert int(ready.read_text()) == job.pid  # same process: exec, no parent in between
        os.kill(job.pid, signal.SIGUSR1)
        assert job.wait(60) == -signal.SIGTERM
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


# -- never silently blind ---------------------------------------------------------------
def test_a_script_that_steps_no_optimizer_says_nothing_was_watched():
    proc = trainvitals("run", "--run", "idle", "--", sys.executable, "no_step.py")
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert (
        "trainvitals run: run 'idle': the job imported torch but stepped no torch optimizer "
        "(optimizer.step() never ran): NOTHING was watched and no report was sent to ./trainvitals-idle.jsonl"
    ) in proc.stderr
    assert not (JOBS / "trainvitals-idle.jsonl").exists()


def test_a_script_that_attaches_itself_keeps_its_own_monitor_and_gets_no_second():
    with recording_collector() as got:
        url = got.collector.url
        proc = trainvitals("run", "--run", "outer", "--collector", url, "--", sys.executable, "self_attach.py", url)
        assert proc.returncode == 0, proc.stderr
        assert got.steps("own") == [1, 2, 4]
        assert got.steps("outer") == []  # not watched a second time
    assert "the job attached a monitor to AdamW itself (run 'own')" in proc.stderr
    assert "does not watch it a second time" in proc.stderr


def test_a_language_model_whose_head_is_not_found_says_so_and_warns():
    """Coverage says no_lm_head with why, the start and close lines say it, and the
    collector's SignalInactive fires; the plain script (no token embedding) is not blind
    on loss: it is no language model, and nothing warns."""
    with recording_collector() as got:
        c = got.collector
        proc = trainvitals(
            "run", "--run", "hidden", "--collector", c.url, "--every", "1", "--", sys.executable, "hidden_head.py", "25"
        )
        assert proc.returncode == 0, proc.stderr
        fired = [a for a in c.alerts("hidden") if a["alertname"] == "SignalInactive"]
        assert len(fired) == 1 and fired[0]["fired_at"] is not None, c.alerts("hidden")
        assert fired[0]["labels"]["signal"] == "loss" and fired[0]["labels"]["reason"] == "no_lm_head"
        plain = trainvitals(
            "run", "--run", "regression", "--collector", c.url, "--every", "1", "--", sys.executable, "plain.py", "25"
        )
        assert plain.returncode == 0, plain.stderr
        assert [a for a in c.alerts("regression") if a["alertname"] == "SignalInactive"] == []
    start = next(line for line in proc.stderr.splitlines() if "trainvitals run: watching" in line)
    assert "blind: loss (no_lm_head: no LM head found (no get_output_embeddings()" in start
    close = next(line for line in proc.stderr.splitlines() if "closed after 25 optimizer step(s)" in line)
    assert "never engaged: loss (no_lm_head" in close and f"to HttpSink('{c.url}/v1/reports'), 0 not delivered" in close
    assert "not requested: loss" in next(line for line in plain.stderr.splitlines() if "closed after" in line)
