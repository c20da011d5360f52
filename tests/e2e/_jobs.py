"""Tiny CPU training jobs for the end-to-end alert tests.

Each job reproduces one incident of docs/incidents.md (``fixed=False``) or is its
healthy twin: the same job with the fix (``fixed=True``). Models have a few
hundred parameters, steps a few hundred label tokens, so a step takes
milliseconds and a job of 60 steps reporting every step (``every=1``) about a
second. A job owns its model, optimizer and data generator; ``attach`` hooks it
to a collector and ``train`` runs optimizer steps, so a test can flip
``fixed`` between phases of one run.

What each job makes the signals read is in its docstring; the rules and their
thresholds are in ``alerts/rules/*.yaml``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import Monitor, attach

VOCAB, DIM = 32, 16


class TinyLM(nn.Module):
    """Embedding -> [x scale] -> RMSNorm -> Linear with bias: two matrices and 1D
    parameters with a real gradient (the norm's weight, the head's bias).

    ``input_scale``: a learnable scalar in front of the RMSNorm. The norm divides it
    out, so its true gradient is zero up to rounding: the I4 parameter.
    """

    def __init__(self, *, seed: int = 0, input_scale: float | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.scale = nn.Parameter(torch.tensor(float(input_scale))) if input_scale is not None else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.scale is not None:
            h = h * self.scale
        return self.head(self.norm(h))


def token_batch(
    gen: torch.Generator, lengths: list[int], *, noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of random tokens, left-aligned label tokens of the given ``lengths``.

    Labels follow a learnable mapping, except a ``noise`` share of them drawn at
    random: with noise the best model stays unsure (a soft softmax).
    """
    width = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=gen)
    labels = (ids * 7 + 3) % VOCAB
    if noise:
        flip = torch.rand(ids.shape, generator=gen) < noise
        labels = torch.where(flip, torch.randint(0, VOCAB, ids.shape, generator=gen), labels)
    mask = torch.arange(width) < torch.tensor(lengths)[:, None]
    return ids, labels, mask


def per_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def sample_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample mean loss over its label tokens: [B]."""
    return (per_token * mask).sum(1) / mask.sum(1)


class Job:
    """A model, its optimizer, a data stream; one ``step`` is one optimizer step."""

    modalities: tuple[str, ...] = ("text",)

    def __init__(self, *, fixed: bool = False, seed: int = 0):
        self.fixed = fixed
        self.gen = torch.Generator().manual_seed(seed)
        self.model = self.make_model(seed)
        self.opt = self.make_optimizer()
        self.steps = 0  # optimizer steps taken

    def make_model(self, seed: int) -> nn.Module:
        return TinyLM(seed=seed)

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)

    def attach(self, url: str, run: str, **options: Any) -> Monitor:
        """Stream this job's reports to the collector at ``url``, every optimizer step."""
        options.setdefault("every", 1)
        return attach(self.model, self.opt, run=run, collector=url, modalities=self.modalities, **options)

    def train(self, mon: Monitor, steps: int) -> None:
        for _ in range(steps):
            self.step(mon)
            self.steps += 1

    def step(self, mon: Monitor) -> None:
        raise NotImplementedError

    def finish_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def run_job(job: Job, url: str, run: str, steps: int, **options: Any) -> list[dict[str, Any]]:
    """Train ``steps`` steps streaming to ``url``, deliver every report, close the
    monitor (a ``run_end`` report); return the last report's samples."""
    with job.attach(url, run, **options) as mon:
        job.train(mon, steps)
        if not mon.flush(30):
            raise AssertionError(f"run {run}: reports not delivered to {url} within 30 s")
        return mon.latest()


