"""Parameter names as users know them: those of ``named_parameters()`` on the
unwrapped model, without ``module.`` (DDP), FSDP or ``torch.compile`` parts."""

from __future__ import annotations

from torch import nn

__all__ = ["clean_name", "unwrap"]

# Wrapper prefixes that never belong in a parameter's user-facing name.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / ``torch.compile`` wrappers (and
    Megatron-core's DDP and Float16Module)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)  # torch.compile
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner, nn.Module):
            model = inner
        elif _megatron_wrapper(model) and isinstance(model.module, nn.Module):
            model = model.module
    return model


def _megatron_wrapper(model: nn.Module) -> bool:
    """Megatron-core's DistributedDataParallel / Float16Module: the model is ``.module``."""
    return type(model).__module__.startswith("megatron.") and type(model).__name__ in (
        "DistributedDataParallel",
        "TorchFullyShardedDataParallel",
        "Float16Module",
    )


def clean_name(name: str) -> str:
    """A parameter name without wrapper parts."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
