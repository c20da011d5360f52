"""TRL's ``DPOTrainer`` with ``TrainvitalsCallback`` on the tiny Llama and word-level
tokenizer of ``_trl_job`` (no download; the reference model is a second tiny Llama).
A preference loss: its per-token gradients are log-ratio terms of a chosen and a rejected
sequence, never a cross-entropy's normalization weights.
Run as a script: ``python _dpo_job.py OUT.json steps=N every=K``.
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
from transformers import LlamaForCausalLM  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from tests.integrations._grpo_job import Lines  # noqa: E402
from tests.integrations._hf_models import VOCAB, job_options, trainer_arguments  # noqa: E402
from tests.integrations._trl_job import tiny_llama, tokenizer  # noqa: E402
from trainvitals.hooks.transformers import TrainvitalsCallback  # noqa: E402


def pairs(n: int) -> Dataset:
    g = torch.Generator().manual_seed(0)

    def words(k: int) -> str:
        return " ".join(f"t{t}" for t in torch.randint(3, VOCAB, (k,), generator=g).tolist())

    return Dataset.from_dict(
        {
            "prompt": [words(4) for _ in range(n)],
            "chosen": [words(3 + i % 4) for i in range(n)],
            "rejected": [words(2 + i % 5) for i in range(n)],
        }
    )


def train(out_dir: str, *, steps: int = 8, every: int = 2) -> dict:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    lines = Lines()
    logging.getLogger("trainvitals").addHandler(lines)
    logging.getLogger("trainvitals").setLevel(logging.INFO)
    args = trainer_arguments(
        DPOConfig, out_dir, steps=steps, accum=2, per_device_train_batch_size=2, bf16=False, max_length=32
    )
    trainer = DPOTrainer(
        model=tiny_llama(LlamaForCausalLM),
        ref_model=tiny_llama(LlamaForCausalLM),
        args=args,
        train_dataset=pairs(steps * 4),
        processing_class=tokenizer(),
        callbacks=[TrainvitalsCallback(run="dpo", every=every)],
    )
    trainer.train()
    return {"reports": str(Path.cwd() / "trainvitals-dpo.jsonl"), "log": lines.lines}


if __name__ == "__main__":
    options = job_options(sys.argv[2:])
    result = train(str(Path(sys.argv[1]).resolve().parent / "run-dpo"), **options)
    Path(sys.argv[1]).write_text(json.dumps(result))
