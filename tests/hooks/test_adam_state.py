"""AdamState (docs/incidents.md I4): Adam's epsilon share, normalized update and moment
norms against a float64 element-wise reference from the optimizer state, for the
plain, foreach and fused kernels, amsgrad and AdamW; optimizer state resets."""

from __future__ import annotations

import io
import math

import pytest
import torch

from tests.hooks._param_models import LARGE_EPS_LOSS_SCALE, OPTIMIZERS, Tiny, adam_reference, series, train
from trainvitals.hooks import attach

ADAM_METRICS = ("adam_eps_dominated_ratio", "adam_normalized_update_rms", "adam_exp_avg_norm", "adam_exp_avg_sq_norm")
ADAM_VARIANTS = [k for k in OPTIMIZERS if not k.startswith("sgd")]


def monitored(opt_name: str = "adam", **options):
    model = Tiny(0)
    opt = OPTIMIZERS[opt_name](model)
    options.setdefault("signals", ("adam",))
    options.setdefault("every", 1)
    mon = attach(model, opt, run="adam", sink="null", **options)
    return model, opt, mon


def assert_matches(samples: list[dict], ref: dict[str, dict[str, float]]) -> None:
    for metric in ADAM_METRICS:
        got = series(samples, metric)
        assert got.keys() == ref[metric].keys(), metric
        for label, want in ref[metric].items():
            assert got[label] == pytest.approx(want, rel=2e-5, abs=1e-9), (metric, label)


@pytest.mark.parametrize("opt_name", ADAM_VARIANTS)
def test_statistics_match_the_elementwise_reference(opt_name):
    model, opt, mon = monitored(opt_name)
    scale = LARGE_EPS_LOSS_SCALE if "large-eps" in opt_name else 1.0
    for step in range(5):
        train(model, opt, mon, 1, start=step, loss_scale=scale)
        assert_matches(mon.latest(), adam_reference(model, opt))
    mon.close()


@pytest.mark.parametrize("opt_name", ["adam", "adamw-groups"])
def test_per_param_reports_matrices_too_and_keeps_the_group_aggregate(opt_name):
    model, opt, mon = monitored(opt_name, per_param=True)
    train(model, opt, mon, 3)
    got = series(mon.latest(), "adam_exp_avg_norm")
    assert {"lin1.weight", "lin2.weight"} <= got.keys()
    assert_matches(mon.latest(), adam_reference(model, opt, per_param=True))
    mon.close()


def test_large_tensors_use_a_block_sample_of_update_sample_elements():
    """lin1.weight (72 elements) over update_sample=32: two runs of 16 elements,
    spaced 72 // 2 = 36 apart; lin2.weight (36): the same with spacing 18."""
    model, opt, mon = monitored("adam-large-eps", update_sample=32)
    train(model, opt, mon, 4, loss_scale=LARGE_EPS_LOSS_SCALE)

    def sample(x: torch.Tensor) -> torch.Tensor:
        spacing = x.numel() // 2
        return torch.cat([x[:16], x[spacing : spacing + 16]])

    assert_matches(mon.latest(), adam_reference(model, opt, sample=sample))
    mon.close()


def test_eps_dominated_share_is_fractional_when_gradients_straddle_eps():
    model, opt, mon = monitored("adam-large-eps")
    train(model, opt, mon, 3, loss_scale=LARGE_EPS_LOSS_SCALE)
    share = series(mon.latest(), "adam_eps_dominated_ratio")["0"]
    assert 0.0 < share < 1.0
    mon.close()


def test_sgd_has_no_adam_statistics_and_nothing_breaks():
    model, opt, mon = monitored("sgd-momentum", signals=("params", "adam", "optimizer"))
    train(model, opt, mon, 3)
    names = {s["name"] for s in mon.latest()}
    assert not any(n.startswith("adam_") for n in names)
    assert mon.value("optimizer_state_resets_total") == 0.0
    assert "param_drift_log2" in names
    mon.close()


class AdamSubclass(torch.optim.Adam):
    """A user subclass: recognized by its state keys, not its class."""


def test_an_adam_subclass_is_recognized_by_its_state_keys():
    model = Tiny(0)
    opt = AdamSubclass(model.parameters(), lr=0.02)
    mon = attach(model, opt, run="sub", sink="null", every=1, signals=("adam",))
    train(model, opt, mon, 2)
    assert_matches(mon.latest(), adam_reference(model, opt))
    mon.close()


