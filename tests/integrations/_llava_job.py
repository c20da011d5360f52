"""A tiny LLaVA (``LlavaForConditionalGeneration`` from tiny configs, no download) trained by
the Hugging Face Trainer with ``TrainvitalsCallback()`` and no modality field: the model's
config names its image token, so a sample whose input ids hold it is an image sample.
Run as a script: ``python _llava_job.py OUT.json answer=N steps=N``.

One sample per micro-batch, image and text samples alternating: an image sample is its 4
image tokens, a prompt and an answer of ``answer`` tokens (only the answer is trained on);
a text sample is 30 trained tokens. The Trainer normalizes over the step's label tokens
(per token), so short image answers get little of the gradient (I1).

The truth, independent of the input ids: a micro-batch with ``pixel_values`` is an image
sample; each label token's weight ``w_t = -g_{t,y_t} / (1 - p_{t,y_t})`` from the gradient
at the logits (float64), summed per modality and step.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.simplefilter("ignore")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from tests.integrations._hf_models import (  # noqa: E402
    IMAGE,
    PATCHES,
    job_options,
    label_token_weights,
    tiny_llava,
    trainer_arguments,
)
from trainvitals.hooks.transformers import TrainvitalsCallback  # noqa: E402


class Samples(torch.utils.data.IterableDataset):
    def __init__(self, answer: int):
        self.answer = answer

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        i = 0
        while True:
            if i % 2 == 0:  # an image sample: image tokens, a prompt, a short answer
                prompt = torch.randint(3, IMAGE, (6,), generator=g)
                answer = torch.randint(3, IMAGE, (self.answer,), generator=g)
                ids = torch.cat([torch.tensor([1]), torch.full((PATCHES,), IMAGE), prompt, answer])
                labels = torch.full_like(ids, -100)
                labels[-self.answer - 1 :] = ids[-self.answer - 1 :]
                yield {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(3, 8, 8, generator=g)}
            else:
                ids = torch.randint(3, IMAGE, (30,), generator=g)
                yield {"input_ids": ids, "labels": ids.clone()}
            i += 1


def collate(items: list[dict]) -> dict:
    (x,) = items
    batch = {"input_ids": x["input_ids"][None], "labels": x["labels"][None]}
    if "pixel_values" in x:
        batch["pixel_values"] = x["pixel_values"][None]
    return batch


class Truth(TrainerCallback):
    def __init__(self, model: torch.nn.Module):
        self.steps: list[dict] = []
        self._micro: list[dict] = []
        self._inputs: dict = {}
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.get_output_embeddings().register_forward_hook(self._logits)

    def _pre(self, module, args, kwargs):
        self._inputs = {"labels": kwargs.get("labels"), "image": kwargs.get("pixel_values") is not None}

    def _logits(self, module, args, output):
        if not output.requires_grad:
            return
        labels, image = self._inputs["labels"], self._inputs["image"]
        z = output.detach()

        def grab(grad):
            w, _ = label_token_weights(grad, z, labels)
            self._micro.append({"mass": float(w.sum()), "image": image})

        output.register_hook(grab)

    def on_step_end(self, args, state, control, **kwargs):
        micro, self._micro = self._micro, []
        image = sum(m["mass"] for m in micro if m["image"])
        total = sum(m["mass"] for m in micro)
        self.steps.append(
            {
                "step": state.global_step,
                "mass": total,
                "image_samples": sum(m["image"] for m in micro) / len(micro),
                "image_grad_share": image / total,
            }
        )


def train(out_dir: str, *, answer: int = 1, steps: int = 24, every: int = 1, accum: int = 4) -> dict:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)
    model = tiny_llava()
    truth = Truth(model)
    callback = TrainvitalsCallback(run="llava", every=every)  # no modalities, no modality field
    args = trainer_arguments(TrainingArguments, out_dir, steps=steps, accum=accum, remove_unused_columns=False)
    job = Trainer(
        model=model, args=args, train_dataset=Samples(answer), data_collator=collate, callbacks=[callback, truth]
    )
    job.train()
    return {
        "truth": truth.steps,
        "modalities": list(callback.monitor.modalities),
        "reports": str(Path(out_dir) / "trainvitals-llava.jsonl"),
    }


if __name__ == "__main__":
    options = job_options(sys.argv[2:])
    Path(sys.argv[1]).write_text(json.dumps(train(str(Path(sys.argv[1]).parent / "run"), **options)))
