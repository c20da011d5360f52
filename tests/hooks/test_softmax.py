"""Softmax saturation and distillation (I5): every statistic against plain torch
on full logits, the step's accumulation, argument checks, no host sync, and the
distillation reproduction with its healthy twin."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import attach
from trainvitals.hooks.signals.softmax import maths as sm

SATURATION = (
    "softmax_top1_prob_mean",
    "softmax_saturated_ratio",
    "softmax_jacobian_mean",
    "softmax_entropy_nats",
    "softmax_recommended_temperature",
)


def monitor(every: int = 1, **options):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return attach(model, opt, run="softmax", sink="null", every=every, **options), model, opt


def finish_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()


def logits_with_margins(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random logits whose top-1 probabilities spread from ~uniform to > 0.999."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    n = math.prod(shape[:-1])
    margins = torch.rand(n, generator=g) * 25
    z.view(-1, shape[-1])[:, 0] += margins
    return z


# -- plain-torch reference -----------------------------------------------------------
def selected(logits: torch.Tensor, mask: torch.Tensor | None, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions the signal documents it keeps: stride ceil(N / cap), coprime with T."""
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    period = logits.shape[1] if logits.ndim == 3 else 1
    stride = max(1, -(-flat.shape[0] // cap))
    while stride > 1 and period > 1 and math.gcd(stride, period) != 1:
        stride += 1
    w = torch.ones(flat.shape[0]) if mask is None else mask.reshape(-1).double()
    return flat[::stride], w[::stride]


def reference(
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    cap: int = 4096,
    target: float = 0.7,
) -> dict[str, float]:
    z, w = selected(logits, mask, cap)
    keep = w > 0
    z, w = z[keep].double(), w[keep]
    p = torch.softmax(z / temperature, -1)
    q = p.max(-1).values

    def mean(x: torch.Tensor) -> float:
        return ((x * w).sum() / w.sum()).item()

    def mean_top1_at(t: float) -> float:
        return mean(torch.softmax(z / t, -1).max(-1).values)

    if mean_top1_at(1.0) <= target:
        t_rec = 1.0
    else:  # bisection in log T on the full logits
        lo, hi = 0.0, math.log(sm.TEMPERATURE_MAX)
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_top1_at(math.exp(mid)) > target else (lo, mid)
        t_rec = math.exp((lo + hi) / 2)
    return {
        "softmax_top1_prob_mean": mean(q),
        "0.99": mean((q > 0.99).double()),
        "0.999": mean((q > 0.999).double()),
        "softmax_jacobian_mean": mean(q * (1 - q)),
        "softmax_entropy_nats": mean(torch.special.entr(p).sum(-1)),  # -sum p ln p, 0 ln 0 = 0
        "softmax_recommended_temperature": t_rec,
        "mean_top1_at_recommended": mean_top1_at(t_rec),
    }


def reported(mon, task: str = "all", role: str = "student") -> dict[str, float]:
    out = {name: mon.value(name, task=task, role=role) for name in SATURATION if name != "softmax_saturated_ratio"}
    for t in ("0.99", "0.999"):
        out[t] = mon.value("softmax_saturated_ratio", task=task, role=role, threshold=t)
    return out


def assert_matches(got: dict[str, float], ref: dict[str, float], *, exact_t: bool = True) -> None:
    for key in ("softmax_top1_prob_mean", "softmax_jacobian_mean", "0.99", "0.999"):
        assert got[key] == pytest.approx(ref[key], abs=2e-6), key
    assert got["softmax_entropy_nats"] == pytest.approx(ref["softmax_entropy_nats"], rel=1e-4, abs=1e-5)
    assert got["softmax_recommended_temperature"] == pytest.approx(ref["softmax_recommended_temperature"], rel=0.01)


SHAPES = {
    "BTV-small-vocab": (3, 7, 50),
    "NV-small-vocab": (21, 50),
    "BTV-binned-vocab": (2, 9, 700),
    "NV-binned-vocab": (17, 3000),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_saturation_statistics_match_plain_torch(shape, dtype, masked):
    logits = logits_with_margins(shape).to(dtype)
    mask = None
    if masked:
        mask = torch.rand(shape[:-1], generator=torch.Generator().manual_seed(5)) > 0.3
        logits[~mask] = float("nan")  # masked-out positions must not leak in
    mon, model, opt = monitor()
    mon.observe_logits(logits, mask=mask)
    finish_step(model, opt)
    assert_matches(reported(mon), reference(logits.float(), mask))
    mon.close()


@pytest.mark.parametrize("temperature", [0.5, 2.0, 5.0])
def test_statistics_are_taken_at_the_observed_temperature(temperature):
    logits = logits_with_margins((32, 300), seed=1)  # the knots see every position
    mon, model, opt = monitor()
    mon.observe_logits(logits, task="ie", role="teacher", temperature=temperature)
    finish_step(model, opt)
    ref = reference(logits, temperature=temperature)
    ref["softmax_recommended_temperature"] = reference(logits)["softmax_recommended_temperature"]  # absolute
    assert_matches(reported(mon, "ie", "teacher"), ref)
    mon.close()


def test_subsampled_positions_are_the_documented_stride():
    logits = logits_with_margins((8, 13, 200), seed=2)
    mask = torch.rand(8, 13, generator=torch.Generator().manual_seed(3)) > 0.2
    mon, model, opt = monitor(softmax_max_positions=10)
    mon.observe_logits(logits, mask=mask)
    finish_step(model, opt)
    assert_matches(reported(mon), reference(logits, mask, cap=10))
    mon.close()


def bisected_temperature(z: torch.Tensor, target: float = 0.7) -> float:
    """Exact bisection on the rows of ``z`` (the reference's, as a function)."""

    def mean_top1_at(t: float) -> float:
        return torch.softmax(z.double() / t, -1).amax(-1).mean().item()

    if mean_top1_at(1.0) <= target:
        return 1.0
    lo, hi = 0.0, math.log(sm.TEMPERATURE_MAX)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_top1_at(math.exp(mid)) > target else (lo, mid)
    return math.exp((lo + hi) / 2)


@pytest.mark.parametrize(("temperature", "within"), [(1.0, 0.005), (2.0, 0.005), (0.5, 0.02)])
@pytest.mark.parametrize("seed", [20, 21])
def test_the_knot_sub_sample_counts_every_kept_position(seed, temperature, within):
    """256 positions, cap 128: 86 kept, knots on every third (29). Each kept position's
    tangent at 1/tau carries it (the control variate): the mean top-1 over all 86 at
    the recommended temperature is at the target; bisection on the 29 alone is not.
    The tangent is taken at the observed temperature, so it serves tau = 0.5
    (beta 2, far from the crossing near beta 0.7) less well."""
    logits = logits_with_margins((4, 64, 1000), seed=seed)
    logits.view(-1, 1000)[:, 0] += 3  # crossing at T ~ 1.4
    mon, model, opt = monitor()
    mon.observe_logits(logits, temperature=temperature)
    finish_step(model, opt)
    kept, _ = selected(logits, None, mon.config.softmax_max_positions)
    assert kept.shape[0] == 86
    got = reported(mon)
    ref = reference(logits, temperature=temperature, cap=mon.config.softmax_max_positions)
    ref["softmax_recommended_temperature"] = got["softmax_recommended_temperature"]  # checked below
    assert_matches(got, ref)

    def mean_top1_at(t: float) -> float:
        return torch.softmax(kept.double() / t, -1).amax(-1).mean().item()

    assert mean_top1_at(got["softmax_recommended_temperature"]) == pytest.approx(0.7, abs=within)
    if seed == 20:  # what the knot positions alone would say
        assert abs(mean_top1_at(bisected_temperature(kept[::3])) - 0.7) > 0.04
    mon.close()


def test_a_mask_that_hides_every_knot_position_leaves_the_tangents():
    """With no weight on the knot sub-sample, the recommended temperature comes from
    the tangents alone: still present, and close for logits with one dominant gap."""
    logits = logits_with_margins((4, 64, 1000), seed=20)
    logits.view(-1, 1000)[:, 0] += 3
    stride = sm.subsample_stride(256, 128, 64)
    kept_index = torch.arange(0, 256, stride)
    mask = torch.zeros(256, dtype=torch.bool)
    mask[kept_index] = True
    mask[kept_index[::3]] = False  # the knot positions
    mon, model, opt = monitor()
    mon.observe_logits(logits, mask=mask.view(4, 64))
    finish_step(model, opt)
    t = mon.value("softmax_recommended_temperature", task="all", role="student")
    seen = logits.view(-1, 1000)[mask]
    assert torch.softmax(seen.double() / t, -1).amax(-1).mean().item() == pytest.approx(0.7, abs=0.01)
    mon.close()


def test_many_calls_of_one_step_fold_into_bounded_sums():
    """Calls leave per-position sums for the report; past 64 calls of one (task, role,
    tau) they are folded early, with the same result."""
    calls = [logits_with_margins((2, 5, 50), seed=100 + i) for i in range(70)]
    mon, model, opt = monitor()
    for logits in calls:
        mon.observe_logits(logits)
    pending = mon._softmax_signal()._pending
    assert [len(p.sums) for p in pending.values()] == [70 - 64]
    finish_step(model, opt)
    assert_matches(reported(mon), reference(torch.cat([c.reshape(-1, 50) for c in calls])))
    mon.close()


def test_logits_that_are_not_a_view_and_tiny_chunks_give_the_same_numbers():
    """logits[:, :-1] of a contiguous tensor cannot merge [B, T]: rows are gathered per
    chunk; a 1-byte chunk bound means one row at a time."""
    full = logits_with_margins((4, 11, 400), seed=4)
    shifted = full[:, :-1]
    mon, model, opt = monitor(softmax_chunk_bytes=1, softmax_max_positions=15)
    mon.observe_logits(shifted)
    finish_step(model, opt)
    assert_matches(reported(mon), reference(shifted.contiguous(), cap=15))
    mon.close()


def test_calls_of_one_step_add_up_and_reset_after_the_report():
    a = logits_with_margins((2, 5, 300), seed=6)
    b = logits_with_margins((3, 5, 300), seed=7) * 0.2
    mon, model, opt = monitor()
    mon.observe_logits(a)
    mon.observe_logits(b)
    finish_step(model, opt)
    both = torch.cat([a.reshape(-1, 300), b.reshape(-1, 300)])
    assert_matches(reported(mon), reference(both))
    # next step: only what it observed; a (task, role) not observed is absent
    mon.observe_logits(b, task="chat")
    finish_step(model, opt)
    assert_matches(reported(mon, "chat"), reference(b))
    assert mon.value("softmax_top1_prob_mean", task="all", role="student") is None
    mon.close()


def test_a_fully_masked_call_reports_nothing_rather_than_nan():
    mon, model, opt = monitor()
    mon.observe_logits(torch.randn(4, 10), mask=torch.zeros(4, dtype=torch.bool))
    finish_step(model, opt)
    assert not [s for s in mon.latest() if s["name"] in SATURATION]
    mon.close()


def test_only_reported_steps_do_any_work(monkeypatch):
    calls = []
    real = sm.saturation_chunk
    monkeypatch.setattr(sm, "saturation_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    saturated = torch.zeros(6, 100)
    saturated[:, 0] = 50
    mon, model, opt = monitor(every=3)
    finish_step(model, opt)  # step 1 (reported)
    mon.observe_logits(saturated)  # step 2: not reported -> ignored
    assert calls == []
    finish_step(model, opt)
    soft = torch.zeros(6, 100)
    mon.observe_logits(soft)  # step 3: reported
    assert calls
    finish_step(model, opt)
    assert mon.value("softmax_top1_prob_mean", task="all", role="student") == pytest.approx(0.01)
    mon.close()


def test_a_failure_past_the_checks_turns_the_signal_off_instead_of_raising(monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(sm, "saturation_chunk", broken)
    mon, model, opt = monitor()
    with caplog.at_level("WARNING", logger="trainvitals"):
        mon.observe_logits(torch.randn(4, 10))
        mon.observe_logits(torch.randn(4, 10))
    assert [r.getMessage() for r in caplog.records if "Softmax" in r.getMessage()] == [
        "trainvitals: signal Softmax failed in observe_logits and is turned off: RuntimeError: boom"
    ]
    finish_step(model, opt)
    assert not [s for s in mon.latest() if s["name"] in SATURATION]
    with pytest.raises(ValueError, match="short identifier"):  # argument checks still apply
        mon.observe_logits(torch.randn(4, 10), task="a b")
    mon.close()


@pytest.mark.parametrize("name", ["ie\n", "a b", "", "x" * 65])
def test_task_and_role_names_are_checked_whole(name):
    """A trailing newline is no name either (a ``$``-anchored match would let it through)."""
    mon, _, _ = monitor()
    with pytest.raises(ValueError, match="short identifier"):
        mon.observe_logits(torch.randn(4, 10), task=name)
    with pytest.raises(ValueError, match="short identifier"):
        mon.observe_logits(torch.randn(4, 10), role=name)
    mon.close()


def test_observing_makes_no_host_sync(monkeypatch):
    """No .item()/.tolist()/float()/bool() on the training thread, in the observe
    calls or in the step that reports them."""
    from tests.support import HostSyncSpy

    mon, model, opt = monitor()
    student = logits_with_margins((2, 6, 500), seed=8).requires_grad_()
    teacher = logits_with_margins((2, 6, 500), seed=9)
    mask = torch.ones(2, 6, dtype=torch.bool)
    loss = model(torch.ones(1, 2)).sum()
    spy = HostSyncSpy(monkeypatch)
    mon.observe_logits(student, mask=mask, task="ie")
    mon.observe_distillation(student, teacher, temperature=2.0, mask=mask, task="ie")
    loss.backward()
    opt.step()
    assert spy.stop() == []
    assert mon.value("distill_dark_knowledge_mass", task="ie") is not None
    mon.close()


def test_observing_detaches_and_works_under_inference_mode():
    mon, model, opt = monitor()
    student = logits_with_margins((3, 200), seed=10).requires_grad_()
    with torch.inference_mode():
        teacher = logits_with_margins((3, 200), seed=11)
        mon.observe_logits(teacher, role="teacher")
    mon.observe_distillation(student, teacher, temperature=1.0)
    assert student.grad is None and not student.grad_fn
    finish_step(model, opt)
    assert mon.value("softmax_top1_prob_mean", task="all", role="teacher") is not None
    mon.close()


# -- distillation statistics ---------------------------------------------------------
def distill_reference(
    student: torch.Tensor, teacher: torch.Tensor, tau: float, mask: torch.Tensor | None = None
) -> tuple[float, float]:
    v = student.shape[-1]
    s, t = student.reshape(-1, v).double(), teacher.reshape(-1, v).double()
    if mask is not None:
        s, t = s[mask.reshape(-1)], t[mask.reshape(-1)]
    # the KL gradient on the student's logits, by autograd (Hinton's tau^2 scaling)
    s = s.clone().requires_grad_()
    p_t = torch.softmax(t / tau, -1)
    kl = F.kl_div(torch.log_softmax(s / tau, -1), p_t, reduction="sum") * tau**2
    (g,) = torch.autograd.grad(kl, s)
    top = p_t.argmax(-1, keepdim=True)
    raise_top = (-g.gather(1, top)).clamp(min=0).sum()  # the descent step raises it by this
    raise_all = (-g).clamp(min=0).sum()  # everything the step raises
    dark = (1 - p_t.max(-1).values).mean()
    return (raise_top / raise_all).item(), dark.item()


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("tau", [1.0, 4.0])
@pytest.mark.parametrize("shape", [(3, 6, 80), (20, 1000)], ids=["BTV", "NV"])
def test_distillation_statistics_match_plain_torch(shape, tau, masked):
    student = torch.randn(shape, generator=torch.Generator().manual_seed(12))
    teacher = logits_with_margins(shape, seed=13)
    mask = (torch.rand(shape[:-1], generator=torch.Generator().manual_seed(14)) > 0.3) if masked else None
    mon, model, opt = monitor()
    mon.observe_distillation(student, teacher.bfloat16(), temperature=tau, mask=mask, task="ie")
    finish_step(model, opt)
    share, dark = distill_reference(student, teacher.bfloat16().float(), tau, mask)
    assert mon.value("distill_top1_grad_share_ratio", task="ie") == pytest.approx(share, rel=1e-4)
    assert mon.value("distill_dark_knowledge_mass", task="ie") == pytest.approx(dark, rel=1e-4, abs=1e-7)
    for role, logits in (("student", student), ("teacher", teacher.bfloat16().float())):
        assert_matches(
            reported(mon, "ie", role),
            reference(logits, mask, temperature=tau)
            | {"softmax_recommended_temperature": reference(logits, mask)["softmax_recommended_temperature"]},
        )
    mon.close()


def test_grad_share_is_low_when_the_student_is_more_confident_than_a_soft_teacher():
    teacher = torch.randn(30, 500, generator=torch.Generator().manual_seed(15))
    student = teacher * 10  # same top-1, far sharper
    mon, model, opt = monitor()
    mon.observe_distillation(student, teacher, temperature=1.0)
    finish_step(model, opt)
    assert mon.value("distill_top1_grad_share_ratio", task="all") == pytest.approx(0.0, abs=1e-6)
    mon.close()


# -- argument checks -------------------------------------------------------------------
GOOD = torch.randn(2, 3, 10)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logits": [[1.0, 2.0]]}, TypeError, "torch.Tensor"),
        ({"logits": torch.ones(2, 3, 10, dtype=torch.long)}, TypeError, "not token ids"),
        ({"logits": torch.randn(10)}, ValueError, r"\[B, T, V\] or \[N, V\]"),
        ({"logits": torch.randn(2, 3, 4, 10)}, ValueError, r"\[B, T, V\] or \[N, V\]"),
        ({"logits": torch.randn(5, 1)}, ValueError, "at least 2 classes"),
        ({"mask": torch.ones(2, 3)}, TypeError, "bool tensor"),
        ({"mask": [True]}, TypeError, "bool torch.Tensor"),
        ({"mask": torch.ones(3, 2, dtype=torch.bool)}, ValueError, r"logits.shape\[:-1\]"),
        ({"mask": torch.ones(6, dtype=torch.bool)}, ValueError, r"must equal the logits' positions \(2, 3\)"),
        ({"temperature": 0.0}, ValueError, "positive finite"),
        ({"temperature": -1}, ValueError, "positive finite"),
        ({"temperature": float("inf")}, ValueError, "positive finite"),
        ({"temperature": torch.tensor(2.0)}, TypeError, "Python number"),
        ({"temperature": True}, TypeError, "Python number"),
        ({"task": "in form"}, ValueError, "short identifier"),
        ({"task": ""}, ValueError, "short identifier"),
        ({"role": 3}, ValueError, "short identifier"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_observe_logits_rejects_wrong_arguments_at_once(kwargs, error, match):
    mon, _, _ = monitor(every=5)  # even on a step that would not be reported
    args = {"logits": GOOD} | kwargs
    with pytest.raises(error, match=match):
        mon.observe_logits(args.pop("logits"), **args)
    mon.close()


@pytest.mark.parametrize(
    ("student", "teacher", "kwargs", "error", "match"),
    [
        (GOOD, torch.randn(2, 3, 11), {}, ValueError, "must equal student_logits shape"),
        (GOOD, GOOD.long(), {}, TypeError, "teacher_logits must be floating point"),
        (GOOD, GOOD, {"temperature": 0}, ValueError, "positive finite"),
        (GOOD, GOOD, {"task": "a b"}, ValueError, "short identifier"),
        (GOOD, GOOD, {"mask": torch.ones(2, dtype=torch.bool)}, ValueError, "mask shape"),
    ],
    ids=["shape", "dtype", "temperature", "task", "mask"],
)
def test_observe_distillation_rejects_wrong_arguments_at_once(student, teacher, kwargs, error, match):
    mon, _, _ = monitor()
    with pytest.raises(error, match=match):
        mon.observe_distillation(student, teacher, **({"temperature": 2.0} | kwargs))
    mon.close()


# -- I5 reproduction: a tiny student distilled on two tasks ---------------------------
VOCAB, TOKENS = 400, 32


class Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(TOKENS, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids))


def teacher_logits(task: str, ids: torch.Tensor) -> torch.Tensor:
    """ "ie": an extraction teacher, near one-hot (margin 40 over its noise);
    "chat": a soft teacher (top-1 ~ 0.3)."""
    g = torch.Generator().manual_seed(100)
    table = torch.randn(TOKENS, VOCAB, generator=g)
    z = table[ids]
    if task == "ie":
        z = z.scatter_add(-1, (ids % VOCAB).unsqueeze(-1), torch.full((*ids.shape, 1), 40.0))
    else:
        z = z * 1.2
        z = z.scatter_add(-1, (ids % VOCAB).unsqueeze(-1), torch.full((*ids.shape, 1), 4.0))
    return z


def test_i5_a_near_one_hot_teacher_saturates_and_its_healthy_twin_does_not():
    torch.manual_seed(0)
    student = Student()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    mon = attach(student, opt, run="i5", sink="null", every=1)
    tau = 1.0
    g = torch.Generator().manual_seed(1)
    last: dict[str, torch.Tensor] = {}
    for _ in range(4):
        for task in ("ie", "chat"):
            ids = torch.randint(0, TOKENS, (4, 16), generator=g)
            mask = torch.ones(4, 16, dtype=torch.bool)
            mask[:, -3:] = False  # padding
            with torch.no_grad():
                t = teacher_logits(task, ids)
            s = student(ids)
            mon.observe_distillation(s, t, temperature=tau, mask=mask, task=task)
            kd = (
                F.kl_div(torch.log_softmax(s[mask] / tau, -1), torch.softmax(t[mask] / tau, -1), reduction="batchmean")
                * tau**2
            )
            kd.backward()
            last[task] = t[mask]
        opt.step()
        opt.zero_grad()

    def v(name: str, task: str, **labels: str) -> float:
        got = mon.value(name, task=task, **labels)
        assert got is not None, (name, task, labels)
        return got

    # the saturated task
    assert v("softmax_saturated_ratio", "ie", role="teacher", threshold="0.99") > 0.99
    assert v("softmax_jacobian_mean", "ie", role="teacher") < 1e-3
    t_ie = v("softmax_recommended_temperature", "ie", role="teacher")
    assert t_ie > 3
    assert v("distill_top1_grad_share_ratio", "ie") > 0.95
    assert v("distill_dark_knowledge_mass", "ie") < 1e-3
    # at the recommended temperature the teacher's mean top-1 is at the target
    at_t = torch.softmax(last["ie"].double() / t_ie, -1).max(-1).values.mean().item()
    assert at_t == pytest.approx(mon.config.softmax_target, abs=0.01)
    # the healthy twin
    assert v("softmax_saturated_ratio", "chat", role="teacher", threshold="0.99") < 0.1
    assert v("softmax_jacobian_mean", "chat", role="teacher") > 0.05
    assert v("softmax_recommended_temperature", "chat", role="teacher") == 1.0
    assert v("distill_top1_grad_share_ratio", "chat") < 0.6
    assert v("distill_dark_knowledge_mass", "chat") > 0.3
    mon.close()
