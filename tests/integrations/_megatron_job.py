"""megatron-core 0.16.1's ``GPTModel`` trained on the CPU (gloo) as Megatron trains it:
``get_forward_backward_func()``, its DDP, ``finalize_model_grads`` and
``get_megatron_optimizer`` (a ``ChainedOptimizer`` around ``FP32Optimizer`` around AdamW),
the loss function returning ``(loss_sum, num_tokens, report)``.

``python _megatron_job.py OUT.json per_token=0|1 mode=attach|plain steps=N every=N [track=1]
[tp=N] [pp=N] [figures=1] [gain=1|2]``
under ``torchrun`` (any world size) or alone. ``mode=attach``: the job attaches trainvitals
itself (``attach(loss_from_logits=True)``, tagging each micro-batch's modality; ``track=1``:
``track_loss`` in the loss function instead, on the per-token losses [B, S] it gets);
``mode=plain``: it knows nothing of trainvitals (for ``trainvitals run``).

Each micro-batch is one sample (``mbs=N``: N samples of one kind): a text sample of 40
trained tokens or an image sample (an image placeholder prompt and a 3-token answer),
alternating. ``per_token=1``:
``calculate_per_token_loss`` (each token weighs the same over the step and the ranks:
the short image answers get little gradient, I1); ``per_token=0``, Megatron's default:
each micro-batch averaged over its own tokens (per-sample weighting, the intent).

``gain=1``: I4 on the last pipeline stage (:func:`attach_gain`); ``gain=2`` its twin, the
gain's gradient left at its true zero.

What the CPU needs, here in the job and not in trainvitals: ``torch.cuda.current_device``
answering "cpu" and ``device="cuda"`` tensor factories mapped to the CPU where Megatron
builds buffers, an explicit causal mask, its no-op RNG tracker (dropout 0),
``clip_grad=0``, float32.

The truth, independent of trainvitals: a tensor hook on the model's per-token loss output
[B, S] records autograd's gradient there (each token's weight before Megatron's
post-backward scaling), per step, modality and rank; rank 0 writes all ranks' records.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from functools import partial
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.simplefilter("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VOCAB, SEQ = 96, 48
TEXT_TOKENS, IMAGE_ANSWER = 40, 3


def cpu_only() -> None:
    """Megatron asks CUDA for devices and makes a few tensors on "cuda": map them to the CPU."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None  # the pipeline's p2p exchanges wait on it
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like"):
        original = getattr(torch, name)

        def factory(*args, _original=original, **kwargs):
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)

        setattr(torch, name, factory)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def samples(rank: int, count: int, mbs: int = 1) -> list[dict]:
    """``count`` micro-batches of ``mbs`` samples each; with ``mbs`` > 1 a micro-batch holds
    samples of one kind (all text or all image), so micro-batches differ in token count."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(count):
        image = (i + rank) % 2 == 1
        tokens = torch.randint(0, VOCAB, (mbs, SEQ + 1), generator=g)
        mask = torch.zeros(mbs, SEQ)
        if image:
            mask[:, SEQ - IMAGE_ANSWER :] = 1.0  # only the answer is trained on
        else:
            mask[:, SEQ - TEXT_TOKENS :] = 1.0
        out.append(
            {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "loss_mask": mask,
                "position_ids": torch.arange(SEQ)[None].expand(mbs, SEQ),
                "attention_mask": torch.triu(torch.ones(mbs, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
                "modality": torch.full((mbs,), int(image)),
            }
        )
    return out


def main(
    out: str,
    *,
    per_token: int = 0,
    mode: str = "attach",
    steps: int = 24,
    every: int = 1,
    micro: int = 4,
    mbs: int = 1,
    tp: int = 1,
    pp: int = 1,
    figures: int = 0,
    logits: int | str = 1,
    track: int = 0,
    gain: int = 0,
):
    torch.set_num_threads(1)
    cpu_only()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_PORT" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tp, pp)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    data_rank, data_world = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    torch.manual_seed(0)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # its no-op tracker: dropout 0
    config = TransformerConfig(
        num_layers=pp,  # one layer per pipeline stage
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        hidden_size=32,
        num_attention_heads=2,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=bool(per_token),
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=first,
        post_process=last,
    )
    if gain and last:  # I4: a gain before the logits whose true gradient is zero
        attach_gain(gpt, noisy=gain == 1)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0, bf16=False, fp16=False, weight_decay=0.0),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads

    mon = None
    if mode == "attach":
        from trainvitals.hooks import attach

        mon = attach(
            model,
            optimizer,
            run="megatron",
            sink=f"file:{Path(out).with_suffix('.jsonl')}",
            every=every,
            modalities=("text", "image"),
            loss_from_logits=False if track else logits if isinstance(logits, str) else bool(logits),
        )

    truth: list[dict] = []
    current: dict = {}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if mon is not None and logits and not track:
            mon.tag_batch(modality=batch["modality"])
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        image = bool(batch["modality"][0])
        label = batch["loss_mask"].bool()

        def grab(grad):
            w = grad.detach().double()[label]
            current.setdefault("micro", []).append(
                {
                    "mass": float(w.sum()),
                    "image": image,
                    "tokens": int(label.sum()),
                    "wmax": float(w.max()),
                    "wmin": float(w.min()),
                }
            )

        if last:  # the per-token losses: on the last pipeline stage (others pass hidden states on)
            output.register_hook(grab)

        def loss_func(loss_mask, output_tensor):
            if mon is not None and track:  # as a job adds it: the per-token losses [B, S] with their mask
                mon.track_loss(output_tensor, mask=loss_mask.bool(), modality=batch["modality"])
            losses = output_tensor.float()
            mask = loss_mask.view(-1).float()
            loss = torch.sum(losses.view(-1) * mask)
            num_tokens = mask.sum().clone().detach().to(torch.int)
            return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

        return output, partial(loss_func, batch["loss_mask"])

    forward_backward = get_forward_backward_func()
    data = samples(data_rank, steps * micro, mbs)  # the same batches on the ranks of a tensor-parallel group
    inner = optimizer.chained_optimizers[0].optimizer
    names = job_names(gpt)
    attached = {names[id(p)]: full(p, p) for p in gpt.parameters()} if figures else {}
    reports, truths = [], []
    for step in range(steps):
        optimizer.zero_grad()
        model.zero_grad_buffer()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(data[step * micro : (step + 1) * micro]),
            model=[model],
            num_microbatches=micro,
            seq_length=SEQ,
            micro_batch_size=mbs,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        reporting = figures and mon is not None and mon.reporting_next
        if reporting:
            grads = {names[id(p)]: full(p.main_grad, p) for p in gpt.parameters()}
            before = {names[id(p)]: full(p, p) for p in gpt.parameters()}
        optimizer.step()
        if reporting:
            found = step_truth(gpt, inner, names, grads, before, attached)
            if rank == 0:
                truths.append(found)
                reports.append(flat_report(mon.latest()))
        truth.append({"step": step + 1, "micro": current.pop("micro", [])})
    coverage = {}
    if mon is not None:
        coverage = {e["signal"]: e for e in mon.latest_coverage()}
        mon.close()
    everyone = [None] * world
    recorded = parallel_state.get_tensor_model_parallel_rank() == 0 and last
    dist.all_gather_object(everyone, (recorded, truth))
    if rank == 0:
        result = {
            # one rank per data-parallel rank: a tensor-parallel group's saw the same, the last stage the losses
            "truth": [t for recorded, t in everyone if recorded],
            "params": sorted(names.values()),
            "world": data_world,
            "reports": reports,
            "truths": truths,
            "coverage": coverage,
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def attach_gain(gpt, *, noisy: bool) -> None:
    """I4 on the last pipeline stage: ``gpt.gain`` [1], added to the final layernorm's output
    times 0, so its true gradient is exactly zero. ``noisy``: a tensor hook adds positive-biased
    noise of order 1e-7 (standing in for low-precision rounding, I4 in docs/incidents.md), which Adam,
    with no weight decay on a 1D parameter, turns into steps of about lr every step;
    without it (I4's fix, a gradient hook that zeros it) the gain never moves."""
    gpt.gain = torch.nn.Parameter(torch.full((1,), 2e-3))
    noise = torch.Generator().manual_seed(7)

    def add_noise(grad: torch.Tensor) -> torch.Tensor:
        return grad + 1e-7 * (0.5 + torch.rand(grad.shape, generator=noise))

    if noisy:
        gpt.gain.register_hook(add_noise)
    gpt.decoder.final_layernorm.register_forward_hook(lambda module, args, out: out + 0.0 * gpt.gain.sum())


def full(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter's piece ``t`` (the parameter, its gradient or an Adam
    moment): a tensor-parallel split gathered over its group along ``partition_dim``."""
    from megatron.core import parallel_state

    t = t.detach()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=param.partition_dim).double()
    return t.clone().double()


def job_names(gpt) -> dict[int, str]:
    """Each parameter's name in the whole model: a pipeline stage numbers its layers from 0,
    Megatron's ``layer_number`` (from 1) is the layer's place in the model."""
    prefixes = {}
    for name, module in gpt.named_modules():
        if name.startswith("decoder.layers.") and name.count(".") == 2:
            prefixes[name + "."] = f"decoder.layers.{module.layer_number - 1}."
    out = {}
    for name, p in gpt.named_parameters():
        for old, new in prefixes.items():
            if name.startswith(old):
                name = new + name[len(old) :]
        out[id(p)] = name
    return out


def step_truth(gpt, inner, names, grads, before, attached) -> dict[str, float] | None:
    """Every optimizer/params/adam figure of the step from the full tensors of every
    pipeline stage, gathered to rank 0 (None elsewhere): each stage's tensors whole (a
    tensor-parallel split gathered over its group), its param groups' members by name."""
    from megatron.core import parallel_state

    from tests.hooks._tp_models import truth

    after = {names[id(p)]: full(p, p) for p in gpt.parameters()}
    states = {
        names[id(p)]: {
            "step": st["step"],
            "exp_avg": full(st["exp_avg"], p),
            "exp_avg_sq": full(st["exp_avg_sq"], p),
        }
        for p, st in inner.state.items()
    }
    groups = [([names[id(p)] for p in g["params"]], {"betas": g["betas"], "eps": g["eps"]}) for g in inner.param_groups]
    stage = parallel_state.get_pipeline_model_parallel_rank()
    mine = (stage, groups, grads, before, after, attached, states)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    per_stage = {}
    for found in everyone:
        per_stage.setdefault(found[0], found)
    merged: list[dict] = [{}, {}, {}, {}, {}]
    members: list[list[str]] = [[] for _ in groups]
    for s in sorted(per_stage):
        _, their_groups, *tensors = per_stage[s]
        for gi, (group_names, _) in enumerate(their_groups):
            members[gi] += group_names
        for into, part in zip(merged, tensors, strict=True):
            into.update(part)
    grads, before, after, attached, states = merged
    placeholders = {n: torch.zeros(0) for n in after}
    opt = SimpleNamespace(
        param_groups=[
            {"params": [placeholders[n] for n in group], **hyper}
            for group, (_, hyper) in zip(members, groups, strict=True)
        ]
    )
    by_id = {id(t): n for n, t in placeholders.items()}
    return truth(gpt, opt, by_id, grads, before, after, attached, states)


def flat_report(samples: list[dict]) -> dict[str, float]:
    return {s["name"] + "|" + ",".join(f"{k}={v}" for k, v in sorted(s["labels"].items())): s["value"] for s in samples}


if __name__ == "__main__":
    options = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=", 1) for kv in sys.argv[2:])}
    main(sys.argv[1], **options)