# -- I1 --------------------------------------------------------------------------------
class DilutionJob(Job):
    """I1 at a tenth of the length: 21 text samples of 40 label tokens (84%) and 4
    image answers of 2 (16%), the 20:1 length ratio of the write-up.

    Bug: per-token normalization (sum over all label tokens / their count). The image
    samples hold 8 of 848 label tokens: grad share 0.94%, dilution 16% / 0.94% = 17.
    Fix: per-sample normalization (mean of the sample means): dilution 1.0.
    """

    modalities = ("text", "image")
    TEXT, IMAGE, TEXT_TOKENS, IMAGE_TOKENS = 21, 4, 40, 2

    def step(self, mon: Monitor) -> None:
        ids, labels, mask = token_batch(self.gen, [self.TEXT_TOKENS] * self.TEXT + [self.IMAGE_TOKENS] * self.IMAGE)
        modality = torch.tensor([0] * self.TEXT + [1] * self.IMAGE)
        logits = self.model(ids)
        per_token = per_token_loss(logits, labels)
        mon.track_loss(per_token, modality=modality, mask=mask, output=logits)
        if self.fixed:
            loss = sample_mean(per_token, mask).mean()
        else:
            loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        self.finish_step()


class SqrtDilutionJob(Job):
    """A deliberate sqrt normalization (Qwen3-VL) with very short answers: 21 text
    samples of 400 label tokens, 4 image answers of 2. Each sample weighs sqrt(n):
    image share 4 sqrt(2) / (21 sqrt(400) + 4 sqrt(2)) = 1.33%, dilution 12x, fitted
    exponent 0.5. Undeclared, the fitted sqrt is taken as the intent: only the info
    note LossNormalizationDilutes, no page. Fix: per sample (dilution 1, nothing)."""

    modalities = ("text", "image")
    TEXT, IMAGE, TEXT_TOKENS, IMAGE_TOKENS = 21, 4, 400, 2
    SHARE = IMAGE * 2**0.5 / (TEXT * 400**0.5 + IMAGE * 2**0.5)

    def step(self, mon: Monitor) -> None:
        ids, labels, mask = token_batch(self.gen, [self.TEXT_TOKENS] * self.TEXT + [self.IMAGE_TOKENS] * self.IMAGE)
        modality = torch.tensor([0] * self.TEXT + [1] * self.IMAGE)
        per_token = per_token_loss(self.model(ids), labels)
        mon.track_loss(per_token, modality=modality, mask=mask)
        n = mask.sum(1)
        per_sample = sample_mean(per_token, mask)
        if self.fixed:
            loss = per_sample.mean()
        else:  # sum_s sqrt(n_s) * mean_s / sum_s sqrt(n_s): w_s ~ sqrt(n_s)
            loss = (per_sample * n.sqrt()).sum() / n.sqrt().sum()
        loss.backward()
        self.finish_step()


class DeclaredSampleJob(DilutionJob):
    """The job declares per-sample weighting but its loss is per token (I1's 17x):
    the measured scheme differs from the declared one, so GradientDilution pages.
    Fix: the per-sample loss it declares."""

    def attach(self, url: str, run: str, **options: Any) -> Monitor:
        return super().attach(url, run, loss_normalization="sample", **options)


class DeclaredTokenJob(DilutionJob):
    """A deliberate per-token loss, declared: the 17x is the intent, noted (info)
    as LossNormalizationDilutes, no page. Fix: per sample (nothing to note)."""

    def attach(self, url: str, run: str, **options: Any) -> Monitor:
        return super().attach(url, run, loss_normalization="token", **options)


# -- I2 --------------------------------------------------------------------------------
class AccumulationJob(Job):
    """I2: gradient accumulation over 4 micro-batches of a mean-normalized loss.

    Bug: each micro-batch's mean loss goes to backward undivided: the step's loss
    weights add up to 4 (``loss_weight_mass`` 4). Fix: divided by 4: mass 1.
    """

    ACCUM = 4

    def make_optimizer(self) -> torch.optim.Optimizer:
        # SGD: the missing division is then an N-fold learning rate, the case that pages
        # (under AdamW the steps are the same and the alert warns: tests/alerts/test_loss_impact.py).
        return torch.optim.SGD(self.model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01)

    def step(self, mon: Monitor) -> None:
        for _ in range(self.ACCUM):
            ids, labels, mask = token_batch(self.gen, [16, 12, 14, 10])
            per_token = per_token_loss(self.model(ids), labels)
            mon.track_loss(per_token, modality="text", mask=mask)
            loss = (per_token * mask).sum() / mask.sum()
            (loss / self.ACCUM if self.fixed else loss).backward()
        self.finish_step()


