"""Data-parallel plumbing: who we are, the one packed collective per report, and
letting go of its tensors before the interpreter ends.

A collective's tensors are held by the process group's own threads for a moment
after the call returns (gloo: its ``runLoop`` thread drops the finished work).
Tensors made in Python carry a Python object, and dropping the last C++ reference
to one takes the GIL; if that happens once the interpreter is finalizing, the thread
is ended mid-destructor and the process aborts ("terminate called without an active
exception", SIGABRT) although the job ended normally. A job whose last step reports
and which then exits quickly (a rank with nothing to send) can lose that race, so
:func:`settle`, called by ``Monitor.close`` (at the latest from ``atexit``, before
finalization), waits until the threads have let go of every tensor we handed them.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from trainvitals.hooks.step import StepContext

_handed: list[weakref.ref[torch.Tensor]] = []  # tensors of our collectives, maybe still held


def _held(ref: weakref.ref[torch.Tensor]) -> bool:
    t = ref()
    # One reference is the Python object's own; more are C++ holders (the group's work,
    # or a view of it still alive).
    return t is not None and t._use_count() > 1  # type: ignore[attr-defined]


def handed(*tensors: torch.Tensor) -> None:
    """Note tensors just given to a collective (weakly: nothing is kept alive)."""
    _handed[:] = [r for r in _handed if _held(r)] + [weakref.ref(t) for t in tensors]


def settle(timeout: float = 0.5) -> bool:
    """Wait, at most ``timeout`` seconds, until the process group's threads have let go
    of the tensors of our collectives (see the module docstring); True once they have.
    Sleeping hands them the GIL; it takes a millisecond or less."""
    deadline = time.monotonic() + timeout
    while True:
        _handed[:] = [r for r in _handed if _held(r)]
        if not _handed:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def combine(ctx: StepContext) -> None:
    """Run the context's cross-rank reductions, then their callbacks.

    All partials of one report are packed into a single vector and exchanged with
    one all-gather; sum, max and min are then taken locally from
    the gathered ``[world, n]`` matrix, so the three ops cost one collective.
    """
    reduces, ctx.reduces = ctx.reduces, []
    if not reduces:
        return
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        for r in reduces:
            r.then(r.tensor)
        return
    device = ctx.device
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    packed = torch.cat([r.tensor.to(device, torch.float64) for r in reduces])
    world = dist.get_world_size()
    gathered = torch.empty(world * packed.numel(), dtype=packed.dtype, device=device)
    # all_gather_single is the newer name (torch 2.13 warns on the old one).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, packed)
    handed(gathered, packed)
    gathered = gathered.view(world, -1)
    offset = 0
    for r in reduces:
        block = gathered[:, offset : offset + r.tensor.numel()]
        offset += r.tensor.numel()
        if r.op == "sum":
            out = block.sum(0)
        elif r.op == "max":
            out = block.amax(0)
        else:
            out = block.amin(0)
        r.then(out.to(ctx.device, torch.float32))
