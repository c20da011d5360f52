"""TRL's distillation trainers (``DistillationTrainer``, ``GKDTrainer``) with
``TrainvitalsCallback`` and no other trainvitals code, on tiny Llamas built here (no
download): a student, and a teacher whose ``lm_head`` is made sharp (``teacher=sharp``:
near one-hot at temperature 1, I5) or left as built (``teacher=soft``). Run as a script:
``python _distill_job.py OUT.json jobs=TRAINER:TEACHER:TAU,... steps=N every=K
[collector=URL] [callback=0]`` (``callback=0``: no trainvitals code at all, for
``trainvitals run`` / ``check -- CMD``).

The truth, independent of the monitor's rows, projections and gradient masks: per
micro-batch of a reported step, the full logits of both models over the positions the
loss counts, float64, pooled over the step, and every I5 figure computed from them in
plain torch (``i5_truth``). ``DistillationTrainer``: the inputs its ``_prepare_inputs``
hands to the loss, run through both whole models (``.logits``, the models' own
``lm_head``; the loss's positions: the last ``K`` of ``[:, :-1]``, its completion
mask). ``GKDTrainer``: the logits both models returned in the micro-batch's forward
(forward hooks kept here) and the labels the loss masks with, read after its
``training_step`` (on-policy generation replaces them in place). The subclasses
override neither trainer's loss.
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
from tokenizers.pre_tokenizers import WhitespaceSplit  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from trl import DistillationConfig, DistillationTrainer  # noqa: E402
from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402

from tests.integrations._hf_models import VOCAB, job_options, trainer_arguments  # noqa: E402
from tests.integrations._trl_job import tiny_llama, tokenizer  # noqa: E402
from trainvitals.hooks.transformers import TrainvitalsCallback  # noqa: E402

SPREAD = 18.0  # the sharp teacher's lm_head weight scale: logits ~2 nats apart, not ~0.1
MARGIN = 14.0  # and its bias on one token: top-1 above 0.999 at temperature 1, ~0.08 at 8
TARGET = 0.7  # softmax_target's default: the recommended temperature brings the mean top-1 here


def models(teacher: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The student, and the teacher: built from another seed; ``sharp``: its ``lm_head``
    replaced by one with the weight scaled by ``SPREAD`` and a bias of ``MARGIN`` on one
    token (a near one-hot teacher, the kind I5 is about)."""
    student = tiny_llama(LlamaForCausalLM)
    torch.manual_seed(1)
    master = LlamaForCausalLM(student.config)
    if teacher == "sharp":
        head = torch.nn.Linear(master.config.hidden_size, VOCAB, bias=True)
        with torch.no_grad():
            head.weight.copy_(master.lm_head.weight * SPREAD)
            head.bias.zero_()
            head.bias[7] = MARGIN
        master.lm_head = head
    return student, master


def word_tokenizer():
    tok = tokenizer()
    tok.backend_tokenizer.pre_tokenizer = WhitespaceSplit()  # one token per word
    tok.padding_side = "left"
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"t{t}" for t in torch.randint(3, VOCAB, (n,), generator=g).tolist())


def prompts(n: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"prompt": [words(g, 3 + i % 3) for i in range(n)]})


