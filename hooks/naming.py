"""Parameter names as users know them: those of ``named_parameters()`` on the
unwrapped model, without ``module.`` (DDP), FSDP or ``torch.compile`` parts."""

from __future__ import annotations

from torch import nn

__all__ = ["clean_name", "unwrap"]

# Wrapper prefixes that never belong in a parameter's user-facing name.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / ``torch.compile`` wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)  # torch.compile
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner, nn.Module):
            model = inner
    return model


def clean_name(name: str) -> str:
    """A parameter name without wrapper parts."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
