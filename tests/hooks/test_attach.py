"""attach(): argument checks, hook lifecycle, and the optimizer statistics against
plain-torch references."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from trainvitals.hooks import Monitor, attach
from trainvitals.wire import Report


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 3))


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


# -- argument checks -----------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": "not a model"}, TypeError, "torch.nn.Module"),
        ({"optimizer": object()}, TypeError, "torch.optim.Optimizer"),
        ({"run": "has space"}, ValueError, "run="),
        ({"run": ""}, ValueError, "run="),
        ({"run": "exp//1"}, ValueError, "without empty, '.' or '..' parts"),
        ({"run": "x" * 129}, ValueError, "1-128 characters"),
        ({"collector": "http://x:1", "sink": "null"}, ValueError, "either collector"),
        ({"collector": "127.0.0.1:9477"}, ValueError, "http"),
        ({"sink": "ftp://nowhere"}, ValueError, "file:"),
        ({"modalities": "text"}, TypeError, "sequence of names"),
        ({"modalities": ("text", "text")}, ValueError, "unique"),
        ({"modalities": ("te xt",)}, ValueError, "usable name"),
        ({"every": 0}, ValueError, "every must be a positive integer"),
        ({"scaler": 3}, TypeError, "GradScaler"),
        ({"evry": 5}, TypeError, "unknown option"),
        ({"signals": ("optimizer", "nope")}, ValueError, "signals"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_attach_rejects_wrong_arguments_at_once(kwargs, error, match):
    model = tiny()
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "run": "r1", "sink": "null"}
    args.update(kwargs)
    if "collector" in kwargs and "sink" not in kwargs:
        args.pop("sink")
    model_arg, opt_arg = args.pop("model"), args.pop("optimizer")
    with pytest.raises(error, match=match):
        attach(model_arg, opt_arg, **args)


# -- reference statistics --------------------------------------------------------
@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "adam-2groups"])
def test_norms_and_update_ratio_match_plain_torch(opt_name):
    model = tiny()
    params = list(model.parameters())
    if opt_name == "sgd":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        groups = [("0", params)]
    elif opt_name == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2)
        groups = [("0", params)]
    else:
        mats = [p for p in params if p.ndim == 2]
        vecs = [p for p in params if p.ndim < 2]
        opt = torch.optim.Adam([{"params": mats, "name": "mats"}, {"params": vecs}], lr=1e-2)
        groups = [("mats", mats), ("1", vecs)]
    with attach(model, opt, run="ref", sink="null", every=1) as mon:
        for i in range(3):
            model(torch.randn(8, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
            grad_ref = {label: torch.nn.utils.get_total_norm([p.grad for p in ps]).item() for label, ps in groups}
            all_ref = torch.nn.utils.clip_grad_norm_(params, float("inf")).item()
            before = [p.detach().clone() for p in params]
            opt.step()
            opt.zero_grad()
            assert mon.value("grad_norm") == pytest.approx(all_ref, rel=1e-5)
            for label, ps in groups:
                assert mon.value("group_grad_norm", group=label) == pytest.approx(grad_ref[label], rel=1e-5)
                idx = [next(j for j, q in enumerate(params) if q is p) for p in ps]
                du = torch.cat([(params[j].detach() - before[j]).flatten() for j in idx])
                pa = torch.cat([params[j].detach().flatten() for j in idx])
                assert mon.value("group_param_norm", group=label) == pytest.approx(pa.norm().item(), rel=1e-5)
                assert mon.value("group_update_ratio", group=label) == pytest.approx(
                    (du.norm() / pa.norm()).item(), rel=1e-4
                )
            assert mon.value("nonfinite_total", what="grad") == 0


def test_update_ratio_samples_large_tensors_in_evenly_spaced_runs():
    """Tensors above update_sample elements: cap // 16 runs of 16 contiguous elements,
    numel // (cap // 16) apart (cache lines, not single strided elements)."""
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def sample(t: torch.Tensor, cap: int = 64) -> torch.Tensor:
        flat = t.detach().flatten()
        if flat.numel() <= cap:
            return flat
        blocks, spacing = cap // 16, flat.numel() // (cap // 16)
        return torch.cat([flat[i * spacing : i * spacing + 16] for i in range(blocks)])

    with attach(model, opt, run="ref", sink="null", every=1, update_sample=64) as mon:
        model(torch.randn(4, 100)).sum().backward()
        before = [sample(p) for p in model.parameters()]
        opt.step()
        du = torch.cat([sample(p) - b for p, b in zip(model.parameters(), before, strict=True)])
        pa = torch.cat([sample(p) for p in model.parameters()])
        assert mon.value("update_ratio") == pytest.approx((du.norm() / pa.norm()).item(), rel=1e-5)


