"""softmax_math: the I5 table, the logit gaps, subsampling, and the recommended
temperature against exact bisection on full logits."""

from __future__ import annotations

import math

import pytest
import torch

from trainvitals.hooks.signals.softmax import maths as sm


# -- the write-up's table (docs/incidents.md, I5) -------------------------------------
@pytest.mark.parametrize(
    ("q", "expected", "shrink"),
    [(0.5, 0.25, 1), (0.9, 0.09, 3), (0.99, 0.0099, 25), (0.999, 0.000999, 250)],
    ids=["q=0.5", "q=0.9", "q=0.99", "q=0.999"],
)
def test_jacobian_of_the_top_class_matches_the_table(q, expected, shrink):
    assert sm.jacobian(q) == pytest.approx(expected, rel=1e-9)
    assert sm.jacobian(0.5) / sm.jacobian(q) == pytest.approx(shrink, rel=0.12)
    # and it is the diagonal of the softmax Jacobian, by autograd, for 2 classes
    z = torch.tensor([sm.logit_gap_for_prob(q), 0.0], dtype=torch.float64, requires_grad=True)
    torch.softmax(z, 0)[0].backward()
    assert z.grad[0].item() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("q_from", "q_to", "change"), [(0.95, 0.99, 1.65), (0.99, 0.999, 2.31)], ids=["0.95->0.99", "0.99->0.999"]
)
def test_logit_change_matches_the_table(q_from, q_to, change):
    assert sm.logit_change(q_from, q_to) == pytest.approx(change, abs=0.005)
    assert sm.logit_change(q_from, q_to) == pytest.approx(
        math.log((q_to / (1 - q_to)) / (q_from / (1 - q_from))), rel=1e-12
    )


@pytest.mark.parametrize("classes", [2, 10, 150_000])
def test_logit_gap_gives_the_probability(classes):
    gap = sm.logit_gap_for_prob(0.9, classes)
    z = torch.zeros(classes, dtype=torch.float64)
    z[0] = gap
    assert torch.softmax(z, 0)[0].item() == pytest.approx(0.9, rel=1e-9)


@pytest.mark.parametrize(("q", "classes"), [(1.0, 2), (0.0, 2), (0.5, 1)])
def test_logit_gap_rejects_impossible_inputs(q, classes):
    with pytest.raises(ValueError):
        sm.logit_gap_for_prob(q, classes)


