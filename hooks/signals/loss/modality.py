"""Loss accounting, modality tagging from the model's own inputs.

A vision-language model names in its config the token that stands for an image
(video) in its input ids (LLaVA, Qwen2-VL, Idefics, ...). Zero-code accounting
reads the input ids of each forward and tags every sample with the last media
modality whose token it holds, else ``text``; a ``tag_batch`` call or the
callback's modality field takes precedence.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MEDIA_TOKEN_FIELDS", "input_ids", "media_codes", "model_media_tokens", "sample_codes"]


def input_ids(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A forward's input ids [B, S]: ``input_ids=`` or the first 2-D integer tensor."""
    found = kwargs.get("input_ids")
    if not isinstance(found, torch.Tensor):
        found = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2), None)
    if found is None or found.dim() != 2 or found.is_floating_point() or found.dtype == torch.bool:
        return None
    return found


MEDIA_TOKEN_FIELDS = {
    "image": ("image_token_id", "image_token_index"),
    "video": ("video_token_id", "video_token_index"),
}
"""Config fields where a vision-language model names the token that stands for an
image (video) in its input ids (LLaVA, Qwen2-VL, Idefics, ...)."""


def model_media_tokens(model: Any) -> dict[str, int]:
    """``{"image": id, "video": id}`` as far as the model's config says them."""
    config = getattr(model, "config", None)
    found: dict[str, int] = {}
    if config is None:
        return found
    for name, fields in MEDIA_TOKEN_FIELDS.items():
        for f in fields:
            value = getattr(config, f, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                found[name] = value
                break
    return found


def media_codes(model: Any, modalities: tuple[str, ...]) -> list[tuple[int, int]]:
    """(modality code, token id) for each declared modality ``image``/``video`` the
    model's config names a token for, and the code of ``text`` first as (code, -1);
    empty when the model names none or ``text`` is not declared."""
    tokens = model_media_tokens(model)
    if "text" not in modalities:
        return []
    pairs = [(modalities.index(name), tid) for name, tid in tokens.items() if name in modalities]
    return [(modalities.index("text"), -1), *pairs] if pairs else []


def sample_codes(ids: torch.Tensor, media: list[tuple[int, int]]) -> torch.Tensor:
    """Per sample: the code of the last media modality whose token its input ids hold,
    else text's."""
    text = media[0][0]
    codes = torch.full((ids.shape[0],), text, dtype=torch.long, device=ids.device)
    for code, token in media[1:]:
        codes = torch.where((ids == token).any(dim=1), code, codes)
    return codes
