"""One rank of the FSDP2 job that leaves distributed checkpoints behind (run by
``tests.support.run_ranks``: ``python _fsdp_job.py RANK WORLD PORT OUT FOLDER VARIANT``).

The I4 run of ``tests/audit/_i4.py`` (the scale of shape [1]: FSDP2 shards along a
dimension), every parameter sharded with ``fully_shard`` on a gloo group, the same
batch on every rank (the averaged gradient is the one-process one); at each checkpoint
step the model and optimizer state dicts from ``get_state_dict`` (keyed by parameter
name, DTensor shards) are written by every rank with ``torch.distributed.checkpoint``,
as torchtitan does."""

from __future__ import annotations

import datetime
import json
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch


def main(rank: int, world: int, port: int, out: Path, folder: Path, variant: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.audit import _i4

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    mesh = init_device_mesh("cpu", (world,))
    model = _i4.Readout((1,))
    for sub in (model.lin1, model.lin2):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def make() -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=_i4.LR, eps=1e-8)

    opt = make()
    noise = torch.Generator().manual_seed(7)
    written = []
    for i in range(1, _i4.CHECKPOINTS[-1] + 1):
        x, y = _i4.batch(i)  # the same batch on every rank
        (model(x) - y).square().mean().backward()
        _i4.scale_gradient(model, variant, noise)
        opt.step()
        opt.zero_grad()
        if variant == "bug" and i == _i4.REBUILD_AT:
            opt = make()
        if i in _i4.CHECKPOINTS:
            msd, osd = get_state_dict(model, opt)
            path = folder / f"step-{i}"
            dcp.save({"model": msd, "optimizer": osd, "train_state": {"step": i}}, checkpoint_id=str(path))
            written.append(str(path))
    if rank == 0:
        out.write_text(json.dumps({"written": written}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    r, w, p, o, f, v = sys.argv[1:7]
    main(int(r), int(w), int(p), Path(o), Path(f), v)
