"""A tiny Llama (built from a config, no download) trained by the Hugging Face Trainer
with ``TrainvitalsCallback``, next to an independent record of the true per-token
loss weights. Run as a script (``python _hf_job.py OUT.json KEY=VALUE ...``) it runs
under whatever ``transformers`` the path holds: the old-release test points
PYTHONPATH at a pre-#34191 release; the DDP test starts it once per rank.

The truth: a forward pre-hook keeps each micro-batch's labels and modality codes, a
forward hook on the LM head a tensor hook on the logits; from the gradient g and the
logits z (float64) each label token's weight is ``w_t = -g_{t,y_t} / (1 - p_{t,y_t})``
with ``y_t`` the next token's label (the model's shift), summed per optimizer step.
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
if os.environ.get("TV_HIDE_DATASETS"):
    # The old release imports `datasets` where it is installed (TRL's tests install a current
    # one), and a current `datasets` needs a newer huggingface_hub than the old folder holds:
    # the old release then sees no `datasets` (find_spec answers None for a None entry).
    sys.modules["datasets"] = None

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from tests.integrations._hf_models import VOCAB, job_options, label_token_weights, tiny_llama_config, trainer_arguments
from trainvitals.hooks.transformers import TrainvitalsCallback

LENGTHS = (6, 30, 12, 24)  # one sample per micro-batch, in this order: token counts differ


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config())


class Samples(torch.utils.data.IterableDataset):
    """Samples of LENGTHS lengths in a fixed cycle (an iterable dataset: the Trainer does
    not shuffle it), modality 1 ("image") for the short ones; ``rank`` offsets the cycle."""

    def __init__(self, rank: int = 0):
        self.rank = rank

    def __iter__(self):
        g = torch.Generator().manual_seed(self.rank)
        i = self.rank
        while True:
            n = LENGTHS[i % len(LENGTHS)]
            ids = torch.randint(0, VOCAB, (n,), generator=g)
            yield {"input_ids": ids, "labels": ids.clone(), "modality": int(n < 20)}
            i += 1


def collate(items: list[dict]) -> dict:
    width = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), -100)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, x in enumerate(items):
        n = len(x["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = x["input_ids"], x["labels"], 1
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "modality": torch.tensor([x["modality"] for x in items]),
    }


class Truth(TrainerCallback):
    """The true weights, per optimizer step (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.steps: list[dict] = []
        self._micro: list[dict] = []
        self._inputs: dict = {}
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.get_output_embeddings().register_forward_hook(self._logits)

    def _pre(self, module, args, kwargs):
        self._inputs = {"labels": kwargs.get("labels"), "modality": kwargs.get("modality")}

    def _logits(self, module, args, output):
        if not output.requires_grad:
            return
        labels, modality = self._inputs["labels"], self._inputs["modality"]
        z = output.detach()

        def grab(grad):
            w, lab = label_token_weights(grad, z, labels)
            per_mod = [float(w[modality == m].sum()) for m in (0, 1)]
            self._micro.append(
                {
                    "mass": float(w.sum()),
                    "wmax": float(w[lab].max()),
                    "wmin": float(w[lab].min()),
                    "per_modality": per_mod,
                }
            )

        output.register_hook(grab)

    def on_step_end(self, args, state, control, **kwargs):
        micro, self._micro = self._micro, []
        mass = sum(m["mass"] for m in micro)
        per_mod = [sum(m["per_modality"][k] for m in micro) for k in (0, 1)]
        uniform = all(m["wmax"] <= m["wmin"] * (1 + 1e-3) for m in micro)
        spread = max(m["wmax"] for m in micro) / min(m["wmin"] for m in micro)
        self.steps.append(
            {
                "step": state.global_step,
                "mass": mass,
                "microbatches": len(micro),
                "spread": spread if uniform else None,
                "grad_share": [x / sum(per_mod) for x in per_mod],
            }
        )


class ForgetfulTrainer(Trainer):
    """A hand-written compute_loss that returns the micro-batch mean and ignores
    num_items_in_batch: the Trainer, told the model takes loss kwargs, then assumes the
    loss is already scaled for gradient accumulation and does not divide it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), inputs["labels"][:, 1:].reshape(-1), ignore_index=-100)
        return (loss, outputs) if return_outputs else loss


def _ddp_args() -> dict:
    """gloo on the CPU; each rank reads its own samples (the iterable dataset is not
    dispatched from rank 0, whose samples differ in length)."""
    return {"ddp_backend": "gloo", "accelerator_config": {"dispatch_batches": False}}


def train(
    out_dir: str,
    *,
    steps: int = 6,
    every: int = 1,
    accum: int = 4,
    trainer: str = "default",
    save_steps: int = 0,
    resume: int = 0,
    rank: int = 0,
) -> dict:
    """Train in ``out_dir`` (the working folder too: the callback's default sink writes
    ``./trainvitals-hf.jsonl`` there). Returns the truth per step and what the callback saw."""
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)
    model = tiny_llama()
    truth = Truth(model)
    callback = TrainvitalsCallback(run="hf", every=every, modalities=("text", "image"), modality_field="modality")
    args = trainer_arguments(
        TrainingArguments,
        out_dir,
        steps=steps,
        accum=accum,
        label_names=["labels", "modality"],  # keeps the modality field through the column pruning
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        **(_ddp_args() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}),
    )
    cls = ForgetfulTrainer if trainer == "forgetful" else Trainer
    job = cls(model=model, args=args, train_dataset=Samples(rank), data_collator=collate, callbacks=[callback, truth])
    job.train(resume_from_checkpoint=True if resume else None)
    mon = callback.monitor
    return {
        "version": transformers.__version__,
        "truth": truth.steps,
        "step": mon.step,
        "reports": str(Path(out_dir) / "trainvitals-hf.jsonl"),
        "state_files": sorted(
            str(p.relative_to(out_dir)) for p in Path(out_dir).glob("checkpoint-*/trainvitals-rank*.pt")
        ),
    }


if __name__ == "__main__":
    out = sys.argv[1]
    result = train(**job_options(sys.argv[2:]))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(result))
