"""A tiny LightningModule (embedding + LM head) trained by ``lightning.pytorch.Trainer``
with ``TrainvitalsCallback``, next to an independent record of the true per-token
loss weights (as in ``_hf_job``: ``w_t = -g_{t,y_t} / (1 - p_{t,y_t})`` from the
gradient at the head's output). Run as a script (``python _lightning_job.py OUT.json
KEY=VALUE ...``) it is one rank of the DDP test. With ``$TV_ONLY_PYTORCH_LIGHTNING``
set, the ``lightning`` package cannot be imported (a meta-path finder refuses it) and
the job uses ``pytorch_lightning``, as on a machine where only that is installed."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class _NoLightning:
    """Refuses ``lightning`` and its submodules, as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "lightning" or name.startswith("lightning."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if os.environ.get("TV_ONLY_PYTORCH_LIGHTNING"):
    sys.meta_path.insert(0, _NoLightning())
    import pytorch_lightning as pl
else:
    import lightning.pytorch as pl
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from trainvitals.hooks.lightning import TrainvitalsCallback  # noqa: E402

VOCAB = 32
LENGTHS = (6, 30, 12, 24)


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.embed(batch["ids"]))
        # The micro-batch's token mean; Lightning divides it by accumulate_grad_batches.
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def batches(rank: int, count: int, lengths: tuple[int, ...] = LENGTHS) -> list[dict]:
    """One sample per micro-batch, lengths cycling through ``lengths``; modality 1 for short ones."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(count):
        n = lengths[(i + rank) % len(lengths)]
        ids = torch.randint(0, VOCAB, (1, n), generator=g)
        out.append({"ids": ids, "labels": ids.roll(-1, 1), "modality": torch.tensor([int(n < 20)])})
    return out


class Truth(pl.Callback):
    def __init__(self, module: TinyLM):
        self.steps: list[dict] = []
        self._micro: list[dict] = []
        self._labels = None
        module.head.register_forward_hook(self._logits)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._labels = batch["labels"]

    def _logits(self, module, args, output):
        if not output.requires_grad:
            return
        labels, z = self._labels, output.detach().double()

        def grab(grad):
            g = grad.double()
            p_y = torch.softmax(z, -1).gather(-1, labels[..., None])[..., 0]
            w = -g.gather(-1, labels[..., None])[..., 0] / (1 - p_y)
            self._micro.append({"mass": float(w.sum()), "wmax": float(w.max()), "wmin": float(w.min())})

        output.register_hook(grab)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        micro, self._micro = self._micro, []
        uniform = all(m["wmax"] <= m["wmin"] * (1 + 1e-3) for m in micro)
        self.steps.append(
            {
                "step": trainer.global_step + 1,
                "mass": sum(m["mass"] for m in micro),
                "microbatches": len(micro),
                "spread": max(m["wmax"] for m in micro) / min(m["wmin"] for m in micro) if uniform else None,
            }
        )


def train(
    out_dir: str,
    *,
    steps: int = 6,
    every: int = 1,
    accum: int = 2,
    devices: int = 1,
    rank: int = 0,
    ckpt: str = "",
    resume: str = "",
    lengths: str = "",
) -> dict:
    """Train in ``out_dir`` (also the working folder: the default sink writes
    ``./trainvitals-lightning.jsonl`` there); ``ckpt``: save a checkpoint there at the
    end; ``resume``: start from that checkpoint; ``lengths``: sample lengths, e.g.
    ``16,16`` (equal token counts: the mean of means is exact)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)
    module = TinyLM()
    truth = Truth(module)
    callback = TrainvitalsCallback(every=every, modalities=("text", "image"), modality="modality")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        accumulate_grad_batches=accum,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, truth],
    )
    sizes = tuple(int(n) for n in lengths.split(",")) if lengths else LENGTHS
    data = torch.utils.data.DataLoader(batches(rank, steps * accum, sizes), batch_size=None)
    trainer.fit(module, data, ckpt_path=resume or None)
    if ckpt:
        trainer.save_checkpoint(ckpt)
    return {
        "truth": truth.steps,
        "package": pl.__name__,
        "callback_base": type(callback).__mro__[1].__module__,
        "lightning_imported": "lightning" in sys.modules,
        "step": callback.monitor.step,
        "reports": str(Path(out_dir) / "trainvitals-lightning.jsonl"),
    }


if __name__ == "__main__":
    out = sys.argv[1]
    options = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=", 1) for kv in sys.argv[2:])}
    if "lengths" in options:
        options["lengths"] = str(options["lengths"])
    result = train(**options)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(out).write_text(json.dumps(result))
