"""Which module's output are the logits: zero-code loss accounting hooks it.

``attach(..., loss_from_logits=True)`` looks for it; a name (as in
``model.named_modules()``) or the module itself names it. The output may be the
logits tensor, or an object or dict with a ``logits`` entry (a whole Hugging Face
model's output), or a tuple whose first tensor is the logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["find_logits_module", "logits_of"]


def find_logits_module(model: nn.Module, spec: Any) -> nn.Module:
    """The module whose output are the logits.

    ``spec``: a module of ``model``; a name from ``model.named_modules()``; or True:
    the output embeddings of the first module (``model`` itself first) that has
    Hugging Face's ``get_output_embeddings()``; else the last ``nn.Linear`` whose
    output size is the vocabulary of the model's input embedding (the largest
    ``nn.Embedding``). Raises ValueError, saying what to pass, when none is found."""
    if isinstance(spec, nn.Module):
        if not any(m is spec for m in model.modules()):
            raise ValueError(
                f"loss_from_logits: the module {type(spec).__name__} is not part of the "
                "attached model; pass the model's LM head (or its name)"
            )
        return spec
    named = dict(model.named_modules())
    if isinstance(spec, str):
        if spec not in named:
            heads = [n for n, m in named.items() if isinstance(m, nn.Linear)][-5:]
            raise ValueError(
                f"loss_from_logits={spec!r}: no such module in the model; pass a name from "
                f"model.named_modules(), e.g. one of its last linear layers {heads}"
            )
        return named[spec]
    if spec is not True:
        raise TypeError(f"loss_from_logits must be True, a module name or a module, got {spec!r}")
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except Exception:  # noqa: BLE001 - a model without a head may raise NotImplementedError
                head = None
            if isinstance(head, nn.Module):
                return head
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        vocab = max(e.num_embeddings for e in embeddings)
        heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
        if heads:
            return heads[-1]
    raise ValueError(
        "loss_from_logits=True: cannot find the module that outputs the logits (no "
        "get_output_embeddings(), no linear layer sized like the input vocabulary); pass "
        "its name, loss_from_logits='lm_head' (a name from model.named_modules())"
    )


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits tensor in a module's output, or None."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        found = output.get("logits")
        return found if isinstance(found, torch.Tensor) else None
    found = getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    return None
