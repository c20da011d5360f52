"""NormPlan (the per-tensor gradient norms of models with many tensors) against plain torch."""

from __future__ import annotations

import pytest
import torch

from trainvitals.hooks.tensors import SMALL_NUMEL, NormPlan


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    """Shapes as a model has them: many repeated small ones (grouped), a few large and
    odd ones (foreach), a 0-d scalar, a transposed view, bf16, an empty one, inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for layer in range(12):
        out.append(torch.randn(16, 16, generator=g) * (layer + 1))
        out.append(torch.randn(16, generator=g) * 1e-20)  # tiny: no underflow to 0
        out.append(torch.randn(16, generator=g).to(torch.bfloat16))
        out.append(torch.randn(8, 32, generator=g).t())  # not contiguous
    out.append(torch.randn(SMALL_NUMEL + 1, generator=g))  # large: foreach
    out.append(torch.tensor(3.0))  # 0-d
    out.append(torch.zeros(0))
    out.append(torch.randn(5, 7, generator=g))
    out[5][3] = float("inf")  # a grouped 1-D tensor
    out[8][0, 0] = float("nan")  # a grouped 2-D tensor
    return out


def _reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double().pow(2).sum().sqrt() for t in tensors]).float()


def test_norms_equal_plain_torch_in_order():
    tensors = _tensors()
    plan = NormPlan(tensors, torch.device("cpu"))
    assert plan.groups, "the repeated small shapes should be grouped"
    assert sum(len(g[0]) for g in plan.groups) + len(plan.rest) == len(tensors)
    got = plan.norms(tensors)
    torch.testing.assert_close(got, _reference(tensors), rtol=2e-6, atol=0.0, equal_nan=True)
    assert got.dtype == torch.float32 and got.shape == (len(tensors),)
    # the plan is for shapes: new values of the same shapes (the next step's gradients)
    again = _tensors(seed=1)
    torch.testing.assert_close(plan.norms(again), _reference(again), rtol=2e-6, atol=0.0, equal_nan=True)


def test_wrong_count_raises():
    tensors = _tensors()
    plan = NormPlan(tensors, torch.device("cpu"))
    with pytest.raises(ValueError, match="built for"):
        plan.norms(tensors[:-1])


def test_cached_plan_rebuilds_when_the_shapes_change():
    slot: list = [None]
    tensors = _tensors()
    NormPlan.cached(slot, "k", tensors, torch.device("cpu"))
    first = slot[0][1]
    # the same key, but a grouped tensor replaced by one of another shape (p.data = ...)
    changed = list(tensors)
    changed[0] = torch.randn(16, 20)
    got = NormPlan.cached(slot, "k", changed, torch.device("cpu"))
    assert slot[0][1] is not first
    torch.testing.assert_close(got, _reference(changed), rtol=2e-6, atol=0.0, equal_nan=True)


def test_sparse_sum_against_a_plain_loop():
    """SparseSum against a plain loop, with and without a bias, into a kept buffer too."""
    from trainvitals.hooks import tensors

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, generator=g, dtype=torch.float64)
    pairs = [(r, c) for r in range(7) for c in range(40) if (r * 7 + c * 3) % 5 == 0]
    bias = torch.arange(7, dtype=torch.float64)
    want = bias.clone()
    for r, c in pairs:
        want[r] += x[c]
    s = tensors.SparseSum(7, pairs, torch.device("cpu"), torch.float64)
    assert torch.allclose(s(x, bias), want, rtol=1e-12)
    assert torch.allclose(s(x), want - bias, rtol=1e-12)
    kept = torch.empty(7, dtype=torch.float64)
    assert s(x, bias, out=kept) is kept and torch.allclose(kept, want, rtol=1e-12)
    assert torch.equal(s.zeros, torch.zeros(7, dtype=torch.float64))  # the base is never written


def test_sparse_sum_keeps_a_non_finite_entry_in_its_own_rows():
    """An infinite or NaN entry makes only the rows it is summed into non-finite (a 0/1
    matrix product would make every row NaN: 0 x inf)."""
    from trainvitals.hooks import tensors

    pairs = [(0, 0), (0, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]  # two groups and the whole
    s = tensors.SparseSum(3, pairs, torch.device("cpu"), torch.float32)
    got = s(torch.tensor([1.0, 2.0, float("inf"), 4.0]))
    assert got.tolist() == [3.0, float("inf"), float("inf")]
    got = s(torch.tensor([float("nan"), 2.0, 3.0, 4.0]))
    assert got[1].item() == 7.0 and got[0].isnan() and got[2].isnan()


def test_repeated_sum_equals_sparse_sum_from_blocks_and_values():
    """RepeatedSum fed the pieces x is made of (blocks, one of them empty, then 0-d
    values) sums what SparseSum sums from x, bias included, and keeps a non-finite entry
    in its rows; SparseSum.take picks a list's values in its pairs' order."""
    from trainvitals.hooks import tensors

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    block = torch.randn(5, generator=g)
    values = list(torch.randn(4, generator=g).unbind())
    blocks = [block, torch.zeros(0)]
    x = torch.cat([block, torch.stack(values)])
    pairs = [(r, c) for r in range(6) for c in range(9) if (r + 2 * c) % 3 == 0]  # columns used 1-2 times
    pairs += [(5, 0), (4, 0)]  # and column 0 four times
    bias = torch.arange(7, dtype=torch.float32)  # the last entry: the scratch row
    want = tensors.SparseSum(6, pairs, cpu, torch.float32)(x.square(), bias[:6])
    r = tensors.RepeatedSum(6, pairs, 9, cpu, torch.float32)
    assert r.copies == 4
    out = torch.empty(7)
    got = r(r.fill(blocks, values).square_(), bias, out=out)
    assert got is out
    torch.testing.assert_close(out[:6], want, rtol=1e-6, atol=0.0)
    values[0] = torch.tensor(float("inf"))  # column 5
    r(r.fill(blocks, values).square_(), bias, out=out)
    inf_rows = {row for row, c in pairs if c == 5}
    assert {i for i in range(6) if out[i].isinf()} == inf_rows
    with pytest.raises(ValueError, match="columns"):
        r.fill(blocks, values[:-1])
    columns = list(range(9))
    sparse = tensors.SparseSum(6, pairs, cpu, torch.float32)
    assert sparse.take(columns) == [c for _, c in pairs]
    assert tensors.SparseSum(1, [(0, 3)], cpu, torch.float32).take(columns) == [3]
