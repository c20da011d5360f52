"""The sender thread's finishing arithmetic gives what the tensor ops it replaces give,
non-finite values included; a finished emit lands in the report in its place; parts
packed per dtype come back in the order they were emitted."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainvitals.hooks.host_finish import (
    AdamFinish,
    GradRmsFinish,
    LogRatioFinish,
    RatioRootFinish,
    div,
    log,
    log2,
    lower_median,
    round_even,
    sqrt,
)
from trainvitals.hooks.pack import pack
from trainvitals.hooks.step import StepContext

SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 3.5, 1e-300, 1e300, math.inf, -math.inf, math.nan]
floats = st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True, width=64))


def same(a: float, b: float) -> bool:
    """Equal to the last few bits (a vectorized tensor root or log may be an ulp off the
    correctly rounded one), or both NaN; the sign of a zero is not a figure's concern."""
    return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-14)


def t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


@given(floats, floats)
def test_div_is_the_tensor_division(a, b):
    assert same(div(a, b), (t(a) / t(b)).item())


@given(floats)
def test_sqrt_log2_and_round_are_the_tensor_ops(x):
    assert same(sqrt(x), t(x).sqrt().item())
    assert same(log2(x), t(x).log2().item())
    assert same(log(x), t(x).log().item())
    assert same(round_even(x), t(x).round().item())


@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32)), min_size=1, max_size=9))
def test_lower_median_is_torch_median(values):
    assert same(lower_median(values), torch.tensor(values, dtype=torch.float64).median().item())


def test_adam_finish_matches_the_device_formula():
    sampled = [4.0, 0.0, 10.0]  # a bin without sampled elements divides by 1
    n = len(sampled)
    raw = torch.tensor([2.0000001, 0.0, 7.4999999, 8.0, 1.0, 50.0, 9.0, 16.0, math.inf, 1.0, 2.0, math.nan])
    den = torch.tensor(sampled).clamp_min(1)
    den = torch.cat([den, den, torch.ones(2 * n)]).double()
    powers = torch.tensor([1.0] * n + [0.5] * 3 * n, dtype=torch.float64)
    ratio = torch.arange(4 * n) < n
    x = raw.double()
    expected = (torch.where(ratio, x.round(), x) / den) ** powers
    got = AdamFinish(sampled)(x.tolist())
    assert all(same(a, b) for a, b in zip(got, expected.tolist(), strict=True))
    with pytest.raises(ValueError):
        AdamFinish(sampled)(x.tolist()[:-1])


def test_ratio_root_finish_matches_the_tensor_ops():
    num = torch.tensor([4.0, 0.0, 3.0, math.inf, math.nan])
    den = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0])
    expected = torch.div(num.double(), den.double()).sqrt()
    got = RatioRootFinish()(torch.cat([num, den]).double().tolist())
    assert all(same(a, b) for a, b in zip(got, expected.tolist(), strict=True))


def test_log_ratio_finish_matches_the_tensor_ops():
    mass = torch.tensor([4.0, 1.0, 0.25, 0.0, -1.0, math.nan], dtype=torch.float64)
    bases = torch.tensor([math.log(4), math.log(2), math.log(2), math.log(3), math.log(2), math.log(2)])
    expected = torch.log(mass) / bases.double()
    got = LogRatioFinish(bases.double().tolist())(mass.tolist())
    assert all(same(a, b) for a, b in zip(got, expected.tolist(), strict=True))