class DoubleDivisionJob(AccumulationJob):
    """I2's invariant the other way: the loss divided by the accumulation count twice
    (once in ``compute_loss``, once in the loop): mass 1/16. Fix: divided once: mass 1."""

    def step(self, mon: Monitor) -> None:
        for _ in range(self.ACCUM):
            ids, labels, mask = token_batch(self.gen, [16, 12, 14, 10])
            per_token = per_token_loss(self.model(ids), labels)
            mon.track_loss(per_token, modality="text", mask=mask)
            loss = (per_token * mask).sum() / mask.sum() / self.ACCUM
            (loss if self.fixed else loss / self.ACCUM).backward()
        self.finish_step()


class DistillationMixtureJob(Job):
    """Hard labels plus distillation on the same logits, 4 micro-batches a step: the hard
    term normalized, the KD term scaled by tau^2 = 16 (declared: weight=16).

    Bug: the KD term of each micro-batch is not divided by the 4 micro-batches: its
    mass over its declared weight is 4 (LossNotAccumNormalized for objective kd only;
    the hard term stays at 1). Fix: divided: both at 1, and tau^2 = 16 does not page.
    """

    ACCUM, TAU = 4, 4.0

    def step(self, mon: Monitor) -> None:
        for _ in range(self.ACCUM):
            ids, labels, mask = token_batch(self.gen, [16, 12, 14, 10])
            logits = self.model(ids)
            hard = per_token_loss(logits, labels)
            with torch.no_grad():
                teacher = torch.roll(logits.detach(), 1, dims=-1) * 2.0
            soft = F.kl_div(
                F.log_softmax(logits / self.TAU, -1), F.softmax(teacher / self.TAU, -1), reduction="none"
            ).sum(-1)
            mon.track_loss(hard, modality="text", mask=mask, objective="hard")
            mon.track_loss(soft, modality="text", mask=mask, objective="kd", weight=self.TAU**2)
            tokens = mask.sum()
            hard_loss = (hard * mask).sum() / tokens / self.ACCUM
            kd_loss = self.TAU**2 * (soft * mask).sum() / tokens
            (hard_loss + (kd_loss / self.ACCUM if self.fixed else kd_loss)).backward()
        self.finish_step()


# -- I3 --------------------------------------------------------------------------------
class MeanOfMeansJob(Job):
    """I3: two micro-batches of unequal label-token counts (96 and 32) per step.

    Bug: each micro-batch normalized by its own token count, the two means averaged:
    a token of the short micro-batch weighs 1/64, of the long one 1/192
    (``token_weight_spread_ratio`` 3). Fix: every micro-batch divided by the step's
    128 label tokens: 1/128 everywhere, spread 1.
    """

    MICRO = ([24, 24, 24, 24], [8, 8, 8, 8])

    def step(self, mon: Monitor) -> None:
        batches = [token_batch(self.gen, lengths) for lengths in self.MICRO]
        step_tokens = sum(int(mask.sum()) for _, _, mask in batches)
        for ids, labels, mask in batches:
            per_token = per_token_loss(self.model(ids), labels)
            mon.track_loss(per_token, modality="text", mask=mask)
            total = (per_token * mask).sum()
            loss = total / step_tokens if self.fixed else total / mask.sum() / len(batches)
            loss.backward()
        self.finish_step()


