"""``trainvitals audit`` on multi-GB checkpoints: time, read throughput against the
disk's own (``dd``), peak memory.

Run: ``python tests/benchmarks/bench_audit.py [--gib 3] [--rounds 3] [--dir /tmp]``.

Two synthetic checkpoints of about ``--gib`` GiB each are written to ``--dir`` (deleted
at the end):

- ``model.safetensors``: float32 matrices of [4096, 8192] (128 MiB each) and 1D
  parameters, model only (read with ``safe_open`` in row slices);
- ``ckpt.pt``: ``torch.save({'model', 'optimizer', 'step'})`` with a third of the bytes
  in the model and two thirds in Adam's moments (read with ``torch.load(mmap=True)``).

Both are written without holding them in memory (safetensors: streamed into the
file; torch.save: from tensors mapped from scratch files), so the page cache holds
them when they are read: the audit is compared with ``dd if=FILE of=/dev/null bs=16M``
right before it, on the same warm cache (nothing is dropped: that needs root). For
context, ``dd iflag=direct`` reads the file past the cache, the device's own rate.

Each audit runs in a fresh Python (``trainvitals audit --json FILE``, torch on one
thread) that samples its own ``/proc/self/status`` every 10 ms: the peak resident set
(VmHWM, which counts the mapped file pages the kernel keeps resident, reclaimable) and
the peak anonymous memory (RssAnon: what the audit itself allocates, the bound).
Medians over ``--rounds``; the last line gives the figures as ``key=value``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROWS, COLS = 4096, 8192
MIB = 1 << 20

_CHILD = r"""
import contextlib, io, json, sys, threading, time
import torch
torch.set_num_threads(1)
peak = {"RssAnon": 0, "RssFile": 0}
done = threading.Event()
def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out
def sample():
    while not done.is_set():
        s = status()
        for k in peak:
            peak[k] = max(peak[k], s[k])
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
from trainvitals.monitor.cli import main
t0 = time.perf_counter()
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    try:
        main(["audit", "--json", *sys.argv[1:]], standalone_mode=False)
    except SystemExit:
        pass
wall = time.perf_counter() - t0
done.set()
s = status()
findings = len(json.loads(buf.getvalue())["findings"])
print(json.dumps({"wall": wall, "vmhwm": s["VmHWM"], "anon": max(peak["RssAnon"], s["RssAnon"]),
                  "file": max(peak["RssFile"], s["RssFile"]), "findings": findings}))
"""


def write_safetensors(path: Path, matrices: int) -> int:
    """Stream a safetensors file: the header, then each tensor generated and written."""
    g = torch.Generator().manual_seed(0)
    entries: list[tuple[str, tuple[int, ...]]] = [(f"layers.{i}.weight", (ROWS, COLS)) for i in range(matrices)]
    entries += [(f"layers.{i}.norm.weight", (COLS,)) for i in range(matrices)]
    header, offset = {}, 0
    for name, shape in entries:
        n = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for _, shape in entries:
            t = torch.randn(shape, generator=g) if len(shape) > 1 else 1.0 + 0.01 * torch.randn(shape, generator=g)
            fh.write(t.numpy().tobytes())
    return path.stat().st_size


def write_torch(path: Path, scratch: Path, matrices: int) -> int:
    """torch.save of model + Adam state whose tensors are mapped from scratch files."""
    g = torch.Generator().manual_seed(1)

    def mapped(name: str, n: int) -> torch.Tensor:
        return torch.from_file(str(scratch / name), shared=True, size=n)

    model, state = {}, {}
    for i in range(matrices):
        w = mapped(f"w{i}", ROWS * COLS).view(ROWS, COLS)
        w.normal_(generator=g)
        m = mapped(f"m{i}", ROWS * COLS).view(ROWS, COLS)
        m.normal_(generator=g).mul_(1e-3)
        v = mapped(f"v{i}", ROWS * COLS).view(ROWS, COLS)
        v.uniform_(generator=g).mul_(1e-6)
        model[f"layers.{i}.weight"] = w
        model[f"layers.{i}.norm.weight"] = torch.ones(COLS)
        state[2 * i] = {"step": torch.tensor(100.0), "exp_avg": m, "exp_avg_sq": v}
        state[2 * i + 1] = {"step": torch.tensor(100.0), "exp_avg": torch.zeros(COLS), "exp_avg_sq": torch.zeros(COLS)}
    groups = [
        {
            "params": list(range(2 * matrices)),
            "lr": 1e-3,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "amsgrad": False,
        }
    ]
    torch.save({"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 100}, path)
    for f in scratch.iterdir():
        f.unlink()
    return path.stat().st_size


def dd(path: Path, direct: bool = False) -> float:
    """dd's own read rate, bytes/s."""
    cmd = ["dd", f"if={path}", "of=/dev/null", "bs=16M"] + (["iflag=direct"] if direct else [])
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    m = re.search(r"copied, ([\d.]+) s", err)
    assert m, err
    return path.stat().st_size / float(m.group(1))


def audit(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the temporary files are deleted on kill too
    figures = {}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench-audit-") as tmp:
        folder = Path(tmp)
        scratch = folder / "scratch"
        scratch.mkdir()
        matrix_bytes = ROWS * COLS * 4
        files = {
            "safetensors": (
                folder / "model.safetensors",
                lambda p: write_safetensors(p, round(a.gib * 1024**3 / matrix_bytes)),
            ),
            "torch.save": (
                folder / "ckpt.pt",
                lambda p: write_torch(p, scratch, max(1, round(a.gib * 1024**3 / matrix_bytes / 3))),
            ),
        }
        for kind, (path, write) in files.items():
            t0 = time.perf_counter()
            size = write(path)
            made = time.perf_counter() - t0
            direct = dd(path, direct=True)
            rounds = []
            for _ in range(a.rounds):
                warm = dd(path)
                r = audit(path)
                r["dd"] = warm
                rounds.append(r)
            wall = statistics.median(r["wall"] for r in rounds)
            warm = statistics.median(r["dd"] for r in rounds)
            key = kind.replace(".", "_")
            figures.update(
                {
                    f"{key}_bytes": size,
                    f"{key}_wall_s": round(wall, 2),
                    f"{key}_audit_mib_s": round(size / wall / MIB),
                    f"{key}_dd_warm_mib_s": round(warm / MIB),
                    f"{key}_dd_direct_mib_s": round(direct / MIB),
                    f"{key}_peak_rss_mib": round(max(r["vmhwm"] for r in rounds) / MIB),
                    f"{key}_peak_anon_mib": round(max(r["anon"] for r in rounds) / MIB),
                    f"{key}_peak_file_mib": round(max(r["file"] for r in rounds) / MIB),
                }
            )
            print(
                f"{kind}: {size / 1024**3:.2f} GiB (written in {made:.0f} s): audit {wall:.1f} s = "
                f"{size / wall / MIB:.0f} MiB/s; dd warm {warm / MIB:.0f} MiB/s, dd direct {direct / MIB:.0f} MiB/s; "
                f"peak RSS {max(r['vmhwm'] for r in rounds) / MIB:.0f} MiB "
                f"(anonymous {max(r['anon'] for r in rounds) / MIB:.0f} MiB, file pages "
                f"{max(r['file'] for r in rounds) / MIB:.0f} MiB); {rounds[0]['findings']} finding(s); "
                f"rounds {[round(r['wall'], 1) for r in rounds]}",
                flush=True,
            )
            path.unlink()
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
