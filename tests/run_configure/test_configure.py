"""Live settings: ``PUT /v1/runs/{run}/settings`` (``trainvitals configure``) reaches a
running job in the answer to its next report; the job applies it at the step after and
goes back to its own settings when it expires, also with the collector gone; ranks of
a process group switch on the same step; ``/v1/runs`` shows what is set; writes need the
ingest token; the settings survive a collector restart."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import httpx
import pytest
import torch
from torch import nn

from tests.hooks._loss_models import (
    MODALITIES,
    TokenModel,
    padded,
    per_token_loss,
    reduce_loss,
    samples,
)
from tests.run_configure._helpers import (
    JOBS,
    TRAINVITALS,
    job_env,
    recording_collector,
    trainvitals,
)
from tests.support import finish_all, free_port, one_torch_thread, running_collector, wait_until
from trainvitals.hooks import attach, live_settings
from trainvitals.hooks.config import BUILTIN_SIGNALS
from trainvitals.hooks.live_settings import LIVE_FIELDS, decode, encode, parse_entry
from trainvitals.monitor import run_settings

TOKEN, READ = "ingest-secret", "read-secret"


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def report(run: str, step: int = 1) -> dict:
    return {"schema": 1, "reports": [{"run": run, "step": step, "time": time.time(), "samples": []}]}


# -- the collector's side ------------------------------------------------------------------
def test_the_collector_and_the_hooks_agree_on_what_can_be_set():
    assert run_settings.BUILTIN_SIGNALS == BUILTIN_SIGNALS
    assert run_settings.LIVE_FIELDS == LIVE_FIELDS


class StoppedClock:
    """A clock that stands still until :meth:`advance` moves it: the collector's for live
    settings (``RunSettingsTable(clock=...)``, Unix seconds) or the job's (the monotonic
    clock of ``trainvitals.hooks.live_settings``). An override then stays in force however
    slowly the machine runs the test, and expires when the test moves the clock, not when
    the wall clock happens to pass its deadline."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:  # stands in for the ``time`` module of live_settings
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def stop_the_collectors_clock(collector) -> StoppedClock:
    clock = StoppedClock(time.time())
    collector.app.state.run_settings = run_settings.RunSettingsTable(clock=clock)
    return clock


@pytest.fixture
def job_clock(monkeypatch) -> StoppedClock:
    """The job's clock for live settings' deadlines, stopped (see StoppedClock)."""
    clock = StoppedClock(1000.0)
    monkeypatch.setattr(live_settings, "time", clock)
    return clock