# -- optimizer state resets ---------------------------------------------------------------
def resets(mon) -> tuple[float | None, list[str]]:
    return (
        mon.value("optimizer_state_resets_total"),
        [e["detail"] for e in mon.latest_events() if e["kind"] == "optimizer_state_reset"],
    )


@pytest.mark.parametrize("every", [1, 5], ids=["reset-at-report", "reset-between-reports"])
@pytest.mark.parametrize("opt_name", ["adam", "adam-fused", "adamw-foreach-groups"])
def test_state_cleared_and_refilled_is_one_reset(opt_name, every):
    model, opt, mon = monitored(opt_name, every=every)
    train(model, opt, mon, 10)
    assert resets(mon) == (0.0, [])
    opt.state.clear()  # refilled by the next step: step counts restart from 1
    train(model, opt, mon, every, start=10)
    count, details = resets(mon)
    assert count == 1.0
    assert len(details) == 1 and "restarted" in details[0]
    train(model, opt, mon, every, start=10 + every)
    assert resets(mon) == (1.0, [])
    mon.close()


def test_reset_right_after_a_report_is_caught_at_the_next_one():
    """Cleared just after report step 5: at step 10 the step counts read 5 = the
    steps elapsed; a plain "went back" check would miss it."""
    model, opt, mon = monitored(every=5)
    train(model, opt, mon, 5)
    opt.state.clear()
    train(model, opt, mon, 5, start=5)
    assert resets(mon)[0] == 1.0
    mon.close()


def test_step_count_zeroed_in_place_is_a_reset():
    model, opt, mon = monitored(every=1)
    train(model, opt, mon, 4)
    for st in opt.state.values():
        st["step"].zero_()
    train(model, opt, mon, 1, start=4)
    count, details = resets(mon)
    assert count == 1.0 and len(details) == 1
    mon.close()


def rebuild(opt: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Rebuild an optimizer's groups in place, dropping its state (what re-creating it does)."""
    opt.param_groups.clear()
    opt.state.clear()
    for g in groups:
        opt.add_param_group(g)


def test_optimizer_rebuilt_with_the_same_groups_is_a_reset():
    model, opt, mon = monitored("adamw-groups", every=1)
    train(model, opt, mon, 3)
    rebuild(
        opt, [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])} for g in opt.param_groups]
    )
    train(model, opt, mon, 1, start=3)
    count, details = resets(mon)
    assert count == 1.0
    assert len(details) == 1 and "restarted" in details[0]
    mon.close()


def test_optimizer_rebuilt_with_other_groups_is_a_reset():
    model, opt, mon = monitored("adamw-groups", every=1)
    train(model, opt, mon, 3)
    rebuild(opt, [{"params": list(model.parameters()), "weight_decay": 0.0, "lr": 0.02}])
    train(model, opt, mon, 1, start=3)
    count, details = resets(mon)
    assert count == 1.0
    assert len(details) == 1 and "param groups changed (2 -> 1 groups" in details[0]
    mon.close()


def test_state_emptied_without_refill_is_a_reset():
    model, opt, mon = monitored(every=1)
    train(model, opt, mon, 3)
    model.scale.requires_grad_(False)  # no gradient: the next step does not refill its state
    del opt.state[model.scale]
    train(model, opt, mon, 1, start=3)
    count, details = resets(mon)
    assert count == 1.0
    assert len(details) == 1 and "emptied for 1 parameter(s) (scale)" in details[0]
    mon.close()


def test_new_param_group_counts_as_a_reset_of_the_optimizer_layout():
    model = Tiny(0)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("lin2")], lr=0.01)
    mon = attach(model, opt, run="grow", sink="null", every=1, signals=("adam",))
    train(model, opt, mon, 2)
    opt.add_param_group({"params": list(model.lin2.parameters())})
    train(model, opt, mon, 1, start=2)
    count, details = resets(mon)
    assert count == 1.0 and "2 parameters added" in details[0]
    mon.close()


