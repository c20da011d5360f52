"""Which module's output are the logits: zero-code loss accounting hooks it.

``attach(..., loss_from_logits=True)`` looks for it; a name (as in
``model.named_modules()``) or the module itself names it. The output may be the
logits tensor, or an object or dict with a ``logits`` entry (a whole Hugging Face
model's output), or a tuple whose first tensor is the logits (Megatron's
``ColumnParallelLinear`` returns ``(logits, bias)``).

The head is found by what it is, not by its size:

- Hugging Face's ``get_output_embeddings()`` where a module has it;
- Megatron-core's ``output_layer`` (on the last pipeline stage, beside no embedding);
- else the module whose weight *is* the token embedding's (a tied head, as in
  nanoGPT and GPT-2);
- else the last module with a 2-D ``weight`` of ``[vocab, width]`` (an
  ``nn.Linear`` or not: Megatron's ``ColumnParallelLinear``), the vocabulary being
  the token embedding's.

The token embedding: ``get_input_embeddings()`` where a module has it; else the
embedding whose weight another module also uses (tied); else the first embedding
that is not a position table (named ``wpe``, ``pos...``, ``position...``). Never the
largest embedding: with a context longer than the vocabulary (65 characters, 256
positions) that is the position table.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["AUTO", "HeadSearch", "expected_vocab", "find_head", "find_logits_module", "logits_of", "token_embedding"]

AUTO = "auto"
"""``loss_from_logits``'s default: find the LM head, and say why loss accounting is off
when there is none (never an error: the job is watched without it)."""

_POSITIONAL = re.compile(r"(^|_)(wpe|pos|position|positions|positional)(_|$)|^pos|position", re.IGNORECASE)


def _embedding_like(m: nn.Module) -> bool:
    """An ``nn.Embedding`` or a look-alike (Megatron's ``VocabParallelEmbedding``)."""
    if isinstance(m, nn.Embedding):
        return True
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(getattr(m, "num_embeddings", None), int)


def _weight(m: nn.Module) -> torch.Tensor | None:
    w = getattr(m, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _vocab_of(embedding: nn.Module) -> int:
    n = getattr(embedding, "num_embeddings", None)
    w = _weight(embedding)
    if isinstance(n, int):
        return n
    return int(w.shape[0]) if w is not None else 0


def _hf_input_embeddings(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        get = getattr(module, "get_input_embeddings", None)
        if callable(get):
            try:
                found = get()
            except Exception:  # noqa: BLE001 - a model without one may raise NotImplementedError
                found = None
            if isinstance(found, nn.Module):
                return found
    return None


def token_embedding(model: nn.Module) -> nn.Module | None:
    """The model's token embedding (see the module docstring), or None."""
    found = _hf_input_embeddings(model)
    if found is not None:
        return found
    named: list[tuple[str, nn.Module]] = [(n, m) for n, m in model.named_modules() if _embedding_like(m)]
    if not named:
        return None
    others = [m for m in model.modules() if not _embedding_like(m)]
    for _, emb in named:
        w = emb.weight
        if any(getattr(o, "weight", None) is w for o in others):
            return emb
    plain = [m for n, m in named if not _POSITIONAL.search(n.rsplit(".", 1)[-1])]
    return plain[0] if plain else None


def _hf_output_embeddings(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except Exception:  # noqa: BLE001 - a model without a head may raise NotImplementedError
                head = None
            if isinstance(head, nn.Module):
                return head
    return None


def find_logits_module(model: nn.Module, spec: Any) -> nn.Module:
    """The module whose output are the logits.

    ``spec``: a module of ``model``; a name from ``model.named_modules()``; or True:
    found as the module docstring says. Raises ValueError, saying what to pass, when
    none is found."""
    if isinstance(spec, nn.Module):
        if not any(m is spec for m in model.modules()):
            raise ValueError(
                f"loss_from_logits: the module {type(spec).__name__} is not part of the "
                "attached model; pass the model's LM head (or its name)"
            )
        return spec
    named: dict[str, nn.Module] = dict(model.named_modules())
    if isinstance(spec, str):
        spec = _as_named(spec, named)
        if spec not in named:
            heads = [n for n, m in named.items() if isinstance(m, nn.Linear)][-5:]
            raise ValueError(
                f"loss_from_logits={spec!r}: no such module in the model; pass a name from "
                f"model.named_modules(), e.g. one of its last linear layers {heads}"
            )
        return named[spec]
    if spec is not True:
        raise TypeError(f"loss_from_logits must be True, a module name or a module, got {spec!r}")
    head = _hf_output_embeddings(model)
    if head is not None:
        return head
    head = _megatron_output_layer(model)
    if head is not None:  # its last pipeline stage holds no token embedding to size it by
        return head
    emb = token_embedding(model)
    if emb is not None:
        tied = [m for m in model.modules() if m is not emb and getattr(m, "weight", None) is emb.weight]
        if tied:
            return tied[-1]
        ew = _weight(emb)
        width = ew.shape[1] if ew is not None else None
        vocab = _vocab_of(emb)
        sized = []
        for m in model.modules():
            w = _weight(m)
            if w is not None and not _embedding_like(m) and tuple(w.shape) == (vocab, width):
                sized.append(m)
            elif w is not None and ew is not None and not _embedding_like(m) and _vocab_shards(w, ew):
                sized.append(m)  # Megatron's vocab-parallel output layer beside its vocab-parallel embedding
        if sized:
            return sized[-1]
    raise ValueError(
        "loss_from_logits=True: cannot find the module that outputs the logits (no "
        "get_output_embeddings(), no module tied to or sized like the token embedding); pass "
        "its name, loss_from_logits='lm_head' (a name from model.named_modules())"
    )


def _megatron_output_layer(model: nn.Module) -> nn.Module | None:
    """Megatron-core's language model's output layer (``GPTModel.output_layer``, present on
    the last pipeline stage), or None."""
    head = getattr(model, "output_layer", None)
    if type(model).__module__.startswith("megatron.") and isinstance(head, nn.Module):
        return head
    return None


def _as_named(spec: str, named: dict[str, nn.Module]) -> str:
    """``spec`` as ``named`` spells it: the name as the user's wrapped model has it
    (DDP's ``module.``, Megatron's DDP and Float16Module ``module.``, FSDP's and
    ``torch.compile``'s parts) read on the unwrapped model."""
    if spec in named:
        return spec
    name = spec
    for part in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    while name not in named and name.startswith("module."):
        name = name[len("module.") :]
    return name if name in named else spec


def _vocab_shards(w: torch.Tensor, ew: torch.Tensor) -> bool:
    """A head weight split over the vocabulary like the token embedding's (both Megatron
    tensor-parallel splits along their rows, of one shape)."""
    return (
        tuple(w.shape) == tuple(ew.shape)
        and all(getattr(t, "tensor_model_parallel", False) for t in (w, ew))
        and all(getattr(t, "partition_dim", -1) == 0 for t in (w, ew))
    )


class HeadSearch(NamedTuple):
    """What :func:`find_head` found: the head, or None with the coverage reason
    (``no_lm_head``, or ``not_requested`` for a model that is no language model) and
    the detail a user reads."""

    head: nn.Module | None
    reason: str = ""
    detail: str = ""


def find_head(model: nn.Module) -> HeadSearch:
    """The LM head as ``loss_from_logits=True`` finds it, or why there is none."""
    try:
        return HeadSearch(find_logits_module(model, True))
    except (ValueError, TypeError):
        if token_embedding(model) is None:
            return HeadSearch(
                None,
                "not_requested",
                "the model has no token embedding (not a language model): no logits to read loss "
                "weights from; call Monitor.track_loss for loss accounting",
            )
        return HeadSearch(
            None,
            "no_lm_head",
            "no LM head found (no get_output_embeddings(), no module tied to or sized like the token "
            "embedding): name it, attach(loss_from_logits='lm_head'), or call Monitor.track_loss",
        )


def expected_vocab(model: nn.Module, head: nn.Module) -> int | None:
    """The size of the logits' last dimension that ``head`` should give: its weight's
    rows (a tensor-parallel shard gives its own part), else the token embedding's
    vocabulary; None when neither is known."""
    w = _weight(head)
    if w is not None:
        return int(w.shape[0])
    emb = token_embedding(model)
    return _vocab_of(emb) if emb is not None else None


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
