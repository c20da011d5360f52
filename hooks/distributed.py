"""Data-parallel plumbing: who we are, the one packed collective per report, and
letting go of its tensors before the interpreter ends.

The report collective is agreed: every rank's row carries a small header before its
partials (:class:`ReportCollective`): the step, the length, and one entry per signal
(a key from its name, running or turned off, a fingerprint of its partials' ops and
sizes, their count), the partials padded to a capacity every rank knows. After the
one all-gather each rank reads the headers of all: what agrees is combined; what does
not is withheld with a reason, the same way on every rank, so the next report's
collectives pair again. Nothing that happens on one rank only changes the size of the
vector, so the ranks' collectives never mismatch (an error, a hang, or figures
combined from different things).

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

import functools
import logging
import math
import time
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
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


SLOTS = 16
"""Signals (and the monitor's own partials) one header speaks for; more: the report's
cross-rank figures are withheld (said why)."""
_MAGIC = 7_340_717.0  # marks a row as a report header of this layout
_HEAD = 5  # magic, step, length, entries used, report interval
HEADER = _HEAD + 4 * SLOTS
"""Elements of a row's header."""
RUNNING, OFF = 1.0, 2.0  # an entry's state


@functools.lru_cache(maxsize=1024)
def key_of(name: str) -> int:
    """A stable 31-bit key for a signal's name (the same on every rank and process)."""
    return zlib.crc32(name.encode()) & 0x7FFF_FFFF


def _fingerprint(parts: Sequence[tuple[str, int]]) -> int:
    return zlib.crc32(repr(list(parts)).encode()) & 0x7FFF_FFFF


@dataclass
class Member:
    """What a report's header says of one signal (or of the monitor's own partials)."""

    name: str
    off: bool = False
    owner: Any = None
    reduces: list[Any] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(r.tensor.numel() for r in self.reduces)

    @property
    def fingerprint(self) -> int:
        return _fingerprint([(r.op, r.tensor.numel()) for r in self.reduces]) if self.reduces else 0


@dataclass
class Outcome:
    """What the ranks' headers said, the same on every rank."""

    withheld: list[tuple[Any, str, str]] = field(default_factory=list)
    """(owner, reason, detail) of each member whose cross-rank figures are withheld
    (owner None: the monitor's own)."""
    failed_on: list[tuple[Any, int]] = field(default_factory=list)
    """(signal, rank): running here, turned off on that rank: to be turned off here."""
    step: int | None = None
    """The ranks' steps differed: the step every rank takes (their largest)."""
    every: int | None = None
    """The ranks' report intervals differed: rank 0's, which every rank takes."""
    gathers: int = 0
    """Collectives this report took (1 in the steady state)."""


def _grow(n: int) -> int:
    """A capacity for a payload of ``n``: some room to grow, whole blocks of 64."""
    return max(64, math.ceil(n * 1.125 / 64) * 64)


HEADER_APART: bool | None = None
"""Whether the headers travel apart from the partials, over a gloo group on the host:
None decides by the job's backend (apart under any backend but gloo: NCCL's partials are
on the GPU, where reading the gathered headers on the host would wait for the device);
a test sets it to take that path on the CPU."""


class ReportCollective:
    """The report's collective, agreed across ranks (see the module docstring).

    On gloo (a CPU job) the header and the partials travel in one all-gather. The
    capacity starts at 0 on every rank: the first report gathers the headers alone
    (every rank knows their size), then the partials at the capacity all agreed from
    them; a payload that outgrows it later is gathered again, the same way, in the same
    report (all ranks saw the same headers, so all do). In the steady state: one
    all-gather of ``HEADER + capacity`` float64 per rank.

    Under NCCL (partials on the GPU) the headers are gathered first on the host, over
    a gloo group the monitor makes at attach, then the partials on the device at the
    capacity they agreed: two collectives per report and no wait for the device (the
    host never reads a device tensor on the training thread)."""

    def __init__(self) -> None:
        self.capacity = 0
        self._host_group: Any = None
        dist = _dist()
        apart = HEADER_APART if HEADER_APART is not None else (dist is not None and dist.get_backend() != "gloo")
        if dist is not None and dist.get_world_size() > 1 and apart:
            try:  # collective: made at attach on every rank, in the same order
                self._host_group = dist.new_group(backend="gloo")
            except Exception as exc:  # noqa: BLE001 - a torch built without gloo: the one gather
                logging.getLogger("trainvitals").warning(
                    "no gloo group for the report headers (%s: %s): they travel with the partials, "
                    "and each report step waits for the device to read them",
                    type(exc).__name__,
                    exc,
                )

    def _header(self, ctx: StepContext, entries: list[Member], length: int, every: int) -> list[float]:
        head = [_MAGIC, float(ctx.step), float(length), float(len(entries)), float(every)]
        for m in entries[:SLOTS]:
            head += [float(key_of(m.name)), OFF if m.off else RUNNING, float(m.fingerprint), float(m.size)]
        return head + [0.0] * (HEADER - len(head))

    def _gather(self, row: torch.Tensor, world: int, group: Any = None) -> torch.Tensor:
        dist = _dist()
        gathered = torch.empty(world * row.numel(), dtype=row.dtype, device=row.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, row, group=group)
        handed(gathered, row)
        return gathered.view(world, -1)

    def combine(self, ctx: StepContext, members: list[Member], every: int = 0) -> Outcome:
        """Run ``ctx``'s partials across ranks, then their callbacks; ``members``: the
        running signals in order, each with ``owner`` the object its partials' ``owner``
        names (reduces with an owner that is not a member join the monitor's own)."""
        out = Outcome()
        reduces, ctx.reduces = ctx.reduces, []
        dist = _dist()
        if dist is None or dist.get_world_size() == 1:
            for r in reduces:
                r.then(r.tensor)
            return out
        for m in members:
            m.reduces = []
        mine = Member("trainvitals.monitor")
        by_owner = {id(m.owner): m for m in members if m.owner is not None}
        for r in reduces:
            member = by_owner.get(id(r.owner)) if r.owner is not None else None
            (member if member is not None and not member.off else mine).reduces.append(r)
        entries = [*members, mine]
        world, me = dist.get_world_size(), dist.get_rank()
        device = ctx.device
        if dist.get_backend() == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        try:
            payload_parts = [r.tensor.to(device, torch.float64) for m in entries if not m.off for r in m.reduces]
        except Exception as exc:  # noqa: BLE001 - out of memory on one rank: the others wait in the gather
            logging.getLogger("trainvitals").warning(
                "could not pack the report's partials: %s: %s", type(exc).__name__, exc
            )
            payload_parts = []
            entries = [Member(m.name, off=m.off, owner=m.owner) for m in entries]  # nothing sent
            unpacked = True
        else:
            unpacked = False
        length = sum(p.numel() for p in payload_parts)
        head = self._header(ctx, entries, -1 if unpacked else length, every)
        if self._host_group is not None:
            heads = self._gather(torch.tensor(head, dtype=torch.float64), world, self._host_group).tolist()
            out.gathers += 1
            longest = max(int(h[2]) for h in heads)
            if all(h[0] == _MAGIC for h in heads) and longest > self.capacity:
                self.capacity = _grow(longest)  # every rank saw the same lengths
            base, cap = 0, self.capacity
            pad = torch.zeros(cap - length, dtype=torch.float64, device=device)
            gathered = self._gather(torch.cat([*payload_parts, pad]), world)
            out.gathers += 1
        else:
            base = HEADER
            header = torch.tensor(head, dtype=torch.float64)
            if device.type == "cuda":
                header = header.pin_memory().to(device, non_blocking=True)
            while True:
                cap = self.capacity
                if cap >= length:  # one op: the header, the partials, the padding
                    pad = torch.zeros(cap - length, dtype=torch.float64, device=device)
                    row = torch.cat([header, *payload_parts, pad])
                else:  # outgrown: the header alone says so (the partials follow at the new capacity)
                    row = torch.cat([header, torch.zeros(cap, dtype=torch.float64, device=device)])
                gathered = self._gather(row, world)
                out.gathers += 1
                # The headers on the host: the decision must be the same on every rank.
                heads = gathered[:, :HEADER].cpu().tolist()
                longest = max(int(h[2]) for h in heads)
                if all(h[0] == _MAGIC for h in heads) and longest > cap:
                    self.capacity = _grow(longest)  # every rank saw the same lengths
                    continue
                break
        self._judge(heads, entries, me, out)
        if any(w[0] is _ALL for w in out.withheld):
            out.withheld = [(m.owner, *out.withheld[0][1:]) for m in entries if m.reduces]
            return out
        withheld = {id(w[0]) for w in out.withheld}
        offsets = _offsets(heads)
        aligned = all(o == offsets[me] for o in offsets)  # the common case: one slice for all ranks
        for m in entries:
            if not m.reduces or id(m.owner) in withheld:
                continue
            k = key_of(m.name)
            at = [base + offsets[r][k] for r in range(world)]
            for r in m.reduces:
                n = r.tensor.numel()
                if aligned:
                    block = gathered[:, at[me] : at[me] + n]
                else:
                    block = torch.stack([gathered[q, at[q] : at[q] + n] for q in range(world)])
                at = [a + n for a in at]
                if r.op == "sum":
                    combined = block.sum(0)
                elif r.op == "max":
                    combined = block.amax(0)
                else:
                    combined = block.amin(0)
                r.then(combined.to(ctx.device, torch.float32))
        return out

    def _judge(self, heads: list[list[float]], entries: list[Member], me: int, out: Outcome) -> None:
        """Compare the ranks' headers; fill ``out`` (the same on every rank)."""
        if not all(h[0] == _MAGIC for h in heads):
            bad = [r for r, h in enumerate(heads) if h[0] != _MAGIC]
            out.withheld.append((_ALL, "ranks_disagree", f"rank {bad[0]} sent no report header"))
            return
        unpacked = [r for r, h in enumerate(heads) if h[2] < 0]
        if unpacked:
            out.withheld.append((_ALL, "ranks_disagree", f"rank {unpacked[0]} could not pack its partials"))
            return
        steps = [int(h[1]) for h in heads]
        if len(set(steps)) > 1:
            said = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
            out.step = max(steps)
            out.withheld.append(
                (
                    _ALL,
                    "ranks_disagree",
                    f"ranks disagree on the step ({said}); every rank goes on from step {out.step}",
                )
            )
        everies = [int(h[4]) for h in heads]
        if len(set(everies)) > 1:
            said = ", ".join(f"rank {r} every {e}" for r, e in enumerate(everies))
            out.every = everies[0]
            out.withheld.append(
                (_ALL, "ranks_disagree", f"ranks disagree on the report interval ({said}); every rank takes rank 0's")
            )
        if any(int(h[3]) > SLOTS for h in heads):
            out.withheld.append(
                (_ALL, "ranks_disagree", f"more than {SLOTS} signals: the report header cannot say them")
            )
        if out.withheld:
            out.withheld = (
                out.withheld[:1]
                if len(out.withheld) == 1
                else [(_ALL, "ranks_disagree", "; ".join(w[2] for w in out.withheld))]
            )
            return
        tables = [_entries(h) for h in heads]
        for m in entries:
            k = key_of(m.name)
            seen = [t.get(k) for t in tables]
            off_on = [r for r, e in enumerate(seen) if e is not None and e[0] == OFF]
            if not m.off and off_on:
                r = off_on[0]
                out.failed_on.append((m.owner, r))
                if m.reduces:
                    out.withheld.append(
                        (
                            m.owner,
                            "failed",
                            f"it failed on rank {r} and is turned off on every rank (rank {r}'s log has the error)",
                        )
                    )
                continue
            if m.off or not m.reduces:
                continue
            missing = [r for r, e in enumerate(seen) if e is None]
            if missing:
                out.withheld.append(
                    (m.owner, "ranks_disagree", f"ranks disagree: it does not run on rank {missing[0]}")
                )
                continue
            mine = seen[me]
            differ = [r for r, e in enumerate(seen) if e != mine]
            if differ:
                r = differ[0]
                out.withheld.append(
                    (
                        m.owner,
                        "ranks_disagree",
                        f"ranks disagree: rank {r} sent {int(seen[r][2])} partials for its {int(mine[2])} here "  # type: ignore[index]
                        "(another layout)",
                    )
                )


class _AllMembers:
    """Marks a verdict that holds for every member of the report."""


_ALL = _AllMembers()


def _entries(head: list[float]) -> dict[int, tuple[float, float, float]]:
    """A header's entries: key -> (state, fingerprint, size)."""
    n = min(int(head[3]), SLOTS)
    out = {}
    for i in range(n):
        k, state, fp, size = head[_HEAD + 4 * i : _HEAD + 4 * i + 4]
        out[int(k)] = (state, fp, size)
    return out


def _offsets(heads: list[list[float]]) -> list[dict[int, int]]:
    """Per rank: where each entry's partials start in its payload."""
    out = []
    for h in heads:
        at, offs = 0, {}
        for k, (state, _, size) in _entries(h).items():
            offs[k] = at
            if state == RUNNING:
                at += int(size)
        out.append(offs)
    return out
