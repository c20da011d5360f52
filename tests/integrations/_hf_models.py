"""What the Hugging Face jobs share (``_hf_job``, ``_trl_job``, ``_llava_job`` and the
plain loop ``tests/run_configure/jobs/llava_loop.py``): tiny models built from configs
(no download), the true weight of each label token from the logits' gradient, the
Trainer's arguments, and a job script's ``KEY=VALUE`` options.

Only torch and transformers are imported here, never trainvitals (the plain loop knows
nothing of it), and only what transformers 4.45.2 has too (``_hf_job`` also runs under
that release)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
IMAGE = 63  # the tiny LLaVA's image token
PATCHES = 4  # its image features per image: (8 / 4) ** 2


def tiny_llama_config(**extra: Any) -> Any:
    """A one-layer Llama of width 32 over a 64-token vocabulary; ``extra`` overrides."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return LlamaConfig(**{**fields, **extra})


def tiny_llava() -> torch.nn.Module:
    """``LlavaForConditionalGeneration`` from a one-layer CLIP of 8x8 images in 4x4 patches
    and the tiny Llama; its config names the image token (``IMAGE``). Seeded."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    text = tiny_llama_config(max_position_embeddings=128, pad_token_id=0)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, vision_feature_layer=-1)
    return LlavaForConditionalGeneration(config)


def label_token_weights(
    grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label token's weight in the loss, from the gradient ``g`` at the logits ``z``
    (float64): ``w_t = -g_{t,y_t} / (1 - p_{t,y_t})`` with ``y_t`` the next token's label
    (the model's shift), 0 where there is no label; and the mask of label tokens."""
    g, z = grad.double(), logits.double()
    target = torch.full_like(labels, -100)
    target[:, :-1] = labels[:, 1:]  # the model's shift: position t predicts token t + 1
    y = target.clamp_min(0)[..., None]
    p_y = torch.softmax(z, -1).gather(-1, y)[..., 0]
    lab = target != -100
    return torch.where(lab, -g.gather(-1, y)[..., 0] / (1 - p_y), 0.0), lab


def trainer_arguments(cls: type, out_dir: str, *, steps: int, accum: int, **extra: Any) -> Any:
    """``cls`` (``TrainingArguments`` or TRL's ``SFTConfig``) for a CPU run of ``steps``
    optimizer steps of ``accum`` one-sample micro-batches: no logging, no tracker, no
    checkpoints unless ``extra`` says otherwise."""
    fields: dict[str, Any] = {
        "output_dir": out_dir,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": accum,
        "max_steps": steps,
        "learning_rate": 1e-3,
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "logging_steps": 10_000,
        "save_strategy": "no",
        "disable_tqdm": True,
    }
    return cls(**{**fields, **extra})


def job_options(argv: list[str]) -> dict[str, Any]:
    """A job script's ``KEY=VALUE`` arguments; integers as int, the rest as str."""
    options: dict[str, Any] = {}
    for kv in argv:
        key, value = kv.split("=", 1)
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return options
