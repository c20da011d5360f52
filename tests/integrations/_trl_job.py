"""TRL's ``SFTTrainer`` on its default path (a fused LM head: ``lm_head.weight`` used inside
a chunked log-prob function, the ``lm_head`` module never called) with
``TrainvitalsCallback``, on a tiny Llama built from a config and a word-level tokenizer
built here (no download), next to an independent record of the true per-token weights.
Run as a script: ``python _trl_job.py OUT.json models=default,mean-of-means steps=N``.

The truth: TRL's loss is ``-sum_t w_t log p_t`` over the fused output's ``log_probs``;
a forward hook on the model keeps that tensor and its label mask, and autograd's
gradient at it is ``-w_t`` for every label token, summed per optimizer step.
``model=mean-of-means``: a model class with ``accepts_loss_kwargs = False``, so the
Trainer passes no ``num_items_in_batch``: each micro-batch is averaged over its own
tokens and divided by the accumulation steps (a mean of means).
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
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from tests.integrations._hf_models import VOCAB, job_options, tiny_llama_config, trainer_arguments  # noqa: E402
from trainvitals.hooks.transformers import TrainvitalsCallback  # noqa: E402

LENGTHS = (6, 30, 12, 24)


class MeanOfMeansLlama(LlamaForCausalLM):
    """A model class that declares it takes no loss kwargs (as some custom heads do)."""

    accepts_loss_kwargs = False


def tiny_llama(cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(tiny_llama_config(pad_token_id=0, bos_token_id=1, eos_token_id=2))


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def dataset(n: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, VOCAB, (LENGTHS[i % len(LENGTHS)],), generator=g).tolist() for i in range(n)]
    return Dataset.from_dict({"input_ids": rows})


class Truth(TrainerCallback):
    """The true weights per optimizer step (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.steps: list[dict] = []
        self._micro: list[dict] = []
        self.fused = 0
        model.register_forward_hook(self._output)

    def _output(self, module, args, output):
        log_probs = getattr(output, "log_probs", None)
        if log_probs is None or not log_probs.requires_grad:
            return
        self.fused += 1
        lab = output.label_mask.detach()

        def grab(grad):
            w = -grad.detach().double()[lab]
            self._micro.append({"mass": float(w.sum()), "wmax": float(w.max()), "wmin": float(w.min())})

        log_probs.register_hook(grab)

    def on_step_end(self, args, state, control, **kwargs):
        micro, self._micro = self._micro, []
        uniform = all(m["wmax"] <= m["wmin"] * (1 + 1e-3) for m in micro)
        self.steps.append(
            {
                "step": state.global_step,
                "mass": sum(m["mass"] for m in micro),
                "microbatches": len(micro),
                "spread": max(m["wmax"] for m in micro) / min(m["wmin"] for m in micro) if uniform else None,
            }
        )


def train(out_dir: str, *, model: str = "default", steps: int = 24, every: int = 4, accum: int = 4) -> dict:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)
    net = tiny_llama(MeanOfMeansLlama if model == "mean-of-means" else LlamaForCausalLM)
    callback = TrainvitalsCallback(run="sft", every=every)
    args = trainer_arguments(SFTConfig, out_dir, steps=steps, accum=accum, bf16=False, gradient_checkpointing=False)
    trainer = SFTTrainer(model=net, args=args, train_dataset=dataset(steps * accum), processing_class=tokenizer())
    truth = Truth(trainer.model)
    trainer.add_callback(callback)
    trainer.add_callback(truth)
    trainer.train()
    return {
        "truth": truth.steps,
        "fused_forwards": truth.fused,
        "reports": str(Path(out_dir) / "trainvitals-sft.jsonl"),
    }


if __name__ == "__main__":
    # models=A,B: each trained in turn in this one process (one import of TRL for both),
    # in a folder of its own; the result is {model: its result}.
    options = job_options(sys.argv[2:])
    names = str(options.pop("models")).split(",")
    parent = Path(sys.argv[1]).resolve().parent
    results = {m: train(str(parent / f"run-{m}"), model=m, **options) for m in names}
    Path(sys.argv[1]).write_text(json.dumps(results))