def test_settings_ride_in_the_answers_of_their_run_until_they_expire():
    with running_collector(state_path=None) as c:
        clock = stop_the_collectors_clock(c)
        assert c.client.post("/v1/reports", json=report("a/b")).json() == {"accepted": 1, "duplicates": []}
        c.client.post("/v1/reports", json=report("other"))
        put = c.client.put(
            "/v1/runs/a/b/settings",
            json={"every": 1, "signals": ["adam", "params"], "probe_every": None, "ttl_seconds": 1.5},
        )
        assert put.status_code == 200, put.text
        shown = put.json()["settings"]
        assert {k: shown[k] for k in ("every", "signals", "probe_every")} == {
            "every": 1,
            "signals": ["params", "adam"],
            "probe_every": None,
        }
        assert shown["expires_at"] == clock.now + 1.5
        answer = c.client.post("/v1/reports", json=report("a/b", 2)).json()
        entry = answer["settings"]["a/b"]
        assert entry.pop("expires_in") == pytest.approx(1.5)
        assert entry == {"every": 1, "signals": ["params", "adam"], "probe_every": None}
        assert "settings" not in c.client.post("/v1/reports", json=report("other", 2)).json()
        runs = {r["run"]: r for r in c.client.get("/v1/runs").json()}
        assert runs["a/b"]["settings"]["every"] == 1 and runs["other"]["settings"] is None
        assert c.client.get("/v1/runs/a/b/settings").json()["settings"]["every"] == 1
        clock.advance(1.4)
        assert c.client.post("/v1/reports", json=report("a/b", 3)).json()["settings"]["a/b"]["every"] == 1
        # Expired: the job is told nothing, so it uses its own settings.
        clock.advance(0.2)
        assert "settings" not in c.client.post("/v1/reports", json=report("a/b", 3)).json()
        assert c.client.get("/v1/runs/a/b/settings").json() == {"run": "a/b", "settings": None}
        assert {r["run"]: r["settings"] for r in c.client.get("/v1/runs").json()}["a/b"] is None
        # A PUT replaces; DELETE goes back to the job's own at once.
        c.client.put("/v1/runs/a/b/settings", json={"per_param": True})
        assert c.client.post("/v1/reports", json=report("a/b", 4)).json()["settings"]["a/b"]["per_param"] is True
        assert c.client.delete("/v1/runs/a/b/settings").json() == {"run": "a/b", "settings": None, "cleared": True}
        assert "settings" not in c.client.post("/v1/reports", json=report("a/b", 5)).json()


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        ({"every": 0}, 422, "every: Input should be greater than or equal to 1"),
        ({"every": "1"}, 422, "every: Input should be a valid integer"),
        ({"every": None}, 422, "every: null is not a value here; leave the field out to keep the job's own"),
        (
            {"signals": ["params", "grads"]},
            422,
            "signals.1: Input should be 'optimizer', 'params', 'adam' or 'packing'",
        ),
        ({"per_param": 1}, 422, "per_param: Input should be a valid boolean"),
        ({"every": 2, "ttl_seconds": 30 * 86400}, 422, "ttl_seconds: Input should be less than or equal to 604800"),
        ({"every": 2, "colour": "red"}, 422, "colour: Extra inputs are not permitted"),
        ({}, 422, "no settings given: set one of every, signals, per_param, probe_every"),
        (None, 400, "body is not JSON"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(body, status, detail):
    with running_collector(state_path=None) as c:
        c.client.post("/v1/reports", json=report("r"))
        content = b"{not json" if body is None else json.dumps(body).encode()
        resp = c.client.put("/v1/runs/r/settings", content=content)
        assert resp.status_code == status and detail in resp.json()["detail"], resp.text
        assert c.client.get("/v1/runs/r/settings").json()["settings"] is None


def test_settings_for_a_run_that_never_reported_are_refused():
    with running_collector(state_path=None) as c:
        c.client.post("/v1/reports", json=report("llm-7b"))
        resp = c.client.put("/v1/runs/llm-7B/settings", json={"every": 1})
        assert resp.status_code == 404
        # It names no other run: GET /v1/runs lists them, behind the read token.
        assert resp.json()["detail"] == (
            "no run 'llm-7B' has reported to this collector, or it expired "
            "(GET /v1/runs lists the runs; names are case-sensitive)"
        )
        assert c.client.put("/v1/runs/bad name/settings", json={"every": 1}).status_code == 422


def test_writes_need_the_ingest_token_and_reads_the_read_token():
    with running_collector(state_path=None, token=TOKEN, read_token=READ) as c:
        ingest = {"Authorization": f"Bearer {TOKEN}"}
        read = {"Authorization": f"Bearer {READ}"}
        c.client.post("/v1/reports", json=report("r"), headers=ingest)
        for headers in ({}, read):
            resp = c.client.put("/v1/runs/r/settings", json={"every": 1}, headers=headers)
            assert resp.status_code == 401 and "WWW-Authenticate" in resp.headers, resp.text
            assert c.client.delete("/v1/runs/r/settings", headers=headers).status_code == 401
        assert c.client.put("/v1/runs/r/settings", json={"every": 1}, headers=ingest).status_code == 200
        assert c.client.get("/v1/runs/r/settings").status_code == 401
        assert c.client.get("/v1/runs/r/settings", headers=ingest).status_code == 401
        assert c.client.get("/v1/runs/r/settings", headers=read).json()["settings"]["every"] == 1
        assert c.client.delete("/v1/runs/r/settings", headers=ingest).json()["cleared"] is True


def test_settings_survive_a_collector_restart_and_still_expire(tmp_path):
    state = tmp_path / "state.sqlite3"
    with running_collector(state_path=state) as c:
        c.client.post("/v1/reports", json=report("kept"))
        c.client.post("/v1/reports", json=report("brief"))
        c.client.put("/v1/runs/kept/settings", json={"every": 2, "ttl_seconds": 600})
        c.client.put("/v1/runs/brief/settings", json={"every": 3, "ttl_seconds": 0.5})
        expires = c.client.get("/v1/runs/kept/settings").json()["settings"]["expires_at"]
    time.sleep(0.6)
    with running_collector(state_path=state) as c:
        kept = c.client.get("/v1/runs/kept/settings").json()["settings"]
        assert kept["every"] == 2 and kept["expires_at"] == expires  # not extended by the restart
        assert c.client.get("/v1/runs/brief/settings").json()["settings"] is None
        assert c.client.post("/v1/reports", json=report("kept", 2)).json()["settings"]["kept"]["every"] == 2


# -- the job's side -------------------------------------------------------------------------
def test_answer_entries_are_checked_and_the_collective_encoding_round_trips():
    assert parse_entry({"every": 3, "signals": ["adam", "optimizer"], "expires_in": 5, "new": 1}) == (
        {"every": 3, "signals": ("optimizer", "adam")},
        5.0,
    )
    for bad, what in [
        ({"every": 3}, "expires_in"),
        ({"every": 0, "expires_in": 5}, "every"),
        ({"per_param": "yes", "expires_in": 5}, "per_param"),
        ({"signals": ["x"], "expires_in": 5}, "signals"),
        ([], "object"),
    ]:
        with pytest.raises(ValueError, match=what):
            parse_entry(bad)
    for override in (
        {},
        {"every": 1},
        {"signals": None},
        {"signals": ()},
        {"signals": ("params",)},
        {"per_param": False, "probe_every": None},
        {"per_param": True, "probe_every": 7},
    ):
        assert decode(encode(12, override)) == (12, override)


class Job:
    """A tiny model trained one step at a time, attached to a collector; each step
    waits for its report's answer (flush), as a job with slower steps would get it."""

    def __init__(self, url: str, run: str, **options):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.mon = attach(self.model, self.opt, run=run, collector=url, **options)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.opt.zero_grad()
            self.model(torch.randn(6, 4)).square().mean().backward()
            self.opt.step()
            assert self.mon.flush(60)


def test_a_new_interval_applies_within_two_steps_and_expires_back(job_clock):
    with recording_collector() as got:
        collector_clock = stop_the_collectors_clock(got.collector)
        job = Job(got.collector.url, "live", every=2)
        job.step(3)
        assert got.steps("live") == [1, 2]
        ttl = 4.0
        put = got.collector.client.put("/v1/runs/live/settings", json={"every": 1, "ttl_seconds": ttl})
        assert put.status_code == 200
        # Step 4 is a report step (every 2): its answer carries every=1. The answer comes
        # after step 4 ended; the end of step 5 applies it: step 6 is the first at every=1.
        job.step(4)
        assert got.steps("live") == [1, 2, 4, 6, 7]
        assert job.mon.config.every == 1 and job.mon._live.applied == {"every": 1}
        # The deadline passes, on both sides (the job's own clock decides).
        collector_clock.advance(ttl + 0.2)
        job_clock.advance(ttl + 0.2)
        # Step 8 was decided with every=1; its end finds the deadline passed: every 2 again.
        job.step(5)
        assert got.steps("live") == [1, 2, 4, 6, 7, 8, 10, 12]
        assert job.mon.config.every == 2 and job.mon._live.applied == {}
        job.mon.close()


def test_settings_expire_in_the_job_even_when_the_collector_is_gone(caplog, job_clock):
    with recording_collector() as got:
        stop_the_collectors_clock(got.collector)
        job = Job(got.collector.url, "orphan", every=3, flush_timeout=0.5)
        job.step(1)
        got.collector.client.put("/v1/runs/orphan/settings", json={"every": 1, "ttl_seconds": 1.5})
        job.step(3)  # step 3 reports and gets every=1
        assert job.mon.config.every == 1
    # The collector is gone: reports queue up, and the settings still end on time.
    for _ in range(3):
        job.opt.zero_grad()
        job.model(torch.randn(6, 4)).square().mean().backward()
        job.opt.step()
    assert job.mon.config.every == 1  # not yet: the job's clock has not passed the deadline
    job_clock.advance(1.7)
    job.opt.step()
    assert job.mon.config.every == 3 and job.mon._live.applied == {}
    job.mon.close()


def test_signals_and_per_parameter_series_switch_live_keeping_their_state(caplog):
    with recording_collector() as got:
        job = Job(got.collector.url, "sig", every=1)
        start = {n: p.detach().clone() for n, p in job.model.named_parameters()}
        job.step(2)
        caplog.set_level("INFO", logger="trainvitals")
        caplog.clear()
        first = got.of("sig")[-1]
        assert "adam_exp_avg_norm" in first.names and "grad_norm" in first.names
        assert first.labels_of("param_max", "param") == {"0.bias", "1.weight", "1.bias", "2.bias"}
        got.collector.client.put("/v1/runs/sig/settings", json={"signals": ["params"], "per_param": True})
        job.step(3)  # step 3's answer carries them, the end of step 4 applies them
        narrow = got.of("sig")[-1]
        assert narrow.step == 5
        assert not {"adam_exp_avg_norm", "grad_norm", "update_ratio"} & narrow.names
        assert narrow.labels_of("param_grad_relative_rms", "param") == {
            "0.bias",
            "1.weight",
            "1.bias",
            "2.bias",
            "0.weight",
            "2.weight",
        }  # per_param: 2D too
        got.collector.client.delete("/v1/runs/sig/settings")
        job.step(3)
        back = got.of("sig")[-1]
        assert back.step == 8
        assert {"adam_exp_avg_norm", "grad_norm"} <= back.names
        assert back.labels_of("param_grad_relative_rms", "param") == {"0.bias", "1.weight", "1.bias", "2.bias"}
        assert not any(
            "optimizer_state_reset" in g.events or "weight_decay_audit" in g.events for g in got.of("sig")[1:]
        )
        assert back.value("optimizer_state_resets_total") == 0
        # Each change is one line in the job saying what changed; nothing else (no audit, no
        # "drift continues from the checkpoint": no checkpoint is involved).
        said = [r.getMessage() for r in caplog.records if r.name == "trainvitals"]  # the job's, not the collector's
        assert len(said) == 2, said
        assert "live settings from the collector from step 5" in said[0] and "signals=params" in said[0]
        assert "back to the job's own settings from step 8" in said[1]
        # The drift is still measured from the values at attach, through both rebuilds.
        for name in ("0.bias", "2.bias"):
            ref, now = start[name], dict(job.model.named_parameters())[name].detach()
            expected = math.log2(1 + float((now - ref).abs().max() / ref.abs().max()))
            assert back.value("param_drift_log2", param=name) == pytest.approx(expected, rel=1e-5)
        job.mon.close()


def test_the_probe_interval_switches_live():
    batches = [padded(samples([12, 7, 9], [0, 1, 0], seed=5), 0)]
    with recording_collector() as got:
        model = TokenModel(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = attach(model, opt, run="probe", collector=got.collector.url, every=1, modalities=MODALITIES)

        def step() -> set[str]:
            opt.zero_grad()
            for rows in batches:
                pt, logits = per_token_loss(model, rows)
                mon.track_loss(pt, modality=rows.modality, mask=rows.mask, output=logits)
                reduce_loss(pt, rows, "token", total_tokens=float(rows.mask.sum())).backward()
            opt.step()
            assert mon.flush(60)
            return got.of("probe")[-1].labels_of("modality_grad_norm", "scope")

        assert step() == {"output"}
        got.collector.client.put("/v1/runs/probe/settings", json={"probe_every": 1})
        step(), step()  # step 2's answer carries it, the end of step 3 applies it
        assert step() == {"output", "params"}
        got.collector.client.delete("/v1/runs/probe/settings")
        step(), step()
        assert step() == {"output"}
        mon.close()


@pytest.mark.slow
def test_data_parallel_ranks_switch_on_the_same_step(tmp_path):
    out = tmp_path / "out.json"
    with recording_collector() as got:
        port = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, str(JOBS / "ddp_live.py"), str(r), "2", str(port), str(out), got.collector.url],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        try:
            wait_until(
                lambda: got.steps("ddp-live") or any(p.poll() is not None for p in procs), 120, "the first report"
            )
            resp = got.collector.client.put("/v1/runs/ddp-live/settings", json={"every": 1})
            assert resp.status_code == 200, resp.text
        finally:
            finish_all(procs, 180, "data-parallel ranks")
        steps = got.steps("ddp-live")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # The same interval at every step on both ranks: their report collectives stayed aligned.
    assert r0["every"] == r1["every"] and r0["reported"] == r1["reported"]
    switch = r0["every"].index(1)  # the 0-based index of the last step run with every=4
    assert set(r0["every"][:switch]) == {4} and set(r0["every"][switch:]) == {1}
    # The collector got every step from the switch on, from rank 0 only.
    assert steps == r0["reported"] and steps[-12:] == list(range(steps[-12], steps[-12] + 12))
    assert all(g.rank == 0 for g in got.of("ddp-live"))


class _CollectorClock:
    """The collector's clock for live settings: stopped until :meth:`jump`, so an
    override stays in force however slowly this test gets to its checks (no race with
    its expiry), then moved past the expiry at a moment the test chooses."""

    def __init__(self) -> None:
        self.stopped_at: float | None = time.time()
        self.skew = 0.0

    def __call__(self) -> float:
        return self.stopped_at if self.stopped_at is not None else time.time() + self.skew

    def jump(self, seconds: float) -> None:
        self.skew, self.stopped_at = seconds, None


def test_trainvitals_configure_changes_a_running_job_and_it_goes_back():
    with recording_collector() as got:
        url = got.collector.url
        clock = _CollectorClock()
        got.collector.app.state.run_settings = run_settings.RunSettingsTable(clock=clock)
        job = subprocess.Popen(
            [
                TRAINVITALS,
                "run",
                "--run",
                "cli-live",
                "--collector",
                url,
                "--every",
                "5",
                "--",
                sys.executable,
                "plain.py",
                "300",
                "--sleep",
                "0.04",
            ],
            cwd=JOBS,
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(lambda: got.steps("cli-live") or job.poll() is not None, 120, "the first report")
            cfg = trainvitals("configure", "cli-live", "--every", "1", "--for", "30s", "--collector", url)
            assert cfg.returncode == 0, cfg.stderr
            configured = time.time()
            assert cfg.stdout.startswith("run 'cli-live': every=1 until ")
            assert "the job applies them from the step after its next report" in cfg.stdout
            shown = trainvitals("configure", "cli-live", "--collector", url)
            assert shown.stdout.startswith("run 'cli-live': every=1 until "), shown.stdout
            runs = httpx.get(f"{url}/v1/runs").json()
            assert [r["settings"]["every"] for r in runs if r["run"] == "cli-live"] == [1]
            # In force for a while (a dozen consecutive steps reported), then the collector's
            # clock passes the 30 s: its answers carry no settings and the job goes back.
            wait_until(
                lambda: sum(1 for s in got.steps("cli-live") if s % 5) >= 12 or job.poll() is not None,
                120,
                "a dozen steps reported under every=1",
            )
            clock.jump(60.0)
            _out, err = job.communicate(timeout=180)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        assert job.returncode == 0, err
        reports = got.of("cli-live")
        gone = trainvitals("configure", "cli-live", "--reset", "--collector", url)
        assert (
            gone.stdout.strip() == "run 'cli-live': back to the job's own settings at its next report (none were set)"
        )
    steps = [g.step for g in reports]
    # The first report after the configure carries it; from two steps after that report,
    # every step reports, until the settings expire; then every 5th step again.
    k = next(g.step for g in reports if g.received > configured)
    live = [s for s in steps if s % 5 and s > k]
    assert live, steps
    first, last = live[0], live[-1]
    assert first <= k + 2, (k, steps)
    assert steps == sorted(
        set([s for s in steps if s <= first]) | set(range(first, last + 1)) | {s for s in steps if s > last}
    )
    assert [s for s in steps if s > last + 1] and all(s % 5 == 0 for s in steps if s > last + 1), steps
    assert last - first >= 10  # in force until the collector's clock passed the expiry


# -- trainvitals configure's own checks ----------------------------------------------------
def test_configure_defaults_to_serves_address_and_speaks_in_the_users_terms():
    from click.testing import CliRunner

    from trainvitals.monitor.cli import main
    from trainvitals.monitor.cli_run import configure
    from trainvitals.monitor.settings import DEFAULT_PORT, Settings

    (collector,) = [p for p in configure.params if p.name == "collector"]
    assert collector.default == f"http://{Settings.model_fields['host'].default}:{DEFAULT_PORT}"
    over = CliRunner().invoke(main, ["configure", "r", "--every", "1", "--for", "8d"])
    assert over.exit_code == 2 and "8d: settings last at most 7d" in over.output
    assert "ttl_seconds" not in over.output
    alone = CliRunner().invoke(main, ["configure", "r", "--for", "10m"])
    assert alone.exit_code == 2 and "--for 10m says how long settings last, but no setting is given" in alone.output


def test_settings_for_an_ended_run_are_refused_with_the_reason():
    with running_collector() as c:
        body = report("done", 40)
        body["reports"][0]["events"] = [{"kind": "run_end", "labels": {}, "detail": ""}]
        assert c.client.post("/v1/reports", json=body).status_code == 202
        refused = c.client.put("/v1/runs/done/settings", json={"every": 1})
        assert refused.status_code == 409
        assert refused.json()["detail"].startswith("run 'done' ended at step 40")
        from click.testing import CliRunner

        from trainvitals.monitor.cli import main

        out = CliRunner().invoke(main, ["configure", "done", "--every", "1", "--collector", c.url])
        assert out.exit_code == 1 and "HTTP 409: run 'done' ended at step 40" in out.output
