"""``track_loss`` argument checks: types, shapes and modality names, raised at once
with what to pass instead. Nothing here reads a tensor's values (no host sync)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

__all__ = ["MAX_OBJECTIVES", "NORMALIZATIONS", "UNTAGGED", "TrackChecks", "check_declarations", "check_track_loss"]

UNTAGGED = -1
"""The modality code of samples whose modality is not known: they count toward the
totals (weight mass, exponent, spread) and no modality's figures."""

NORMALIZATIONS = {"token": 1.0, "sqrt": 0.5, "sample": 0.0}
"""Declared loss normalizations and the exponent beta of ``w_sample ~ n_tokens^beta`` each gives."""

MAX_OBJECTIVES = 8
"""Distinct ``objective`` names one monitor accounts (each has its own sums)."""

_OBJECTIVE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")


def check_declarations(objective: Any, weight: Any, normalization: Any) -> None:
    """``track_loss``'s declarations of intent: what the objective is called, the
    coefficient it carries in the total loss, and how it normalizes."""
    if not isinstance(objective, str) or not _OBJECTIVE_RE.match(objective):
        raise ValueError(
            f"track_loss: objective={objective!r} is not a usable name; pass a short "
            "identifier like 'lm' or 'kd' (letters, digits, _; up to 32)"
        )
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0
    ):
        raise ValueError(
            f"track_loss: weight={weight!r} must be a positive number: the coefficient "
            "this objective carries in the loss you call backward on (e.g. 2.0, or tau**2 "
            "for a distillation loss), or None"
        )
    check_normalization("track_loss", normalization)


def check_normalization(where: str, normalization: Any) -> None:
    if normalization is not None and normalization not in NORMALIZATIONS:
        raise ValueError(
            f"{where}: normalization={normalization!r}; declare one of "
            f"{sorted(NORMALIZATIONS)} (per label token, per sqrt of a sample's tokens, "
            "per sample) or None"
        )


def check_track_loss(
    modalities: tuple[str, ...], per_token: Any, modality: Any, mask: Any, segments: Any, output: Any
) -> tuple[int, int, Any]:
    """Check ``track_loss``'s arguments (types and shapes only: raise at once, saying
    what to pass instead); return the rows and columns of ``per_token`` and the
    modality codes (an int, or a tensor of codes on ``per_token``'s device)."""
    if not isinstance(per_token, torch.Tensor):
        raise TypeError(
            f"track_loss(per_token=...) needs a tensor of per-token losses, got "
            f"{type(per_token).__name__}; compute the loss with reduction='none'"
        )
    if not per_token.is_floating_point():
        raise TypeError(f"track_loss: per_token must be floating point, got {per_token.dtype}")
    if not per_token.requires_grad:
        raise ValueError(
            "track_loss: per_token does not require grad. Pass the unreduced per-token loss "
            "(e.g. F.cross_entropy(..., reduction='none')) that the loss you call backward on "
            "is computed from, before reducing it; not a detached copy, and not under torch.no_grad()"
        )
    if per_token.dim() not in (1, 2):
        raise ValueError(f"track_loss: per_token must be [B, T] (or [N]), got shape {tuple(per_token.shape)}")
    if per_token.dim() == 1:
        rows, cols = (1, per_token.shape[0]) if segments is not None else (per_token.shape[0], 1)
    else:
        rows, cols = per_token.shape
    shape = tuple(per_token.shape)
    if modality is not None and not modalities:
        raise ValueError(
            "track_loss(modality=...) needs modality names: attach(..., modalities=('text', 'image')), "
            "then pass codes or names per sample; for a job with one modality, leave modality out"
        )
    for name, t in (("mask", mask), ("segments", segments)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"track_loss: {name} must be a tensor shaped like per_token {shape}, got {type(t).__name__}"
            )
        if tuple(t.shape) != shape:
            raise ValueError(
                f"track_loss: {name} has shape {tuple(t.shape)}, per_token {shape}; pass one value per token"
            )
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"track_loss: mask must be boolean (label tokens), got {mask.dtype}; e.g. mask=labels != -100")
    if segments is not None and (segments.is_floating_point() or segments.is_complex() or segments.dtype == torch.bool):
        raise TypeError(f"track_loss: segments must hold integer sample ids, got {segments.dtype}")
    if output is not None:
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"track_loss: output must be the logits or last hidden states tensor, got {type(output).__name__}"
            )
        if not output.requires_grad:
            raise ValueError(
                "track_loss: output does not require grad; pass the logits or hidden "
                "states the per-token loss is computed from"
            )
        lead = tuple(output.shape[: per_token.dim()])
        if lead != shape and not (output.dim() >= 1 and output.shape[0] == per_token.numel()):
            raise ValueError(
                f"track_loss: output has shape {tuple(output.shape)}; it must start with "
                f"per_token's shape {shape} (e.g. logits [B, T, V])"
            )
    return rows, cols, _modality_codes(modalities, modality, per_token, rows, cols)