@pytest.mark.parametrize("squared", [False, True])
@pytest.mark.parametrize("norms", [[3.0, 1.0, 4.0, 1.5], [3.0, math.nan, 4.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
def test_grad_rms_finish_matches_the_tensor_ops(norms, squared):
    numel = [9, 1, 16, 4]
    positions = [2, 0, 3]
    tiny = torch.finfo(torch.float32).tiny
    n = torch.tensor(norms, dtype=torch.float64)
    given_values = n.square() if squared else n
    rms = n / torch.tensor(numel, dtype=torch.float64).sqrt()
    expected = rms[positions] / torch.median(rms).clamp_min(tiny)
    got = GradRmsFinish([math.sqrt(k) for k in numel], positions, squared=squared, floor=tiny)(given_values.tolist())
    assert all(same(a, b) for a, b in zip(got, expected.tolist(), strict=True))


def test_a_finished_emit_lands_in_its_place_and_a_wrong_count_is_refused():
    ctx = StepContext(step=3, device=torch.device("cpu"))
    ctx.emit("before", torch.tensor([1.0, 2.0]), [{"i": "0"}, {"i": "1"}])
    ctx.emit_block([("root", [{"i": "0"}, {"i": "1"}])], torch.tensor([9.0, 16.0, 1.0, 4.0]), host=RatioRootFinish())
    ctx.emit("after", torch.tensor(5.0), {}, present=torch.tensor(1.0))
    ctx.event("flagged", "d", {}, when=torch.tensor(1.0))
    report = pack(ctx, run="r", rank=0).materialize()
    got = [(s["name"], s["value"]) for s in report["samples"]]
    assert got == [("before", 1.0), ("before", 2.0), ("root", 3.0), ("root", 2.0), ("after", 5.0)]
    assert [e["kind"] for e in report["events"]] == ["flagged"]

    bad = StepContext(step=4, device=torch.device("cpu"))
    bad.emit_block([("root", [{}])], torch.tensor([1.0, 2.0, 3.0]), host=lambda raw: raw)
    with pytest.raises(ValueError, match="finished values"):
        pack(bad, run="r", rank=0).materialize()


def test_parts_of_several_dtypes_come_back_in_order_as_floats():
    """On a CPU the report is concatenated per dtype; the sender thread puts the values
    back in the order they were emitted, every one a float (the wire takes no bool)."""
    ctx = StepContext(step=1, device=torch.device("cpu"))
    ctx.emit("a", torch.tensor([1.5, 2.5], dtype=torch.float64), [{"i": "0"}, {"i": "1"}])
    ctx.emit("b", torch.tensor(3.25), {}, present=torch.tensor(True))
    ctx.emit("c", torch.tensor([4], dtype=torch.int64), [{}])
    ctx.emit_block([("d", [{}]), ("e", [{}])], torch.tensor([5.0, 6.0], dtype=torch.float64))
    ctx.emit("f", torch.tensor(7.0), {}, present=torch.tensor(False))  # absent
    ctx.event("flagged", "d", {}, when=torch.tensor(True))
    ctx.event("quiet", "d", {}, when=torch.tensor(0.0))
    pending = pack(ctx, run="r", rank=0)
    assert len(pending.hosts) == 4  # float64, float32, bool, int64: one cat each
    report = pending.materialize()
    got = [(s["name"], s["value"]) for s in report["samples"]]
    assert got == [("a", 1.5), ("a", 2.5), ("b", 3.25), ("c", 4.0), ("d", 5.0), ("e", 6.0)]
    assert all(type(s["value"]) is float for s in report["samples"])
    assert [e["kind"] for e in report["events"]] == ["flagged"]


def test_one_dtype_is_one_concatenation():
    ctx = StepContext(step=1, device=torch.device("cpu"))
    ctx.emit("a", torch.tensor([1.0, 2.0]), [{}, {}])
    ctx.emit("b", torch.tensor(3.0), {})
    pending = pack(ctx, run="r", rank=0)
    assert pending.hosts == [] and pending.host.dtype == torch.float64
    assert [s["value"] for s in pending.materialize()["samples"]] == [1.0, 2.0, 3.0]


def test_warnings_are_said_from_the_reports_values_on_materialize():
    said: list[tuple[str, str, int]] = []

    def warn(key: str, message: str, count: int) -> None:
        said.append((key, message % count, count))

    ctx = StepContext(step=1, device=torch.device("cpu"))
    ctx.emit("a", torch.tensor(1.0), {}, present=torch.tensor(1.0))
    ctx.warn_when([("mixed", "%d mixed"), ("unknown", "%d unknown")], torch.tensor([2.0, 0.0]), warn)
    ctx.warn_when([("flags", "%d flagged")], torch.tensor([True, True, False, True]), warn, positive_from=1)
    pending = pack(ctx, run="r", rank=0)
    assert said == []  # nothing on the training thread
    report = pending.materialize()
    assert [s["value"] for s in report["samples"]] == [1.0]
    assert said == [("mixed", "2 mixed", 2), ("flags", "2 flagged", 2)]
    pending.materialize()
    assert len(said) == 2  # once per report
    with pytest.raises(ValueError, match="counts for"):
        ctx.warn_when([("x", "%d")], torch.tensor([1.0, 2.0]), warn)
