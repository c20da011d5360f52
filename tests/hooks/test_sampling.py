"""TensorsSample: the buffer path (take_into, used on every report) copies exactly the
elements the allocating path (take) does, for every layout a parameter can have."""

from __future__ import annotations

import torch

from trainvitals.hooks.sampling import TensorsSample
from trainvitals.hooks.tensors import flat


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(40, 50, generator=g),  # contiguous, block-sampled
        torch.randn(50, 40, generator=g).t(),  # not contiguous: sampled from a copy
        torch.randn(7, generator=g),  # small: every element
        torch.randn(30, 30, dtype=torch.complex64, generator=g),  # complex: (real, imaginary) pairs
        torch.randn(64, 64, generator=g).to(torch.bfloat16),  # narrower dtype: cast to float32
        torch.randn(3, 5, 7, generator=g)[:, 1:4],  # a strided slice
    ]


def test_take_into_copies_what_take_copies():
    tensors = _tensors()
    sample = TensorsSample([flat(t).numel() for t in tensors], cap=256)
    assert any(b is not None for b in sample.blocks) and any(b is None for b in sample.blocks)
    expected = sample.take(tensors, torch.device("cpu"))
    buf = torch.full((sum(sample.sizes),), float("nan"))
    destinations = sample.destinations(buf)
    sample.take_into(tensors, destinations)
    assert torch.equal(buf, expected)
    # The views are made once: a second report refreshes the same buffer in place.
    for t in tensors:
        t.add_(1)
    sample.take_into(tensors, destinations)
    assert torch.equal(buf, sample.take(tensors, torch.device("cpu")))
