"""Packed rows: a tiny Llama (sdpa, built from a config, no download) trained on
samples packed into one row per micro-batch, with ``TrainvitalsCallback`` (the
Trainer) or zero-code ``attach`` (a plain loop), next to an independent truth.

Layouts (``layout=``):

- ``positions``: ``DataCollatorWithFlattening`` (restarting position ids, no
  attention mask): transformers builds a block-diagonal mask, nothing leaks;
- ``flash``: the collator's flash kwargs only (``return_flash_attn_kwargs=True,
  return_position_ids=False``): sdpa ignores ``cu_seq_lens``: samples leak;
- ``ones``: restarting position ids beside an all-ones ``attention_mask``: the
  block-diagonal mask is not built: samples leak;
- ``loop``: a plain loop passing restarting position ids with ``use_cache=True``
  (the model's default): the mask is not built under a cache: samples leak;
- ``loopmask``: the same loop with ``use_cache=False``: nothing leaks.

Each optimizer step is one micro-batch of ``TEXT`` long text samples and ``IMAGE``
short samples holding the image token, shuffled into one row. ``norm=token``: the
model's own loss (per token); ``norm=sample``: a mean of per-sample means (the twin).
``tagged=1``: a per-token modality field.

The truth (float64): each label token's weight from the logits' gradient
(``label_token_weights``), summed per true sample (the collator's own lengths), the
per-step shares, dilution and exponent; and the leak: the first micro-batch of the
step forwarded again in eval mode with the row's first sample's token ids replaced by
``(id + 1) % vocab`` (``+ 2`` where that is the image token; image tokens kept), the
largest change of the logits at the positions of the row's other samples (before the
optimizer step: the weights the forward saw).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

from tests.integrations._hf_models import VOCAB, job_options, label_token_weights, tiny_llama_config, trainer_arguments

IMAGE = 63  # the image token the model's config names
TEXT, SHORT = 10, 2  # samples per micro-batch: long text, short image
TEXT_LEN, SHORT_LEN = 48, 6


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_llama_config(image_token_id=IMAGE, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config)


def samples(step: int) -> list[dict]:
    """One micro-batch's samples, shuffled (seeded by the step): TEXT of TEXT_LEN tokens,
    SHORT of SHORT_LEN holding the image token at their second position."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(TEXT + SHORT):
        image = i >= TEXT
        n = SHORT_LEN if image else TEXT_LEN
        ids = torch.randint(1, IMAGE, (n,), generator=g)
        if image:
            ids[1] = IMAGE
        out.append({"input_ids": ids.tolist(), "modality": int(image)})
    order = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in order]


class Samples(torch.utils.data.IterableDataset):
    """The samples of every micro-batch in turn (an iterable dataset: the Trainer keeps
    its order; ``TEXT + SHORT`` of them make one micro-batch)."""

    def __iter__(self):
        step = 0
        while True:
            yield from samples(step)
            step += 1


class Collate:
    """DataCollatorWithFlattening over one item's samples, as the layout says; adds the
    truth's sample ids (popped before the model sees them) and, tagged, a per-token
    modality field."""

    def __init__(self, layout: str, tagged: bool):
        flash = layout == "flash"
        self.flat = DataCollatorWithFlattening(return_flash_attn_kwargs=flash, return_position_ids=not flash)
        self.layout, self.tagged = layout, tagged

    def __call__(self, items: list[dict]) -> dict:
        batch = self.flat([{"input_ids": x["input_ids"]} for x in items])
        lengths = [len(x["input_ids"]) for x in items]
        sid = torch.repeat_interleave(torch.arange(len(items)), torch.tensor(lengths))[None]
        mod = torch.repeat_interleave(torch.tensor([x["modality"] for x in items]), torch.tensor(lengths))[None]
        if self.layout == "ones":
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["truth_sid"] = sid
        batch["truth_mod"] = mod
        if self.tagged:
            batch["modality"] = mod.clone()
        return batch


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor, sid: torch.Tensor) -> torch.Tensor:
    """A mean over samples of each sample's mean label-token loss (the model's shift)."""
    target = labels[:, 1:].reshape(-1)
    tok = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target, reduction="none")
    lab = (target != -100).double()
    s = sid[:, :-1].reshape(-1)
    n = torch.zeros(int(sid.max()) + 1, dtype=torch.float64).index_add_(0, s, lab)
    per = torch.zeros_like(n).index_add_(0, s, tok.double() * lab)
    has = n > 0
    return (per[has] / n[has]).mean().float()


