"""TRL's ``GRPOTrainer`` (one ``loss_type``), ``RLOOTrainer`` or the write-up's DAPO (a
``GRPOTrainer`` subclass with its own ``compute_loss``, a micro-batch token mean, its
division by the accumulation steps missing or, ``variant=fixed``, there), on the tiny
Llama and word-level tokenizer of ``_trl_job`` (no download), with gradient accumulation.

Next to it, an independent truth from the job's own backward: the gradient at the
trainer's per-token log-probabilities (the fused head's output), divided by the
advantage of the completion and by the objective's slope at ratio 1 (on-policy, one
iteration: every stock objective's per-token loss moves as ``-advantage x log p``, so
the gradient there is ``-w x advantage``). That is ``dL / dl`` for TRL's per-token (per
sequence for RLOO) loss tensor, the normalization weight. The reward is a pseudo-random
number per completion, so no advantage is zero. Per optimizer step: the weight mass,
each micro-batch's smallest and largest per-token weight and its per-sequence weights.

Run as a script: ``python _rl_job.py OUT.json trainer=grpo loss_type=dapo variant=stock
steps=N accum=4 every=K callback=1 [collector=URL] [reward=flat]``; ``callback=0`` runs without
``TrainvitalsCallback`` (for ``trainvitals run`` / ``check``).
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
from transformers import LlamaForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from tests.integrations._grpo_job import prompts  # noqa: E402
from tests.integrations._hf_models import job_options, trainer_arguments  # noqa: E402
from tests.integrations._trl_job import tiny_llama, tokenizer  # noqa: E402

EPS_HIGH = 5.0  # cispo clamps the ratio at epsilon_high: above 1, the slope at ratio 1 is 1


class WriteupDAPO(GRPOTrainer):
    """The write-up's DAPO: its own ``compute_loss``, the micro-batch's token mean of the
    clipped-ratio policy loss, returned without ``/ gradient_accumulation_steps``."""

    fixed = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, completion_ids.size(1))
        advantages = inputs["advantages"].unsqueeze(1)
        ratio = torch.exp(logps - logps.detach())
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
        if self.fixed:
            loss = loss / self.current_gradient_accumulation_steps  # the write-up's fix
        return loss


class FixedDAPO(WriteupDAPO):
    fixed = True


def random_reward(completions: list[str], **kwargs) -> list[float]:
    """A pseudo-random number per completion: a group's advantages are never zero."""
    random_reward.calls += 1  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(1000 + random_reward.calls)  # type: ignore[attr-defined]
    return torch.rand(len(completions), generator=g).tolist()


random_reward.calls = 0  # type: ignore[attr-defined]


def flat_reward(completions: list[str], **kwargs) -> list[float]:
    """The same reward for every completion: every advantage is zero, none negative."""
    return [1.0] * len(completions)


class Truth(TrainerCallback):
    """The normalization weights from the gradient at the per-token log-probabilities
    (see the module docstring), per optimizer step."""

    def __init__(self, trainer, slope: float, per_sequence: bool = False) -> None:
        self.steps: list[dict] = []
        self._micro: list[dict] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.slope = slope
        self.per_sequence = per_sequence  # RLOO: one loss per sequence, the sum of its log-probabilities
        self.min_abs_advantage = float("inf")
        inner = trainer.compute_loss  # the instance's: TrainvitalsCallback wraps it later

        def compute_loss(model, inputs, *args, **kwargs):
            if model.training and torch.is_grad_enabled():  # references only: no op on them
                self._pending.append((inputs["advantages"], inputs["completion_mask"]))
            return inner(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss
        trainer.model.register_forward_hook(self._output)

    def _output(self, module, args, output):
        log_probs = getattr(output, "log_probs", None)
        if log_probs is None or not log_probs.requires_grad or not self._pending:
            return
        advantages, mask = self._pending.pop(0)

        def grab(grad):
            a = advantages.detach().double().reshape(-1, 1)
            m = mask.detach().bool()
            g = grad.detach().double()[:, -m.shape[1] :]
            w = (-g / (a * self.slope)) * m  # dL/dl per label token
            self.min_abs_advantage = min(self.min_abs_advantage, float(a.abs().min()))
            if self.per_sequence:  # each of a sequence's tokens carries the sequence's dL/dl
                w = w.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
                m = m.any(dim=1, keepdim=True)
            tokens = w[m]
            self._micro.append(
                {
                    "mass": float(tokens.sum()),
                    "wmin": float(tokens.min()),
                    "wmax": float(tokens.max()),
                    "tokens": int(m.sum()),
                    "sequence": w.sum(dim=1).tolist(),
                    "lengths": m.sum(dim=1).tolist(),
                }
            )

        log_probs.register_hook(grab)

    def on_step_end(self, args, state, control, **kwargs):
        micro, self._micro = self._micro, []
        self.steps.append({"step": state.global_step, "mass": sum(m["mass"] for m in micro), "micro": micro})


def train(
    out_dir: str,
    *,
    trainer: str = "grpo",
    loss_type: str = "grpo",
    variant: str = "stock",
    steps: int = 25,
    accum: int = 4,
    every: int = 4,
    callback: int = 1,
    collector: str = "",
    reward: str = "random",
) -> dict:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)  # the reports go to the working folder (trainvitals check reads them there)
    net = tiny_llama(LlamaForCausalLM)
    common = dict(
        steps=steps,
        accum=accum,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        bf16=False,
        gradient_checkpointing=False,
    )
    if trainer == "rloo":
        args = trainer_arguments(RLOOConfig, out_dir, **common, beta=0.0)  # no reference model to load
        cls: type = RLOOTrainer
    else:
        extra = {"loss_type": loss_type, "epsilon_high": EPS_HIGH if loss_type == "cispo" else None}
        if loss_type == "luspo":
            extra["importance_sampling_level"] = "sequence"
        args = trainer_arguments(GRPOConfig, out_dir, **common, **extra)
        cls = {"stock": GRPOTrainer, "bug": WriteupDAPO, "fixed": FixedDAPO}[variant]
    job = cls(
        model=net,
        reward_funcs=flat_reward if reward == "flat" else random_reward,
        args=args,
        train_dataset=prompts(steps * accum * 4),
        processing_class=tokenizer(),
    )
    truth = Truth(job, 1.0, per_sequence=trainer == "rloo")
    if callback:
        from trainvitals.hooks.transformers import TrainvitalsCallback

        job.add_callback(TrainvitalsCallback(run="rl", every=every, collector=collector or None))
    job.add_callback(truth)
    job.train()
    return {
        "truth": truth.steps,
        "min_abs_advantage": truth.min_abs_advantage,
        "reports": str(Path.cwd() / "trainvitals-rl.jsonl"),
    }


if __name__ == "__main__":
    options = job_options(sys.argv[2:])
    result = train(str(Path(sys.argv[1]).resolve().parent / "run-rl"), **options)
    Path(sys.argv[1]).write_text(json.dumps(result))