# -- I4 --------------------------------------------------------------------------------
class DriftJob(Job):
    """I4: a learnable scalar that Adam walks on rounding noise.

    The scalar multiplies the embeddings in front of the RMSNorm, which divides it
    out: its true gradient is zero. What reaches Adam is low-precision rounding
    noise, biased to one sign as in the write-up (82% negative here, size 5e-9,
    below Adam's eps of 1e-8). It is injected with a gradient hook, since float32
    on the CPU does not reproduce bf16's bias. ``sqrt(v_hat)`` ~ 5e-9 < eps: Adam's
    step is ~0.2 lr, one way, every step. Megatron's heuristic gives the 1D
    parameters (the scalar, the RMSNorm weight, the head's bias) no weight decay;
    the norm weight and the bias have a real gradient and must not be flagged.

    Fixes (``fix``, used when ``fixed``): ``"zero-grad"``, a gradient hook that
    zeros the scalar's gradient (the fix docs/incidents.md gives; ``requires_grad=False`` would break
    DDP); ``"weight-decay"``, weight decay for every parameter.
    """

    NOISE, NEGATIVE_SHARE = 5e-9, 0.82
    SCALE_INIT = 0.25
    LR = 0.05

    def __init__(self, *, fixed: bool = False, seed: int = 0, fix: str = "zero-grad"):
        if fix not in ("zero-grad", "weight-decay"):
            raise ValueError(f"fix={fix!r}: 'zero-grad' or 'weight-decay'")
        self.fix = fix
        super().__init__(fixed=fixed, seed=seed)
        self.noise_gen = torch.Generator().manual_seed(seed + 1)
        scale = self.model.scale
        scale.register_hook(self._rounding_noise)
        if fixed and fix == "zero-grad":
            scale.register_hook(torch.zeros_like)

    def _rounding_noise(self, grad: torch.Tensor) -> torch.Tensor:
        negative = torch.rand((), generator=self.noise_gen) < self.NEGATIVE_SHARE
        return torch.full_like(grad, -self.NOISE if negative else self.NOISE)

    def make_model(self, seed: int) -> nn.Module:
        return TinyLM(seed=seed, input_scale=self.SCALE_INIT)

    def make_optimizer(self) -> torch.optim.Optimizer:
        params = list(self.model.named_parameters())
        no_decay_wd = 0.1 if (self.fixed and self.fix == "weight-decay") else 0.0
        return torch.optim.AdamW(
            [
                {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": 0.1, "name": "decay"},
                {"params": [p for _, p in params if p.ndim < 2], "weight_decay": no_decay_wd, "name": "no_decay"},
            ],
            lr=self.LR,
        )

    def step(self, mon: Monitor) -> None:
        ids, labels, mask = token_batch(self.gen, [12, 10, 8, 12])
        per_token = per_token_loss(self.model(ids), labels)
        mon.track_loss(per_token, modality="text", mask=mask)
        ((per_token * mask).sum() / mask.sum()).backward()
        self.finish_step()


# -- I4: optimizer state reset -----------------------------------------------------------
class StateResetJob(Job):
    """I4's amplifier: the optimizer state is cleared mid-run (``optimizer.state.clear()``
    after ``RESET_AT`` steps, as a rebuilt optimizer does). Fix: no reset."""

    RESET_AT = 8

    def step(self, mon: Monitor) -> None:
        if not self.fixed and self.steps == self.RESET_AT:
            self.opt.state.clear()
        ids, labels, mask = token_batch(self.gen, [12, 10, 8, 12])
        per_token = per_token_loss(self.model(ids), labels)
        mon.track_loss(per_token, modality="text", mask=mask)
        ((per_token * mask).sum() / mask.sum()).backward()
        self.finish_step()


# -- I5 --------------------------------------------------------------------------------
class DistillJob(Job):
    """I5: distillation from a near one-hot teacher (an extraction task: the right
    token 10 nats above the rest), observed with ``observe_logits(role="teacher")``.

    Bug: distilled at tau = 1: the teacher's top-1 is 1 / (1 + 31 e^-10) = 0.9986 at
    every position (saturated share ~1). Fix: a task temperature tau = 6 (and the KD
    loss times tau^2): top-1 ~0.15, nothing saturated.
    """

    MARGIN = 10.0

    @property
    def tau(self) -> float:
        return 6.0 if self.fixed else 1.0

    def teacher(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        noise = torch.randn((*ids.shape, VOCAB), generator=self.gen) * 0.3
        return self.MARGIN * F.one_hot(labels, VOCAB).float() + noise

    def step(self, mon: Monitor) -> None:
        tau = self.tau
        ids, labels, mask = token_batch(self.gen, [12, 10, 8, 12])
        teacher_logits = self.teacher(ids, labels)
        mon.observe_logits(teacher_logits, mask=mask, task="ie", role="teacher", temperature=tau)
        student_logits = self.model(ids)
        kl = F.kl_div(
            F.log_softmax(student_logits / tau, -1),
            F.log_softmax(teacher_logits / tau, -1),
            reduction="none",
            log_target=True,
        ).sum(-1)
        per_token = kl * tau**2
        mon.track_loss(per_token, modality="text", mask=mask)
        ((per_token * mask).sum() / mask.sum()).backward()
        self.finish_step()


# -- table stakes ------------------------------------------------------------------------
class NonFiniteLossJob(Job):
    """A micro-batch whose loss is NaN: at step ``BAD_AT`` one sample's logits overflow
    to inf (as an fp16 overflow does), its per-token losses are NaN. The job does what
    a GradScaler does with non-finite values: it skips that optimizer step (no
    backward, gradients dropped) and carries on. Fix: no overflow."""

    BAD_AT = 6

    def __init__(self, *, fixed: bool = False, seed: int = 0):
        super().__init__(fixed=fixed, seed=seed)
        self.skipped = 0  # optimizer steps skipped on a non-finite loss

    def step(self, mon: Monitor) -> None:
        while True:
            ids, labels, mask = token_batch(self.gen, [12, 10, 8, 12])
            logits = self.model(ids)
            if not self.fixed and self.steps == self.BAD_AT and not self.skipped:
                overflow = torch.ones(len(ids), 1, 1)
                overflow[0] = math.inf
                logits = logits * overflow
            per_token = per_token_loss(logits, labels)
            mon.track_loss(per_token, modality="text", mask=mask)
            loss = (per_token * mask).sum() / mask.sum()
            if torch.isfinite(loss):
                break
            self.skipped += 1
            self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.finish_step()


class SpikeJob(Job):
    """A gradient spike after a stable period: at step ``SPIKE_AT`` the loss (and so
    the gradient) is 100x (a bad batch or a broken loss scale). ``grad_norm_max``
    jumps ~100x its running median. Fix: no spike."""

    SPIKE_AT = 26

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)

    def step(self, mon: Monitor) -> None:
        ids, labels, mask = token_batch(self.gen, [12, 12, 12, 12])
        per_token = per_token_loss(self.model(ids), labels)
        loss = (per_token * mask).sum() / mask.sum()
        if not self.fixed and self.steps == self.SPIKE_AT:
            loss = loss * 100
        loss.backward()
        self.finish_step()


class ClippedSpikeJob(SpikeJob):
    """The same spike in an LLM-style job: gradients clipped to norm 1 every step and a
    report every 5 steps, the spike on a step that is not reported (23). The norm is
    taken before clipping and the report's max covers every step since the previous
    one, so the spike still reaches the collector. Fix: no spike."""

    SPIKE_AT = 23

    def attach(self, url: str, run: str, **options: Any) -> Monitor:
        options.setdefault("every", 5)
        return super().attach(url, run, **options)

    def finish_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        super().finish_step()


class HealthyJob(Job):
    """Everything done right, with every signal on: two modalities of very different
    lengths with a per-sample loss, gradient accumulation over 2 micro-batches (each
    divided by 2), AdamW with weight decay on every parameter (1D ones included),
    noisy labels so the model's softmax stays soft, observed with ``observe_logits``
    (on the first micro-batch of each step: the statistics are per step anyway).
    """

    modalities = ("text", "image")
    ACCUM = 2

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.05)

    def step(self, mon: Monitor) -> None:
        for micro in range(self.ACCUM):
            lengths = [int(n) for n in torch.randint(16, 33, (6,), generator=self.gen)]
            lengths += [int(n) for n in torch.randint(2, 5, (2,), generator=self.gen)]
            ids, labels, mask = token_batch(self.gen, lengths, noise=0.6)
            modality = torch.tensor([0] * 6 + [1] * 2)
            logits = self.model(ids)
            if micro == 0:
                mon.observe_logits(logits.detach(), mask=mask, task="lm", role="student")
            per_token = per_token_loss(logits, labels)
            mon.track_loss(per_token, modality=modality, mask=mask, output=logits)
            (sample_mean(per_token, mask).mean() / self.ACCUM).backward()
        self.finish_step()


