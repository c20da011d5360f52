"""TRL's ``GRPOTrainer`` (its fused LM head: per-token log-probabilities, the ``lm_head``
module never called) with ``TrainvitalsCallback``, on the tiny Llama and word-level
tokenizer of ``_trl_job`` (no download) and a reward computed here, next to an
independent record of the per-token "weights" minus the gradient at the fused output's
log-probabilities: for a policy gradient they are weight x advantage, signed.
Run as a script: ``python _grpo_job.py OUT.json steps=N every=K``.
"""

from __future__ import annotations

import json
import logging
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
from transformers import LlamaForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tests.integrations._hf_models import VOCAB, job_options, trainer_arguments  # noqa: E402
from tests.integrations._trl_job import tiny_llama, tokenizer  # noqa: E402
from trainvitals.hooks.transformers import TrainvitalsCallback  # noqa: E402


def prompts(n: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = [" ".join(f"t{t}" for t in torch.randint(3, VOCAB, (4,), generator=g).tolist()) for _ in range(n)]
    return Dataset.from_dict({"prompt": rows})


def distinct_tokens(completions: list[str], **kwargs) -> list[float]:
    """The reward: distinct words in the completion (varies across a group's samples)."""
    return [float(len(set(c.split()))) for c in completions]


class Truth(TrainerCallback):
    """Per optimizer step: the sum of the fused output's per-token "weights" (minus the
    gradient at its log-probabilities, label tokens) and how many are negative."""

    def __init__(self, model: torch.nn.Module):
        self.steps: list[dict] = []
        self._micro: list[tuple[float, int]] = []
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
            self._micro.append((float(w.sum()), int((w < 0).sum())))

        log_probs.register_hook(grab)

    def on_step_end(self, args, state, control, **kwargs):
        micro, self._micro = self._micro, []
        self.steps.append(
            {
                "step": state.global_step,
                "mass": sum(m for m, _ in micro),
                "negative": sum(n for _, n in micro),
                "microbatches": len(micro),
            }
        )


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(out_dir: str, *, steps: int = 8, every: int = 2) -> dict:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)
    lines = Lines()
    logging.getLogger("trainvitals").addHandler(lines)
    logging.getLogger("trainvitals").setLevel(logging.INFO)
    net = tiny_llama(LlamaForCausalLM)
    callback = TrainvitalsCallback(run="grpo", every=every)
    args = trainer_arguments(
        GRPOConfig,
        out_dir,
        steps=steps,
        accum=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        bf16=False,
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=net,
        reward_funcs=distinct_tokens,
        args=args,
        train_dataset=prompts(steps * 4),
        processing_class=tokenizer(),
    )
    truth = Truth(trainer.model)
    trainer.add_callback(callback)
    trainer.add_callback(truth)
    trainer.train()
    return {
        "truth": truth.steps,
        "fused_forwards": truth.fused,
        "reports": str(Path(out_dir) / "trainvitals-grpo.jsonl"),
        "log": lines.lines,
    }


if __name__ == "__main__":
    options = job_options(sys.argv[2:])
    result = train(str(Path(sys.argv[1]).resolve().parent / "run-grpo"), **options)
    Path(sys.argv[1]).write_text(json.dumps(result))