# -- subsampling and chunk sizes ---------------------------------------------------
@pytest.mark.parametrize(
    ("positions", "cap", "period", "stride"),
    [
        (100, 4096, 1, 1),  # under the cap: every position
        (100, 10, 1, 10),
        (101, 10, 1, 11),  # ceil
        (32 * 4, 2, 4, 65),  # 64 shares a factor with T = 4 -> next coprime
        (4096 * 8, 4096, 4096, 9),  # 8 would pick the same 512 phases in every sequence
    ],
    ids=["under-cap", "exact", "ceil", "coprime-with-T", "coprime-long-T"],
)
def test_subsample_stride(positions, cap, period, stride):
    got = sm.subsample_stride(positions, cap, period)
    assert got == stride
    assert -(-positions // got) <= cap
    assert got == 1 or math.gcd(got, period) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rows_per_chunk_respects_the_byte_bound(device):
    for vocab in (2, 64, 1000, 131072, 10_000_000):
        for chunk in (1, 1 << 20, 64 << 20):
            for copies, itemsize in ((0, 4), (1, 2), (2, 4)):
                rows = sm.rows_per_chunk(vocab, chunk, copies=copies, itemsize=itemsize, device=device)
                bound = min(chunk, sm.CPU_CHUNK_BYTES) if device == "cpu" else chunk
                assert rows >= 1
                assert rows == 1 or rows * (sm.BYTES_PER_LOGIT + copies * itemsize) * vocab <= bound
    assert sm.rows_per_chunk(131072, 64 << 20, device="cuda") > sm.rows_per_chunk(131072, 64 << 20)


@pytest.mark.parametrize(("cap", "positions"), [(1, 32), (128, 32), (256, 32), (512, 64), (4096, 512)])
def test_knots_take_at_least_32_positions_and_one_in_8_beyond(cap, positions):
    assert sm.temperature_positions(cap) == positions


# -- recommended temperature vs exact bisection -----------------------------------
def exact_mean_top1(z: torch.Tensor, t: float) -> float:
    return torch.softmax(z.double() / t, -1).amax(-1).mean().item()


def exact_temperature(z: torch.Tensor, target: float) -> float:
    if exact_mean_top1(z, 1.0) <= target:
        return 1.0
    lo, hi = 0.0, math.log(sm.TEMPERATURE_MAX)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exact_mean_top1(z, math.exp(mid)) > target else (lo, mid)
    return math.exp((lo + hi) / 2)


def knots(z: torch.Tensor) -> torch.Tensor:
    """``h`` at the knots for every row of ``z`` (ties counted by the statistics' sums)."""
    workspace = sm.Workspace(2 * z.shape[0], z.shape[1], "cpu")  # the knots take half the rows
    sums = torch.empty(3, z.shape[0])
    sm.saturation_chunk(z, 1.0, workspace, sums)
    out = torch.empty(len(sm.CHAIN_POWERS), z.shape[0])
    sm.temperature_chunk(z, workspace, out)
    return sm.knot_logs(out, sm.saturation_stats(sums, 1.0)[:, -1])


def estimated_temperature(z: torch.Tensor, target: float) -> float:
    """The recommended temperature from the knots of every row (no sub-sample)."""
    grid = sm.TemperatureGrid("cpu")
    top1 = sm.top1_on_grid(knots(z), grid)
    return sm.temperature_for_target(grid.temperatures, top1.mean(0, keepdim=True), target).item()


def _cases(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    n = 24
    base = torch.randn(n, vocab, generator=g)
    out = {"gaussian": base.clone(), "gaussian-x3": base * 3}
    for margin in (12.0, 25.0, 60.0):
        z = base.clone()
        z[:, 0] += margin
        out[f"one-hot-margin-{margin:g}"] = z
    z = base.clone()
    z[:, 0] += torch.linspace(4, 80, n)
    out["mixed-margins"] = z
    z = base.clone()
    z[: n // 2, 0] += 80
    z[n // 2 :, 0] += 14
    out["half-saturated"] = z
    z = base.clone()
    z[:, 0] += 30
    z[:, 1 : vocab // 10] = float("-inf")
    out["masked-minus-inf"] = z
    out["gumbel"] = -torch.log(-torch.log(torch.rand(n, vocab, generator=g))) * 2
    # the whole bulk on two gap values: h(beta) bends where one takes over from the other
    z = torch.zeros(n, vocab)
    z[:, 1 : vocab // 2] = -24.0001
    z[:, vocab // 2 :] = -24.9999
    out["two-point"] = z
    # Zipf-like power laws (logit = -a log rank, shuffled): the mass outside the top-1
    # moves from the head to the tail over a narrow range of T, so h bends sharply
    # there; with only octave knots (T = 64, 32, ..., 1) these were off by up to 0.1
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    for a in (1.0, 1.5, 2.5):
        z = -a * torch.log(ranks).expand(n, vocab) + 0.5 * torch.randn(n, vocab, generator=g)
        z = z[:, torch.randperm(vocab, generator=g)]
        out[f"zipf-{a:g}-x2"] = z * 2
        out[f"zipf-{a:g}-x4"] = z * 4
    a = torch.linspace(0.5, 4, n).unsqueeze(1)
    out["zipf-mixed-exponents"] = (-a * torch.log(ranks) + 0.3 * torch.randn(n, vocab, generator=g)) * 2
    # a runner-up close to the top over a bulk far below: two scales
    z = base.clone()
    z[:, 0] += 10
    z[:, 1] += 9
    z[:, 2] += 3
    out["top2-plus-bulk"] = z * 3
    z = base.clone()
    z[:, 0] += torch.linspace(2, 60, n)
    z[:, 1] += torch.linspace(1, 30, n)
    out["two-scale"] = z
    return out


@pytest.mark.parametrize("vocab", [50, 1000, 8192], ids=lambda v: f"V={v}")
def test_recommended_temperature_puts_the_mean_top1_at_the_target(vocab):
    for name, z in _cases(vocab).items():
        t = estimated_temperature(z, 0.7)
        t_exact = exact_temperature(z, 0.7)
        if t_exact == 1.0:
            assert t == 1.0, name
        else:
            assert exact_mean_top1(z, t) == pytest.approx(0.7, abs=0.005), name
            assert t == pytest.approx(t_exact, rel=0.01), name


@pytest.mark.parametrize("target", [0.3, 0.5, 0.9])
def test_recommended_temperature_follows_the_target(target):
    z = torch.randn(16, 2000, generator=torch.Generator().manual_seed(2))
    z[:, 0] += 30
    assert exact_mean_top1(z, estimated_temperature(z, target)) == pytest.approx(target, abs=0.005)


def test_temperature_for_target_edges():
    temps = sm.temperature_grid()
    k = temps.numel()
    below = torch.full((1, k), 0.5)
    above = torch.full((1, k), 0.99)
    nan = torch.full((1, k), float("nan"))
    got = sm.temperature_for_target(temps, torch.cat([below, above, nan]), 0.7)
    assert got[0].item() == 1.0
    assert got[1].item() == pytest.approx(sm.TEMPERATURE_MAX)
    assert math.isnan(got[2].item())


# -- the knots and the per-position sums against float64 ------------------------------
def test_knots_are_the_partition_function_at_t_64_over_k():
    """The chain of squarings gives Z(1/T) at T = 64/k: each level doubles the relative
    rounding of r, so the top (T = 1) is ~64 ulp off at most."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 3000, generator=g) * 3
    z[0, 0] += 40  # saturated at T = 1, not at T = 64
    z[1, :2000] = float("-inf")  # masked classes
    z[2] += 1000  # a large offset
    z[3, 5:9] = z[3].max()  # ties at the top
    z[4] *= 30  # gaps of hundreds of nats: underflow at T = 1
    z = torch.cat([z, z[:1].bfloat16().float()])
    u = z.double().amax(-1, keepdim=True) - z.double()
    ties = (u == 0).sum(-1, keepdim=True) - 1
    u = torch.where(u == 0, math.inf, u)  # the mass outside the top-1 apart: 1 + 1e-20 is 1 in float64
    want = torch.stack([torch.exp(-u * (k / 64)).sum(-1) for k in sm.CHAIN_POWERS], 1) + ties
    # float32 keeps full precision down to 1.2e-38 (smallest normal); below, h is clamped
    want_h = want.clamp(min=torch.finfo(torch.float32).tiny).log()
    got = knots(z.clone()).double()
    assert got.shape == (z.shape[0], len(sm.CHAIN_POWERS))
    assert ties[3].item() == 4  # four set to the maximum, plus the maximum itself
    assert torch.allclose(got, want_h, rtol=0, atol=2e-5), (got - want_h).abs().max()
    assert sm.knot_betas() == tuple(k / 64 for k in sm.CHAIN_POWERS)


def test_one_logit_gap_is_interpolated_exactly():
    """Two classes with a gap M: h(beta) = -beta M is linear, so the monotone cubic
    reproduces it between knots and the top-1 on the grid is exactly sigmoid(M / T);
    the tangent gives the same curve from any observed temperature."""
    gaps = torch.tensor([0.5, 3.0, 9.0, 40.0, 200.0])
    z = torch.stack([gaps, torch.zeros_like(gaps)], 1)
    grid = sm.TemperatureGrid("cpu")
    want = torch.sigmoid(gaps.double().unsqueeze(1) / grid.temperatures.double())
    got = sm.top1_on_grid(knots(z), grid).double()
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    for tau in (0.5, 1.0, 4.0):
        sums = torch.empty(3, z.shape[0])
        sm.saturation_chunk(z, 1 / tau, sm.Workspace(z.shape[0], 2, "cpu"), sums)
        tangent = sm.saturation_stats(sums, 1 / tau)[:, len(sm.STATS) : len(sm.STATS) + 2]
        # unless the runner-up underflows float32 at tau (gap / tau > 87): then 1 at every T
        resolved = gaps / tau < 87
        got = sm.covariate_on_grid(tangent, grid, 1 / tau).double()
        assert torch.allclose(got[resolved], want[resolved], atol=1e-5), tau
        assert (got[~resolved] > 1 - 1e-6).all()


def test_top1_on_the_grid_falls_as_the_temperature_rises():
    grid = sm.TemperatureGrid("cpu")
    for name, z in _cases(1000).items():
        top1 = sm.top1_on_grid(knots(z), grid)
        assert (top1.diff(dim=1) <= 1e-6).all(), name
        assert ((top1 > 0) & (top1 <= 1)).all(), name


def test_the_mass_outside_the_top1_is_exact_when_tiny():
    """Z - 1 from a float32 sum that holds the top-1's 1.0 is good to ~5e-7 only; the
    sums keep tails of 1e-20 and count ties."""
    z = torch.zeros(4, 1000)
    z[0, 0] = 50.0  # 999 e^-50: 1.9e-19 outside
    z[1, 0] = 20.0  # 2.1e-6 outside
    z[2, :3] = 7.0  # three tied at the top
    z[3] = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    sums = torch.empty(3, 4)
    sm.saturation_chunk(z, 1.0, sm.Workspace(4, 1000, "cpu"), sums)
    stats = sm.saturation_stats(sums, 1.0).double()
    p = torch.softmax(z.double(), -1)
    q = p.amax(-1)
    outside = (1 - q) / q
    outside[0] = 999 * math.exp(-50)  # 1 - q below float64's resolution too
    top1, _, _, jac, entropy, h, slope, ties = stats.unbind(1)
    assert ties.tolist() == [0, 0, 2, 0]
    assert torch.allclose(top1, q, rtol=1e-6)
    assert torch.allclose(h, outside.log(), atol=1e-5)
    assert jac[0].item() == pytest.approx(999 * math.exp(-50), rel=1e-5)
    assert jac[1].item() == pytest.approx((q * (1 - q))[1].item(), rel=1e-5)
    assert torch.allclose(entropy, torch.special.entr(p).sum(-1), rtol=1e-5, atol=1e-12)
    # dh/dbeta = -E[gap] over the classes outside the top-1
    assert slope[0].item() == pytest.approx(-50.0, rel=1e-5)
    u = z[3].double().max() - z[3].double()
    rest = (torch.exp(-u) * (u > 0)).sum()
    assert slope[3].item() == pytest.approx(-((u * torch.exp(-u)).sum() / rest).item(), rel=1e-5)
