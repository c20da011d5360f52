"""One rank of the one-rank fault tests, and their single-process references
(``python _fault_ranks.py RANK WORLD PORT OUT MODE [COLLECTOR]``).

Two gloo ranks train the FSDP2 tiny model of ``_param_models`` on the same batch (so
the combined figures are the single process's) while one rank only meets a fault:

- ``fail``: rank 1's ``params`` signal raises in its ``collect`` at step 4;
- ``nonfinite``: rank 1's shard of one gradient element is infinite at step 2;
- ``empty``: nothing goes wrong; the 1-element ``scale`` leaves rank 1 an empty shard;
- ``ahead``: rank 0's monitor resumes one step ahead of rank 1's (its checkpoint is a
  step later): their step counters are one off;
- ``live``: rank 0 alone hears the collector's live settings (every=1 mid-run);
- ``interval``: rank 1 attaches with another report interval (every=3, rank 0's 2).

A mode ending ``+apart`` sends the report headers apart from the partials, over a gloo
group of the monitor's own (the path an NCCL job takes: no host read of a device
tensor), here on the CPU.

Every rank writes ``rank<R>.json`` beside OUT: its report steps, the interval at each
step, and each report's samples and coverage.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.hooks._param_models import data, dp_model, dp_optimizer

STEPS = 6
FAIL_AT = 4  # ``fail``: the report step at which rank 1's params signal raises
INF_AT = 2  # ``nonfinite``: the step whose gradient holds an infinity on rank 1
INF_ELEMENT = 6  # lin1.bias[6]: the first element of rank 1's shard (12 elements, 2 ranks)
SIGNALS = ("optimizer", "params", "adam")


def attach_kwargs(mode: str) -> dict:
    return {"run": "faults", "sink": "null", "every": 4 if mode == "live" else 2, "signals": SIGNALS}


def resume_ahead(mon, rank: int) -> None:
    """``ahead``: rank 0's monitor continues from a checkpoint one step later."""
    if rank == 0:
        mon.load_state_dict({"format": 1, "run": "faults", "step": 1, "signals": {}})


def make_infinite(grad: torch.Tensor, rank: int, sharded: bool) -> None:
    """``nonfinite``: lin1.bias's gradient element INF_ELEMENT, on the rank holding it."""
    if sharded:
        if rank == 1:
            grad.to_local()[INF_ELEMENT - 6] = float("inf")
    else:
        grad[INF_ELEMENT] = float("inf")


def record(mon, out: dict) -> None:
    out["steps"].append(mon.step)
    out["reports"].append(mon.latest())
    out["coverage"].append(mon.latest_coverage())


def single_process(mode: str) -> dict:
    """What one process reports for the same run (the ``fail`` mode's reference has no
    failure: its figures are what the ranks report before it)."""
    from tests.support import one_torch_thread  # here: the ranks run this file as a script
    from trainvitals.hooks import attach

    with one_torch_thread():
        model = dp_model("fsdp")
        opt = dp_optimizer(model)
        mon = attach(model, opt, **attach_kwargs(mode))
        if mode == "ahead":
            resume_ahead(mon, 0)
        out: dict = {"steps": [], "reports": [], "coverage": []}
        for i in range(STEPS):
            x, y = data(i)
            (model(x) - y).square().mean().backward()
            if mode == "nonfinite" and i + 1 == INF_AT:
                make_infinite(model.lin1.bias.grad, 0, sharded=False)
            reporting = mon.reporting_next
            opt.step()
            opt.zero_grad(set_to_none=True)
            if reporting:
                record(mon, out)
        mon.close()
        return out


def _rank_main(rank: int, world: int, port: int, out: str, mode: str, collector: str | None) -> None:
    import datetime
    import time
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainvitals.hooks import attach, distributed

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    mode, _, apart = mode.partition("+")
    distributed.HEADER_APART = apart == "apart"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    model = dp_model("fsdp")
    mesh = init_device_mesh("cpu", (world,))
    for sub in (model.lin1, model.norm, model.lin2):
        fully_shard(sub, mesh=mesh)
    wrapped = fully_shard(model, mesh=mesh)
    opt = dp_optimizer(wrapped)
    kwargs = attach_kwargs(mode)
    if mode == "interval" and rank == 1:
        kwargs.update(every=3)
    if mode == "live" and rank == 0:
        kwargs.update(sink=None, collector=collector)
    mon = attach(wrapped, opt, **kwargs)
    if mode == "ahead":
        resume_ahead(mon, rank)
    if mode == "fail" and rank == 1:
        params = next(s for s in mon.signals if s.covers == "params")
        collect = params.collect

        def failing(monitor, ctx):
            if monitor.step == FAIL_AT:
                raise RuntimeError("injected on rank 1")
            collect(monitor, ctx)

        params.collect = failing
    got: dict = {"steps": [], "reports": [], "coverage": [], "every": [], "sharded": mon.sharded}
    stop = torch.zeros(1)
    i = 0
    while True:
        x, y = data(i if mode != "live" else i % STEPS)
        (wrapped(x) - y).square().mean().backward()
        if mode == "nonfinite" and i + 1 == INF_AT:
            make_infinite(model.lin1.bias.grad, rank, sharded=True)
        reporting = mon.reporting_next
        opt.step()
        opt.zero_grad(set_to_none=True)
        i += 1
        got["every"].append(mon.config.every)
        if reporting:
            record(mon, got)
        if mode != "live":
            if i == STEPS:
                break
            continue
        if rank == 0:
            mon.flush(2.0)  # the collector's answer is in before the next step
            # Stop 6 steps after every=1 took effect (or give up at 300).
            since = len(got["every"]) - got["every"].index(1) if 1 in got["every"] else 0
            stop.fill_(1.0 if since >= 6 or i >= 300 else 0.0)
            time.sleep(0.02)
        dist.broadcast(stop, 0)
        if stop.item():
            break
    mon.close()
    Path(out).with_name(f"rank{rank}.json").write_text(json.dumps(got))
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
        sys.argv[6] if len(sys.argv) > 6 else None,
    )