def test_no_reset_for_steps_a_parameter_sits_out_or_a_reloaded_checkpoint():
    """A parameter without gradient for some steps keeps its step count (Adam skips
    it): no false reset. A checkpoint reloaded into the optimizer keeps its step
    counts: not a reset either."""
    model, opt, mon = monitored(every=2)
    train(model, opt, mon, 4)
    model.scale.requires_grad_(False)
    train(model, opt, mon, 4, start=4)
    model.scale.requires_grad_(True)
    train(model, opt, mon, 2, start=8)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf))
    train(model, opt, mon, 2, start=10)
    assert resets(mon) == (0.0, [])
    mon.close()


def test_reset_makes_the_1d_parameters_eps_dominated_again():
    """After a reset the moments restart: with a tiny gradient, v is below eps^2 again."""
    model, opt, mon = monitored(every=1)
    handle = model.scale.register_hook(lambda g: g * 1e-9)
    train(model, opt, mon, 5)
    opt.state.clear()
    train(model, opt, mon, 1, start=5)
    assert series(mon.latest(), "adam_eps_dominated_ratio")["scale"] == 1.0
    assert series(mon.latest(), "adam_normalized_update_rms")["scale"] < 1.0
    handle.remove()
    mon.close()


class ComplexModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat))
        self.b = torch.nn.Parameter(torch.randn(3, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w + self.b).abs().sum()


def test_complex_parameters_count_as_real_pairs():
    """Adam steps a complex parameter as (real, imaginary) pairs; so do the statistics."""
    model = ComplexModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = attach(model, opt, run="complex", sink="null", every=1, signals=("params", "adam"))
    for i in range(3):
        model(torch.randn(5, 4, dtype=torch.cfloat, generator=torch.Generator().manual_seed(i))).backward()
        opt.step()
        opt.zero_grad()
    st = opt.state[model.b]
    m = torch.view_as_real(st["exp_avg"])
    assert mon.value("adam_exp_avg_norm", param="b") == pytest.approx(float(m.norm()), rel=1e-6)
    assert mon.value("param_absmax", param="b") == pytest.approx(
        float(torch.view_as_real(model.b.detach()).abs().max())
    )
    mon.close()


def test_a_non_finite_moment_stays_in_its_own_group_and_parameter():
    """An infinite gradient in one group's weight makes that group's moments (and its
    parameter's series) non-finite, never the other group's: the figures are summed per
    group without multiplying any entry by another group's 0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "name": "a"}, {"params": model[1].parameters(), "name": "b"}], lr=1e-2
    )
    mon = attach(model, opt, run="inf-moment", sink="null", every=1, rules="off")
    for step in range(3):
        model(torch.randn(2, 4)).sum().backward()
        if step == 2:
            model[1].weight.grad[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
    samples = [s for s in mon.latest() if s["name"].startswith("adam_exp_avg")]
    mon.close()
    assert samples

    def side(labels: dict) -> str | None:
        if "group" in labels:
            return labels["group"]
        return {"0": "a", "1": "b"}.get(labels.get("param", "").split(".")[0])

    healthy = [s for s in samples if side(s["labels"]) == "a"]
    hit = [s for s in samples if s["labels"] == {"group": "b"} and s["name"] == "adam_exp_avg_norm"]
    assert healthy and hit
    assert all(math.isfinite(s["value"]) for s in healthy), healthy
    assert not any(math.isfinite(s["value"]) for s in hit), hit


def test_load_state_dict_frees_the_old_moments_and_the_next_report_reads_the_new():
    """``optimizer.load_state_dict`` replaces every state tensor: the monitor must not
    keep the old moments alive until its next report (a second copy of Adam's memory on
    a resumed or rolled-back job), and its next report reads the new ones right (a resume
    with the same step counts is no reset)."""
    import copy
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(model, opt, run="reload", sink="null", every=5, rules="off")

    def step() -> None:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(5):  # the report at step 5 walks the state
        step()
    old = [weakref.ref(t) for st in opt.state.values() for k, t in st.items() if k.startswith("exp_avg")]
    assert len(old) == 4
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    gc.collect()
    assert [r() for r in old] == [None] * 4
    for _ in range(5):
        step()
    samples = mon.latest()
    mon.close()
    assert_matches(samples, adam_reference(model, opt))
    assert [s["value"] for s in samples if s["name"] == "optimizer_state_resets_total"] == [0.0]