def conversations(n: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = [
        [{"role": "user", "content": words(g, 3 + i % 3)}, {"role": "assistant", "content": words(g, 4 + i % 4)}]
        for i in range(n)
    ]
    return Dataset.from_dict({"messages": rows})


# -- the truth -----------------------------------------------------------------------------------
def recommended(z: torch.Tensor, target: float = TARGET) -> float:
    """The temperature whose mean top-1 over the rows of raw logits ``z`` is ``target``
    (bisection in log T on [1, 64]); 1 when already at or below it at T = 1."""

    def top1(t: float) -> float:
        return float(torch.softmax(z / t, -1).amax(-1).mean())

    if top1(1.0) <= target:
        return 1.0
    lo, hi = 0.0, 6.0  # log2 T
    if top1(2**hi) > target:
        return 2**hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if top1(2**mid) > target else (lo, mid)
    return 2 ** ((lo + hi) / 2)


def i5_truth(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> dict:
    """Every I5 figure of the counted positions' raw logits ``[N, V]`` at ``tau``."""
    out: dict = {"positions": int(student.shape[0])}
    probs = {}
    for role, z in (("student", student), ("teacher", teacher)):
        p = torch.softmax(z / tau, -1)
        probs[role] = p
        q = p.amax(-1)
        out[role] = {
            "top1": float(q.mean()),
            "sat99": float((q > 0.99).double().mean()),
            "sat999": float((q > 0.999).double().mean()),
            "jacobian": float((q * (1 - q)).mean()),
            "entropy": float(-(p * p.clamp_min(1e-300).log()).sum(-1).mean()),
            "recommended": recommended(z),
        }
    ps, pt = probs["student"], probs["teacher"]
    top = pt.argmax(-1, keepdim=True)
    raise_top = (pt.gather(-1, top) - ps.gather(-1, top)).clamp_min(0).sum()
    raise_all = ((ps - pt).abs().sum(-1) / 2).sum()
    out["share"] = float(raise_top / raise_all)
    out["dark"] = float((1 - pt.amax(-1)).mean())
    return out


class Truth:
    """Counted positions' logits per reported step, pooled over its micro-batches."""

    def __init__(self, every: int, tau: float):
        self.every, self.tau = every, tau
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def micro(self, step: int, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> None:
        if step == 1 or step % self.every == 0:
            m = mask.bool()
            self.rows.setdefault(step, []).append((student[m].double(), teacher[m].double()))

    def figures(self) -> dict[int, dict]:
        return {
            step: i5_truth(torch.cat([s for s, _ in parts]), torch.cat([t for _, t in parts]), self.tau)
            for step, parts in self.rows.items()
        }


class RecordedDistillation(DistillationTrainer):
    """``DistillationTrainer`` as is, plus the truth from the inputs it hands its loss."""

    truth: Truth

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            k = inputs["completion_ids"].size(1)
            with torch.no_grad():
                zs = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1][:, -k:]
                zt = self.teacher_model(input_ids=ids, attention_mask=mask).logits[:, :-1][:, -k:]
            counted = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            self.truth.micro(self.state.global_step + 1, zs, zt, counted)
        return inputs


class RecordedGKD(GKDTrainer):
    """``GKDTrainer`` as is, plus the truth from the logits of the micro-batch's forwards
    and the labels its loss masks with."""

    truth: Truth

    def keep_outputs(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}

        def keep(role):
            def hook(module, args, output):
                if role == "teacher" or torch.is_grad_enabled():
                    self._kept[role] = output.logits.detach()

            return hook

        self.model.register_forward_hook(keep("student"))
        self.teacher_model.register_forward_hook(keep("teacher"))

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        counted = inputs["labels"][:, 1:] != -100
        self.truth.micro(
            self.state.global_step + 1, self._kept["student"][:, :-1], self._kept["teacher"][:, :-1], counted
        )
        return loss


class OwnTemperatureGKD(RecordedGKD):
    """A user's GKD trainer whose ``compute_loss`` passes ``GKDConfig.temperature`` to the
    loss (what TRL 1.16's does not): the loss's temperature is then the job's code's."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        student = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        with torch.no_grad():
            teacher = self.teacher_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        loss = self.generalized_jsd_loss(
            student_logits=student.logits[:, :-1],
            teacher_logits=teacher.logits[:, :-1],
            labels=inputs["labels"][:, 1:],
            beta=self.beta,
            temperature=self.temperature,
            num_items_in_batch=num_items_in_batch,
        )
        return (loss, student) if return_outputs else loss


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(
    out_dir: str,
    *,
    trainer: str = "distill",
    teacher: str = "sharp",
    tau: int = 1,
    steps: int = 60,
    every: int = 5,
    accum: int = 2,
    collector: str | None = None,
    run: str | None = None,
    callback: int = 1,
) -> dict:
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)
    lines = Lines()
    logging.getLogger("trainvitals").addHandler(lines)
    logging.getLogger("trainvitals").setLevel(logging.INFO)
    run = run or f"{trainer}-{teacher}-tau{tau}"
    student, master = models(teacher)
    common = {"per_device_train_batch_size": 4, "bf16": False, "gradient_checkpointing": False}
    common["temperature"] = float(tau)
    if trainer == "distill":
        args = trainer_arguments(
            DistillationConfig, out_dir, steps=steps, accum=accum, max_completion_length=8, **common
        )
        job = RecordedDistillation(
            model=student,
            teacher_model=master,
            args=args,
            train_dataset=prompts(steps * accum * 4),
            processing_class=word_tokenizer(),
        )
    else:
        args = trainer_arguments(
            GKDConfig, out_dir, steps=steps, accum=accum, max_new_tokens=6, max_length=32, **common
        )
        job = (OwnTemperatureGKD if trainer == "gkd-own" else RecordedGKD)(
            model=student,
            teacher_model=master,
            args=args,
            train_dataset=conversations(steps * accum * 4),
            processing_class=word_tokenizer(),
        )
        job.keep_outputs()
    loss_tau = float(tau) if trainer == "distill" else 1.0  # GKDTrainer's loss ignores its temperature
    job.truth = Truth(every, loss_tau)
    watcher = TrainvitalsCallback(run=run, every=every, collector=collector) if callback else None
    if watcher is not None:  # callback=0: nothing of trainvitals in the job (trainvitals run / check -- CMD)
        job.add_callback(watcher)
    try:
        job.train()
    finally:
        logging.getLogger("trainvitals").removeHandler(lines)
    watch = getattr(watcher, "_distill", None)
    return {
        "truth": job.truth.figures(),
        "loss_tau": loss_tau,
        "observed": watch.observed if watch is not None else 0,
        "reports": str(Path(out_dir) / f"trainvitals-{run}.jsonl"),
        "run": run,
        "log": lines.lines,
    }


if __name__ == "__main__":
    # jobs=A,B,...: each a `trainer:teacher:tau` trained in turn in this one process (one
    # import of TRL), in a folder of its own; the result is {job: its result}.
    options = job_options(sys.argv[2:])
    names = str(options.pop("jobs")).split(",")
    parent = Path(sys.argv[1]).resolve().parent
    results = {}
    for name in names:
        kind, teacher, tau = name.split(":")
        results[name] = train(
            str(parent / f"run-{kind}-{teacher}-{tau}"), trainer=kind, teacher=teacher, tau=int(tau), **options
        )
    Path(sys.argv[1]).write_text(json.dumps(results))
