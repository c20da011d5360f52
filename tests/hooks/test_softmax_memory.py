"""Observing 131k-class logits allocates at most softmax_chunk_bytes (+ a small,
position-bounded overhead) beyond the logits themselves.

CPU torch has no peak-allocation counter, so a fresh interpreter measures its own
resident set: the logits are allocated and filled first (in place, so no
temporary raises the high-water mark), then ``ru_maxrss`` after observing minus the
resident set just before is the extra peak (an over-estimate if anything: the
high-water mark can only be higher than the peak of the observe call itself).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MIB = 1 << 20
CHUNK_BYTES = 64 * MIB  # the default softmax_chunk_bytes
# Beyond the chunk buffers: per-position vectors and the [rows, bins, grid] terms
# (counted in the chunk bound too), allocator slack, and code paths touched for the
# first time at this size.
OVERHEAD = 24 * MIB

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch
    from torch import nn
    from trainvitals.hooks import attach

    torch.set_num_threads(1)
    view = sys.argv[1] == "view"

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = attach(model, opt, run="memory", sink="null", every=1,
                 softmax_chunk_bytes={chunk}, softmax_max_positions=256)
    mon.observe_logits(torch.randn(2, 3, 500), mask=torch.ones(2, 3, dtype=torch.bool))  # warm code paths

    V = 131072
    logits = torch.empty(4, 512, V)                       # 1 GiB float32
    logits.copy_(torch.randn(1, 1, V).expand(4, 512, V))  # filled in place: no big temporary
    logits[..., 0] += torch.linspace(0, 30, 4 * 512).view(4, 512)
    observed = logits if view else logits[:, :-1]        # [:, :-1] cannot merge [B, T]: gathered rows
    mask = torch.ones(observed.shape[:-1], dtype=torch.bool)

    before_rss, before_peak = rss(), peak()
    mon.observe_logits(observed, mask=mask, task="big")
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    after_peak = peak()
    print(json.dumps({{"extra": after_peak - before_rss, "slack": before_peak - before_rss,
                      "top1": mon.value("softmax_top1_prob_mean", task="big", role="student")}}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["view", "gathered"])
def test_observing_a_150k_class_batch_stays_within_the_chunk_bound(layout):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(chunk=CHUNK_BYTES), layout],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["top1"] is not None and 0 < result["top1"] <= 1
    # Without chunking, 256 positions x 131072 classes x 16 bytes would be 512 MiB.
    assert result["extra"] <= CHUNK_BYTES + OVERHEAD, (
        f"extra peak {result['extra'] / MIB:.1f} MiB (slack before: {result['slack'] / MIB:.1f} MiB)")