class TrackChecks:
    """``check_track_loss`` and ``check_declarations`` remembered per argument layout:
    a training loop passes tensors of the same shapes, dtypes and devices call after
    call, so their checks (Python, per micro-batch) run once per layout. What a tensor's
    metadata does not fix is checked every call (``requires_grad``); arguments that are
    not tensors, names or numbers always take the full checks."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[Any, ...], tuple[int, int, bool, Any]] = {}
        self._declared: set[str] = set()

    def __call__(
        self, modalities: tuple[str, ...], per_token: Any, modality: Any, mask: Any, segments: Any, output: Any
    ) -> tuple[int, int, Any]:
        key = _layout_key(modalities, per_token, modality, mask, segments, output)
        if key is None:
            return check_track_loss(modalities, per_token, modality, mask, segments, output)
        found = self._layouts.get(key)
        if found is not None and per_token.requires_grad and (output is None or output.requires_grad):
            rows, cols, as_is, code = found
            if as_is:
                return rows, cols, modality
            if code is not None:
                return rows, cols, code
            return rows, cols, _modality_codes(modalities, modality, per_token, rows, cols)
        rows, cols, codes = check_track_loss(modalities, per_token, modality, mask, segments, output)
        if len(self._layouts) >= 64:  # shapes changed many times: start over
            self._layouts.clear()
        # kept: whether the codes are the argument itself (a number, or a tensor of codes
        # already on per_token's device), and a name's code (its key holds the name)
        self._layouts[key] = (rows, cols, codes is modality, codes if type(codes) is int else None)
        return rows, cols, codes

    def declarations(self, objective: Any, weight: Any, normalization: Any) -> None:
        """``check_declarations``, once per objective name while nothing else is declared."""
        if weight is None and normalization is None and type(objective) is str and objective in self._declared:
            return
        check_declarations(objective, weight, normalization)
        if weight is None and normalization is None and len(self._declared) < 64:
            self._declared.add(objective)


def _layout_key(
    modalities: tuple[str, ...], per_token: Any, modality: Any, mask: Any, segments: Any, output: Any
) -> tuple[Any, ...] | None:
    """What ``check_track_loss``'s verdict depends on, or None where it is not kept."""
    if type(per_token) is not torch.Tensor:
        return None
    key: list[Any] = [modalities, per_token.shape, per_token.dtype, per_token.device]
    for t in (mask, segments):
        if t is None:
            key.append(None)
        elif type(t) is torch.Tensor:
            key.append((t.shape, t.dtype))
        else:
            return None
    if output is None:
        key.append(None)
    elif type(output) is torch.Tensor:
        key.append(output.shape)
    else:
        return None
    kind = type(modality)
    if kind is torch.Tensor:
        key.append((modality.shape, modality.dtype, modality.device))
    elif kind is str or kind is int:
        key.append((kind, modality))
    else:
        return None
    return tuple(key)


def _modality_codes(modalities: tuple[str, ...], modality: Any, per_token: torch.Tensor, rows: int, cols: int) -> Any:
    if modality is None:  # one modality (code 0 when it is named), or the totals only
        return 0 if len(modalities) == 1 else UNTAGGED
    known = list(modalities)
    if isinstance(modality, str):
        return _code_of(modality, known)
    if isinstance(modality, int) and not isinstance(modality, bool):
        return modality
    if isinstance(modality, (list, tuple)):
        if len(modality) != rows or per_token.dim() != 2:
            raise ValueError(
                f"track_loss: a list of modalities needs one entry per row of a "
                f"[B, T] per_token (B={per_token.shape[0]}), got {len(modality)}"
            )
        codes = [_code_of(m, known) if isinstance(m, str) else m for m in modality]
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
            raise TypeError("track_loss: modality list entries must be names or integer codes")
        return torch.tensor(codes, dtype=torch.long).to(per_token.device, non_blocking=True)
    if not isinstance(modality, torch.Tensor):
        raise TypeError(
            f"track_loss: modality must be codes (tensor [B] or [B, T]), names "
            f"{known} or one name for all, got {type(modality).__name__}"
        )
    if modality.is_floating_point() or modality.is_complex() or modality.dtype == torch.bool:
        raise TypeError(f"track_loss: modality codes must be integers, got {modality.dtype}")
    if modality.dim() == 0:
        return modality.reshape(1).expand(rows).to(per_token.device, non_blocking=True)
    shape = tuple(per_token.shape)
    if per_token.dim() == 2 and tuple(modality.shape) == shape[:1]:
        return modality.to(per_token.device, non_blocking=True)
    if tuple(modality.shape) == shape:
        return modality.reshape(rows, cols).to(per_token.device, non_blocking=True)
    raise ValueError(
        f"track_loss: modality has shape {tuple(modality.shape)}; pass one code per "
        f"sample {shape[:1]} or per token {shape}"
    )


def _code_of(name: Any, known: list[str]) -> int:
    if name not in known:
        raise ValueError(
            f"track_loss: unknown modality {name!r}; known modalities: {known} (declared with attach(modalities=...))"
        )
    return known.index(name)
