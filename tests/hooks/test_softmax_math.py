"""softmax_math: the I5 table, the logit gaps, subsampling, and the recommended
temperature against exact bisection on full logits."""

from __future__ import annotations

import math

import pytest
import torch

from trainvitals.hooks.signals import softmax_math as sm


# -- the write-up's table (INCIDENTS.md, I5) -------------------------------------
@pytest.mark.parametrize(("q", "expected", "shrink"),
                         [(0.5, 0.25, 1), (0.9, 0.09, 3), (0.99, 0.0099, 25), (0.999, 0.000999, 250)],
                         ids=["q=0.5", "q=0.9", "q=0.99", "q=0.999"])
def test_jacobian_of_the_top_class_matches_the_table(q, expected, shrink):
    assert sm.jacobian(q) == pytest.approx(expected, rel=1e-9)
    assert sm.jacobian(0.5) / sm.jacobian(q) == pytest.approx(shrink, rel=0.12)
    # and it is the diagonal of the softmax Jacobian, by autograd, for 2 classes
    z = torch.tensor([sm.logit_gap_for_prob(q), 0.0], dtype=torch.float64, requires_grad=True)
    torch.softmax(z, 0)[0].backward()
    assert z.grad[0].item() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("q_from", "q_to", "change"), [(0.95, 0.99, 1.65), (0.99, 0.999, 2.31)],
                         ids=["0.95->0.99", "0.99->0.999"])
def test_logit_change_matches_the_table(q_from, q_to, change):
    assert sm.logit_change(q_from, q_to) == pytest.approx(change, abs=0.005)
    assert sm.logit_change(q_from, q_to) == pytest.approx(
        math.log((q_to / (1 - q_to)) / (q_from / (1 - q_from))), rel=1e-12)


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
@pytest.mark.parametrize(("positions", "cap", "period", "stride"), [
    (100, 4096, 1, 1),          # under the cap: every position
    (100, 10, 1, 10),
    (101, 10, 1, 11),           # ceil
    (32 * 4, 2, 4, 65),         # 64 shares a factor with T = 4 -> next coprime
    (4096 * 8, 4096, 4096, 9),  # 8 would pick the same 512 phases in every sequence
], ids=["under-cap", "exact", "ceil", "coprime-with-T", "coprime-long-T"])
def test_subsample_stride(positions, cap, period, stride):
    got = sm.subsample_stride(positions, cap, period)
    assert got == stride
    assert -(-positions // got) <= cap
    assert got == 1 or math.gcd(got, period) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rows_per_chunk_respects_the_byte_bound(device):
    for vocab in (2, 64, 1000, 131072, 10_000_000):
        for chunk in (1, 1 << 20, 64 << 20):
            rows = sm.rows_per_chunk(vocab, chunk, device=device)
            bound = min(chunk, sm.CPU_CHUNK_BYTES) if device == "cpu" else chunk
            assert rows >= 1
            assert rows == 1 or rows * (sm.BYTES_PER_LOGIT * vocab + sm.GRID_BYTES_PER_ROW) <= bound
    assert sm.rows_per_chunk(131072, 64 << 20, device="cuda") > sm.rows_per_chunk(131072, 64 << 20)


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


def estimated_temperature(z: torch.Tensor, target: float, tau: float = 1.0) -> float:
    temps = sm.temperature_grid()
    ws = sm.saturation_workspace(z.shape[0], z.shape[1], tau / temps)
    _, grid = sm.saturation_chunk(z, 1.0 / tau, ws)
    return sm.temperature_for_target(temps, grid.mean(0, keepdim=True), target).item()


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
    z[n // 2:, 0] += 14
    out["half-saturated"] = z
    z = base.clone()
    z[:, 0] += 30
    z[:, 1: vocab // 10] = float("-inf")
    out["masked-minus-inf"] = z
    out["gumbel"] = -torch.log(-torch.log(torch.rand(n, vocab, generator=g))) * 2
    # adversarial for the histogram: the whole bulk on two gap values at the two
    # ends of one geometric bin (the worst within-bin spread)
    lo, hi = 24.0, 25.0  # 16 bins per octave: [24, 25) is one bin
    z = torch.zeros(n, vocab)
    z[:, 1: vocab // 2] = -(lo + 1e-4)
    z[:, vocab // 2:] = -(hi - 1e-4)
    out["two-point-bin"] = z
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


@pytest.mark.parametrize("tau", [0.5, 2.0, 8.0])
def test_recommended_temperature_is_absolute_whatever_the_observed_temperature(tau):
    z = torch.randn(16, 4096, generator=torch.Generator().manual_seed(1))
    z[:, 0] += 40
    assert estimated_temperature(z, 0.7, tau) == pytest.approx(exact_temperature(z, 0.7), rel=0.005)


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


def test_bins_are_sixteen_per_octave():
    lower, centre = sm.bin_edges()
    assert lower[1].item() == 2.0 ** -5 * (1 + 1 / 16)
    assert (lower[2:] / lower[1:-1]).max().item() <= 1 + 1 / 16 + 1e-6
    assert lower[-1].item() > sm.GAP_CLAMP
    assert ((centre > lower) | (torch.arange(sm.GAP_BINS) == 0)).all()


def test_gap_histogram_summarises_each_bin():
    u = torch.tensor([[0.0, 0.01, 1.0, 1.05, 9000.0, 10_000.0, 24.0001, 24.9999] + [3.0] * 200
                      + torch.linspace(0.02, 60, 500).tolist()])
    ws = sm.saturation_workspace(1, u.shape[1], 1 / sm.temperature_grid())
    count, first, second = sm.gap_histogram(u.clone(), ws)[:, 0]
    lower, centre = sm.bin_edges()
    which = torch.bucketize(u[0], lower[1:], right=True)  # bin 0 holds everything below lower[1]
    assert count.sum().item() == u.numel()
    for b in range(sm.GAP_BINS):
        inside = u[0][which == b].double()
        assert count[b].item() == inside.numel()
        d = inside - centre[b].double()
        scale = (lower[b + 1] - lower[b]).item() if b + 1 < sm.GAP_BINS else 1.0
        assert first[b].item() == pytest.approx(d.sum().item(), abs=1e-4 * scale * max(1, inside.numel()))
        assert second[b].item() == pytest.approx(d.square().sum().item(), abs=1e-4 * scale**2 * max(1, inside.numel()))