class Truth:
    """The true per-sample weights and the leak, per optimizer step (module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.steps: list[dict] = []
        self.sid: torch.Tensor | None = None
        self.mod: torch.Tensor | None = None
        self._first: dict | None = None
        self._leak: float | None = None
        self._micro: list[dict] = []
        self.labels: torch.Tensor | None = None
        self._first_sid: torch.Tensor | None = None
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.get_output_embeddings().register_forward_hook(self._logits)

    def _pre(self, module, args, kwargs):
        if torch.is_grad_enabled():
            if self._first is None:
                self._first = {k: v for k, v in kwargs.items() if k not in ("labels", "modality")}

    def _logits(self, module, args, output):
        if not output.requires_grad:
            return
        labels, sid, mod = self.labels, self.sid, self.mod
        z = output.detach()

        def grab(grad):
            w, lab = label_token_weights(grad, z, labels)
            s = sid.reshape(-1)
            count = int(s.max()) + 1
            w_s = torch.zeros(count, dtype=torch.float64).index_add_(0, s, w.reshape(-1))
            n_s = torch.zeros(count, dtype=torch.float64).index_add_(0, s, lab.reshape(-1).double())
            image = torch.zeros(count, dtype=torch.bool).index_put_((s,), mod.reshape(-1) == 1, accumulate=True)
            self._micro.append({"w": w_s, "n": n_s, "image": image})

        output.register_hook(grab)

    def before_optimizer_step(self) -> None:
        """The leak, measured on the step's first micro-batch with the weights it saw."""
        kw, self._first = self._first, None
        if kw is None:
            return
        ids = kw["input_ids"]
        sid = self._first_sid
        first = sid == 0
        new = (ids + 1) % VOCAB
        new = torch.where(new == IMAGE, (ids + 2) % VOCAB, new)  # never makes an image token
        changed = torch.where(first & (ids != IMAGE), new, ids)
        was = self.model.training
        self.model.eval()
        with torch.no_grad():
            a = self.model(**kw).logits.double()
            b = self.model(**{**kw, "input_ids": changed}).logits.double()
        self.model.train(was)
        self._leak = float((a - b).abs().amax(-1)[~first].max())

    def step_end(self, step: int) -> None:
        micro, self._micro = self._micro, []
        w = torch.cat([m["w"] for m in micro])
        n = torch.cat([m["n"] for m in micro])
        image = torch.cat([m["image"] for m in micro])
        keep = n > 0
        w, n, image = w[keep], n[keep], image[keep]
        grad_share = float(w[image].sum() / w.sum())
        sample_share = float(image.double().mean())
        x, y = n.log(), w.log()
        slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        self.steps.append(
            {
                "step": step,
                "grad_share": grad_share,
                "sample_share": sample_share,
                "token_share": float(n[image].sum() / n.sum()),
                "dilution": sample_share / grad_share,
                "exponent": slope,
                "samples": int(keep.sum()),
                "leak": self._leak,
            }
        )
        self._leak = None


class PackedTrainer(Trainer):
    """Pops the truth's fields before the model's forward; ``norm="sample"``: a mean of
    per-sample means instead of the model's per-token loss."""

    truth: Truth
    norm: str = "token"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        sid = inputs.pop("truth_sid")
        self.truth.sid, self.truth.mod = sid, inputs.pop("truth_mod")
        self.truth._first_sid, self.truth.labels = sid, inputs["labels"]
        if self.norm == "token":
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = per_sample_loss(outputs.logits, labels, sid)
        return (loss, outputs) if return_outputs else loss


class TruthCallback(TrainerCallback):
    def __init__(self, truth: Truth):
        self.truth = truth

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.truth.before_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        self.truth.step_end(state.global_step)


def _trainer(out_dir: str, layout: str, tagged: bool, norm: str, steps: int, every: int) -> dict:
    from trainvitals.hooks.transformers import TrainvitalsCallback

    model = tiny_llama()
    truth = Truth(model)
    options = {"modality_field": "modality"} if tagged else {}
    callback = TrainvitalsCallback(run="packed", every=every, modalities=("text", "image"), **options)
    args = trainer_arguments(
        TrainingArguments,
        out_dir,
        steps=steps,
        accum=1,
        remove_unused_columns=False,
        per_device_train_batch_size=TEXT + SHORT,
        # an iterable dataset's batches are otherwise dispatched, which slices every tensor
        # along its first dimension: cu_seq_lens [n + 1] to the batch's one row
        accelerator_config={"dispatch_batches": False},
    )
    job = PackedTrainer(
        model=model,
        args=args,
        train_dataset=Samples(),
        data_collator=Collate(layout, tagged),
        callbacks=[callback, TruthCallback(truth)],
    )
    job.truth, job.norm = truth, norm
    job.train()
    return {"truth": truth.steps, "reports": str(Path(out_dir) / "trainvitals-packed.jsonl")}


def _loop(out_dir: str, layout: str, tagged: bool, norm: str, steps: int, every: int, own: bool = True) -> dict:
    """The plain loop; ``own=False``: no attach of its own (``trainvitals run`` attaches)."""
    model = tiny_llama()
    truth = Truth(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reports = Path(out_dir) / "trainvitals-packed.jsonl"
    mon = None
    if own:
        from trainvitals.hooks import attach
        from trainvitals.hooks.sinks import FileSink

        mon = attach(model, opt, run="packed", sink=FileSink(str(reports)), every=every, modalities=("text", "image"))
    collate = Collate("positions", tagged)
    for step in range(1, steps + 1):
        batch = collate(samples(step - 1))
        sid = batch.pop("truth_sid")
        truth.sid, truth.mod, truth._first_sid = sid, batch.pop("truth_mod"), sid
        if tagged and mon is not None:
            mon.tag_batch(modality=batch.pop("modality"))
        labels = truth.labels = batch.pop("labels")
        out = model(**batch, labels=labels if norm == "token" else None, use_cache=layout == "loop")
        loss = out.loss if norm == "token" else per_sample_loss(out.logits, labels, sid)
        loss.backward()
        truth.before_optimizer_step()
        opt.step()
        opt.zero_grad()
        truth.step_end(step)
    if mon is not None:
        mon.close()
    return {"truth": truth.steps, "reports": str(reports)}


def train(
    out_dir: str,
    *,
    layout: str = "positions",
    tagged: int = 0,
    norm: str = "token",
    steps: int = 22,
    every: int = 1,
    own: int = 1,
) -> dict:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)
    if layout.startswith("loop"):
        return _loop(out_dir, layout, bool(tagged), norm, steps, every, bool(own))
    return _trainer(out_dir, layout, bool(tagged), norm, steps, every)


if __name__ == "__main__":
    out = sys.argv[1]
    result = train(**job_options(sys.argv[2:]))
    Path(out).write_text(json.dumps(result))