def test_nonfinite_gradients_are_counted_per_step():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with attach(model, opt, run="nf", sink="null", every=1) as mon:
        step(model, opt, 0)
        assert mon.value("nonfinite_total", what="grad") == 0
        # Gradients set by hand, no backward: the gradient the optimizer is given counts.
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        model[0].weight.grad[0, 0] = float("nan")
        model[3].bias.grad[0] = float("inf")
        opt.step()
        opt.zero_grad()
        assert mon.value("nonfinite_total", what="grad") == 1
        assert math.isnan(mon.value("group_grad_norm", group="0"))
        # Non-finite out of the backward itself: counted, grad_norm says so.
        (model(torch.randn(8, 6)).pow(2).mean() * float("inf")).backward()
        opt.step()
        opt.zero_grad()
        assert mon.value("nonfinite_total", what="grad") == 2
        assert not math.isfinite(mon.value("grad_norm"))
        assert mon.value("grad_norm_max") is None  # no finite step since the previous report


def test_reports_on_first_step_and_every_n():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with attach(model, opt, run="every", sink="null", every=3) as mon:
        for i in range(7):
            step(model, opt, i)
            seen.append(mon._latest.step if mon._latest else None)
    assert seen == [1, 1, 3, 3, 3, 6, 6]


def test_close_removes_every_hook_and_is_idempotent():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre, post = len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)
    mon = attach(model, opt, run="close", sink="null", every=1)
    assert len(opt._optimizer_step_pre_hooks) == pre + 1
    step(model, opt, 0)
    mon.close()
    mon.close()
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (pre, post)
    last = mon.latest()
    step(model, opt, 1)
    assert mon.latest() == last and mon.step == 1


def test_the_step_makes_no_host_sync(monkeypatch):
    """Our hooks add no .item()/.tolist()/float() on the training thread: the
    monitored step makes exactly the calls the optimizer itself makes."""
    from tests.support import HostSyncSpy

    base_model, model = tiny(), tiny()
    base_opt = torch.optim.AdamW(base_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(model, opt, run="sync", sink="null", every=1)
    counts = []
    for m, o in ((base_model, base_opt), (model, opt)):
        m(torch.randn(8, 6)).pow(2).mean().backward()
        spy = HostSyncSpy(monkeypatch)
        o.step()
        counts.append(spy.stop())
    mon.close()
    assert counts[1] == counts[0]


def test_file_sink_writes_valid_wire_reports(tmp_path):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.jsonl"
    with attach(model, opt, run="file-run", sink=f"file:{path}", every=2):
        for i in range(4):
            step(model, opt, i)
    lines = path.read_text().splitlines()
    reports = [Report.model_validate(json.loads(line)) for line in lines]
    assert [r.step for r in reports] == [1, 2, 4, 4]
    assert {s.name for s in reports[-2].samples} >= {
        "grad_norm",
        "param_norm",
        "update_ratio",
        "client_dropped_reports_total",
    }
    # close() sends a last report that marks the run as ended on purpose.
    assert [e.kind for e in reports[-1].events] == ["run_end"]


def test_default_sink_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINVITALS_COLLECTOR", f"file:{tmp_path / 'env.jsonl'}")
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, opt, run="env") as mon:
        step(model, opt, 0)
        assert "env.jsonl" in repr(mon)
    assert (tmp_path / "env.jsonl").exists()


def test_default_sink_without_environment_is_a_local_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINVITALS_COLLECTOR", raising=False)
    monkeypatch.chdir(tmp_path)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, opt, run="local"):
        step(model, opt, 0)
    assert (tmp_path / "trainvitals-local.jsonl").exists()


def test_names_are_those_of_the_unwrapped_model():
    model = tiny()
    compiled_like = nn.Module()
    compiled_like._orig_mod = model  # what torch.compile's wrapper holds
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(compiled_like, opt, run="names", sink="null") as mon:
        assert isinstance(mon, Monitor)
        assert sorted(mon.param_names.values()) == sorted(n for n, _ in model.named_parameters())


def test_a_failing_signal_is_turned_off_not_raised(caplog):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, opt, run="broken", sink="null", every=1) as mon:

        def boom(*a):
            raise RuntimeError("bug in a signal")

        mon.signals[0].collect = boom
        step(model, opt, 0)
        step(model, opt, 1)
        # Logged once when it happens (the close summary repeats it as a coverage reason).
        assert sum("bug in a signal" in r.getMessage() for r in caplog.records) == 1
        assert mon.latest_coverage()[0] == {
            "signal": "optimizer",
            "active": False,
            "reason": "failed",
            "detail": "OptimizerStats failed in collect: RuntimeError: bug in a signal",
        }


def test_latest_hands_out_copies_a_caller_may_change():
    """The signals keep their label dicts across reports: what ``latest()`` returns is
    the caller's own, and changing it changes no later report."""
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(model, opt, run="copies", sink="null", every=1, rules="off")
    for seed in range(2):
        step(model, opt, seed)
        for s in mon.latest():
            s["labels"]["scribbled"] = "yes"
        for e in mon.latest_events():
            e["labels"]["scribbled"] = "yes"
    assert all("scribbled" not in s["labels"] for s in mon.latest())
    mon.close()