# -- packed rows -------------------------------------------------------------------------
class PackedLeakJob(Job):
    """Samples packed into one row that see each other: a one-layer Llama of width 32
    (sdpa, built from a config, no download, no cache in training) gets one row of
    ``LENGTHS`` samples per step with restarting ``position_ids``.

    Bug: an all-ones 2-D ``attention_mask`` beside the position ids (what a collator
    padding to a fixed shape does): transformers takes the mask as given and builds no
    block-diagonal mask, so each sample attends to those before it in the row. The
    packing signal shows the static sign (``cause="mask_beside_positions"``) and its
    probe (on the first report step) measures the leak: PackedSamplesLeak pages.
    Fix: no ``attention_mask``: the model builds the block-diagonal mask from the
    position ids; the probe measures 0.

    ``leak``: the truth, measured on the first step's micro-batch before its optimizer
    step (the weights the forward saw): the same row forwarded again in eval mode with
    the first sample's token ids ``t`` replaced by ``(t + 1) % vocab``, the largest
    absolute change of the logits at the other samples' positions.
    """

    LENGTHS = (12, 9, 14, 7)

    def __init__(self, *, fixed: bool = False, seed: int = 0):
        super().__init__(fixed=fixed, seed=seed)
        self.leak: float | None = None

    def make_model(self, seed: int) -> nn.Module:
        from transformers import AutoModelForCausalLM

        from tests.integrations._hf_models import tiny_llama_config

        torch.manual_seed(seed)
        config = tiny_llama_config(attn_implementation="sdpa", use_cache=False)
        return AutoModelForCausalLM.from_config(config)

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)

    def batch(self) -> dict[str, torch.Tensor]:
        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab, (1, sum(self.LENGTHS)), generator=self.gen)
        positions = torch.cat([torch.arange(n) for n in self.LENGTHS])[None]
        labels = torch.where(positions == 0, -100, ids)  # no label across a boundary
        batch = {"input_ids": ids, "position_ids": positions, "labels": labels}
        if not self.fixed:
            batch["attention_mask"] = torch.ones_like(ids)
        return batch

    def measure_leak(self, batch: dict[str, torch.Tensor]) -> float:
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        ids, first = kwargs["input_ids"], torch.arange(kwargs["input_ids"].shape[1]) < self.LENGTHS[0]
        changed = torch.where(first, (ids + 1) % self.model.config.vocab_size, ids)
        self.model.eval()
        with torch.no_grad():
            a = self.model(**kwargs).logits.double()
            b = self.model(**{**kwargs, "input_ids": changed}).logits.double()
        self.model.train()
        return float((a - b).abs().amax(-1)[0, ~first].max())

    def step(self, mon: Monitor) -> None:
        batch = self.batch()
        self.model(**batch).loss.backward()
        if self.steps == 0:
            self.leak = self.measure_leak(batch)
        self.finish_step()


# -- coverage ----------------------------------------------------------------------------
class BlindLossJob(Job):
    """Zero-code loss accounting (``loss_from_logits=True``) on a loss it cannot read: a
    label-smoothed cross-entropy, whose logits' gradient is not a cross-entropy one, so
    the loss figures are withheld (coverage ``not_cross_entropy``) and SignalInactive
    warns. The fix: the plain cross-entropy, which zero-code accounting reads."""

    def attach(self, url: str, run: str, **options: Any) -> Monitor:
        options.setdefault("loss_from_logits", True)
        return super().attach(url, run, **options)

    def step(self, mon: Monitor) -> None:
        ids, labels, _ = token_batch(self.gen, [12] * 4)
        logits = self.model(ids)
        smoothing = 0.0 if self.fixed else 0.1
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=smoothing).backward()
        self.finish_step()
