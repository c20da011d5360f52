"""The boundary-leak signal (``packing``): do the samples packed into one row see each
other?

A packed row must reach the attention with its sample boundaries: a block-diagonal
mask, or varlen kernels given the cumulative lengths. Otherwise sample B attends to
sample A before it in the row, and both its outputs and its gradient depend on A.
Nothing in the loss curve shows it. Two ways to tell, both on report steps only:

- **Static signs** (every report step whose first micro-batch carries boundaries,
  :mod:`.boundaries`), each the way a Hugging Face model is known to drop them
  (transformers builds its block-diagonal mask from restarting ``position_ids`` only
  when ``attention_mask`` is None and no cache is used; only the flash kernels read
  ``cu_seq_lens``):

  - ``mask_beside_positions``: restarting position ids beside a 2-D attention mask
    (an all-ones mask included): the mask is taken as given;
  - ``varlen_ignored``: cumulative lengths (``cu_seq_lens_q``...) without position
    ids, under an attention implementation other than flash (sdpa, eager): ignored;
  - ``cache_in_training``: packed position ids while the model will use a cache
    (``use_cache`` passed or in its config): the mask is not built.

  Reported as ``packing_leak_sign{cause} = 1`` where the micro-batch's rows do hold
  several samples (a device flag, no host sync), and a log line once.
- **The probe** (``packing_probe_every``, default 1000 steps; first at the first
  report step showing packed rows): the first micro-batch of the step is kept (a
  reference to its arguments), and before the optimizer step (the weights its forward
  saw) it is forwarded twice more, under ``no_grad``, off the training graph, in eval
  mode, with the RNG state forked and the modules' train/eval flags put back: as
  given, and with the first sample of its row holding the most samples changed (each
  token id ``t`` replaced by ``(t + 1) % vocab``, or ``(t + 2) % vocab`` where that is
  the model's image/video token; those tokens themselves are kept). ``packing_leak_logit_change{cause}``
  is the largest absolute change of the logits at that row's other samples'
  positions: 0 when the boundaries hold, the leak's size otherwise; ``cause`` names
  the static sign seen (``unknown`` when none). Cost: two forward passes of one
  micro-batch per probe (docs/benchmarks.md); the probe step reads a few numbers on
  the host (which row, whether any row is packed); other steps, none.

The probe is skipped, said once in the log, where it cannot run safely: sharded
parameters across ranks (a forward on one rank would wait on the others' gathers),
a cache object passed to the forward (the probe would write into it), no input ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainvitals.hooks.logits_finder import expected_vocab, find_head, logits_of
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.loss.modality import input_ids, model_media_tokens
from trainvitals.hooks.signals.packing.boundaries import read_boundaries
from trainvitals.hooks.step import StepContext
from trainvitals.wire.signals import SignalSpec

__all__ = ["CAUSES", "PackingLeak", "packed_starts", "static_causes"]

CAUSES = {
    "mask_beside_positions": "restarting position_ids beside a 2-D attention_mask (transformers builds the "
    "block-diagonal mask only when attention_mask is None): pass no attention_mask with packed position ids",
    "varlen_ignored": "cu_seq_lens without position_ids under an attention that ignores them (only the flash "
    "kernels read them): use attn_implementation='flash_attention_2', or pass restarting position_ids too",
    "cache_in_training": "packed position ids while the model uses a cache (use_cache=True; transformers builds "
    "no block-diagonal mask then): pass use_cache=False in training",
}
"""Each static sign and what to do about it (the log line, docs/signals.md)."""

CACHE_FIELDS = ("past_key_values", "cache")
"""Forward keywords holding a cache object the probe must not write into."""


def _attn_implementation(model: Any) -> str:
    config = getattr(model, "config", None)
    found = getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", None)
    return str(found) if found else ""


def static_causes(model: Any, kwargs: dict[str, Any], source: str) -> list[str]:
    """The static signs of a forward (see the module docstring), from its keywords and
    the model's config only (no tensor value is read): each a way the boundaries read
    from ``source`` are known not to reach a Hugging Face model's attention."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    flash = "flash" in _attn_implementation(model)
    causes = []
    if source == "position_ids":
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not flash:
            causes.append("mask_beside_positions")
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(config, "use_cache", False)
        if (use_cache is True or any(kwargs.get(k) is not None for k in CACHE_FIELDS)) and not flash:
            causes.append("cache_in_training")
    elif source.startswith("cu_seq") and kwargs.get("position_ids") is None and not flash:
        if _attn_implementation(model):  # a transformers model: its non-flash kernels take no lengths
            causes.append("varlen_ignored")
    return causes


def packed_starts(segments: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    """``[B, T - 1]``: true where a new sample starts after the position, between two
    positions the attention mask (when a 2-D one of the same shape is given) keeps: pads
    around a row's one sample start none."""
    starts = torch.diff(segments, dim=1) != 0
    if isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape) == tuple(segments.shape):
        real = attention_mask.bool()
        starts = starts & real[:, 1:] & real[:, :-1]
    return starts


@dataclass
class _Kept:
    """The probe's micro-batch: the forward's arguments (references) and where its input
    ids are, its sample ids, and the static signs it showed."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    where: int | str  # the positional index or keyword of the input ids
    ids: torch.Tensor
    starts: torch.Tensor  # [B, T - 1]: a sample starts after this position (packed_starts)
    causes: list[str]


class PackingLeak(Signal):
    """See the module docstring."""

    spec = SignalSpec(
        name="packing",
        covers="packed sequences: samples of one row that see each other",
        how_to_ask="signals= leaves out 'packing'",
        group="packing",
        title="Packed sequences: samples leaking into each other",
        selectable=True,
    )
    covers = spec.name

    def __init__(self) -> None:
        self._monitor: MonitorView | None = None
        self._head: torch.nn.Module | None = None
        self._vocab: int | None = None
        self._media_tokens: tuple[int, ...] = ()
        self._probing = False  # the probe's own forwards run: the pre-hook does nothing
        self._next_probe = 1  # the first step at which a probe may be tried
        self._kept: _Kept | None = None
        self._signs: list[tuple[str, torch.Tensor]] = []  # this report step's (cause, packed flag)
        self._density: torch.Tensor | None = None  # [1]: true samples per row of the step's first micro-batch
        self._measured: tuple[str, torch.Tensor] | None = None  # the probe's (cause, change)

    def bind(self, monitor: MonitorView) -> list[Removable]:
        self._monitor = monitor
        model = monitor.model
        self._head = find_head(model).head
        if self._head is not None:
            self._vocab = expected_vocab(model, self._head)
        self._media_tokens = tuple(model_media_tokens(model).values())
        return [model.register_forward_pre_hook(self._pre, with_kwargs=True)]

    # -- the forward pre-hook: static signs, and the probe's micro-batch -----------------
    def _pre(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        mon = self._monitor
        if mon is None or self._probing or self.broken or not torch.is_grad_enabled() or not mon.reporting_next:
            return
        if self._signs or self._kept is not None:
            return  # the step's first micro-batch speaks for it
        with self.guard("the packing forward pre-hook"):
            self._look(mon, module, args, kwargs)

    def _look(self, mon: MonitorView, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = input_ids(args, kwargs)
        shape = None if ids is None else (int(ids.shape[0]), int(ids.shape[1]))
        bounds = read_boundaries(kwargs, shape)
        if bounds is None or bounds.segments is None:
            return
        seg = bounds.segments
        starts = packed_starts(seg, kwargs.get("attention_mask"))
        packed = starts.any()  # some row holds several samples (on the device)
        causes = static_causes(module, kwargs, bounds.source)
        self._signs = [(c, packed) for c in causes] or [("", packed)]
        self._density = (starts.sum(1).float() + 1).mean().reshape(1)
        every = mon.config.packing_probe_every
        if ids is None or every is None or mon.step + 1 < self._next_probe:
            return
        kept_ids: torch.Tensor = ids
        where: int | str = "input_ids"
        if kwargs.get("input_ids") is not kept_ids:
            where = next(i for i, a in enumerate(args) if a is kept_ids)
        self._kept = _Kept(tuple(args), dict(kwargs), where, kept_ids, starts, causes)

    # -- the probe, before the optimizer step --------------------------------------------
    def before_step(self, monitor: MonitorView, reporting: bool) -> None:
        kept, self._kept = self._kept, None
        if kept is None or not reporting:
            return
        every = monitor.config.packing_probe_every
        self._next_probe = monitor.step + 1 + (every or 1)
        why = self._cannot_probe(monitor, kept)
        if why:
            monitor.warn_once("packing_probe_skipped", "packing: the boundary-leak probe is skipped: %s", why)
            return
        self._measured = self._probe(monitor, kept)

    def _cannot_probe(self, monitor: MonitorView, kept: _Kept) -> str:
        if monitor.sharded and monitor.world_size > 1:
            return "parameters are sharded across ranks (a forward on one rank would wait on the others)"
        if any(kept.kwargs.get(k) is not None for k in CACHE_FIELDS):
            return "a cache object is passed to the forward (the probe would write into it)"
        if self._vocab is None:
            return "the vocabulary size is not known (no LM head found)"
        return ""

    def _probe(self, monitor: MonitorView, kept: _Kept) -> tuple[str, torch.Tensor] | None:
        """The leak of one micro-batch (module docstring); None where no row holds two
        samples. Reads on the host which row holds the most samples."""
        counts = kept.starts.sum(1)
        if int(counts.max()) < 1:  # host reads: probe steps only
            return None
        row = int(counts.argmax())
        end = int(kept.starts[row].nonzero()[0])  # the row's first sample ends here
        positions = torch.arange(kept.ids.shape[1], device=kept.ids.device)
        first = positions <= end
        ids = kept.ids
        changed = ids.clone()
        assert self._vocab is not None
        changed[row] = torch.where(first & ~self._media(ids[row]), self._replace(ids[row]), ids[row])
        kwargs = {k: v for k, v in kept.kwargs.items() if k not in ("labels", "num_items_in_batch")}
        plain = self._forward(monitor, kept.args, kwargs)
        args, kw = kept.args, dict(kwargs)
        if isinstance(kept.where, int):
            args = (*args[: kept.where], changed, *args[kept.where + 1 :])
        else:
            kw[kept.where] = changed
        other = self._forward(monitor, args, kw)
        if plain is None or other is None:
            monitor.warn_once(
                "packing_probe_no_logits",
                "packing: the boundary-leak probe got no logits [B, T, V] from the model's forward (a fused "
                "head that never calls the LM head); only the static signs are reported",
            )
            return None
        a, b = plain[row], other[row]
        later = ~first
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(kept.ids.shape):
            later &= mask[row].bool()
        change = (a.float() - b.float()).abs().amax(dim=-1).masked_fill(~later, 0.0).amax()
        return (kept.causes[0] if kept.causes else "unknown"), change

    def _media(self, ids: torch.Tensor) -> torch.Tensor:
        """Where ``ids`` hold an image/video token (kept as they are: a VLM matches them
        to its image features)."""
        tokens = list(self._media_tokens)
        if not tokens:
            return torch.zeros_like(ids, dtype=torch.bool)
        return torch.isin(ids, torch.tensor(tokens, device=ids.device))

    def _replace(self, ids: torch.Tensor) -> torch.Tensor:
        """``(t + 1) % vocab`` for each token id, ``(t + 2) % vocab`` where that is a media token."""
        assert self._vocab is not None
        new = (ids + 1) % self._vocab
        return torch.where(self._media(new), (ids + 2) % self._vocab, new)

    def _forward(self, monitor: MonitorView, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The logits [B, T, V] of one forward in eval mode, without gradients; the
        modules' modes and the RNG state are put back."""
        model = monitor.model
        captured: list[torch.Tensor] = []
        handle = None
        if self._head is not None:
            handle = self._head.register_forward_hook(lambda m, a, out: captured.append(out))
        modes = [(m, m.training) for m in model.modules()]
        devices = [monitor.device] if monitor.device.type == "cuda" else []
        self._probing = True
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                model.eval()
                output = model(*args, **kwargs)
        finally:
            self._probing = False
            for m, mode in modes:
                m.training = mode
            if handle is not None:
                handle.remove()
        logits = logits_of(captured[-1]) if captured else logits_of(output)
        if logits is None or logits.dim() != 3:
            return None
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and tuple(logits.shape[:2]) == tuple(ids.shape[::-1]):
            logits = logits.transpose(0, 1)  # sequence-first (Megatron)
        return logits

    # -- the report -------------------------------------------------------------------------
    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        signs, self._signs = self._signs, []
        density, self._density = self._density, None
        measured, self._measured = self._measured, None
        # Coverage: active only where a packed row was checked (its density is the figure
        # that says so); an unpacked job has nothing to check, which is not a blind spot.
        if not signs or density is None:
            ctx.inactive_when(
                "packing", None, "not_packed", "no micro-batch with sample boundaries reached the model's forward"
            )
        else:
            packed = signs[0][1]
            ctx.inactive_when(
                "packing",
                (~packed).float(),
                "not_packed",
                "no row of the step's first micro-batch holds several samples",
            )
            ctx.emit("packing_samples_per_row", density, present=packed.float())
        named = [(c, flag) for c, flag in signs if c]
        if named:
            flags = torch.stack([flag for _, flag in named]).float()
            ctx.emit("packing_leak_sign", torch.ones_like(flags), [{"cause": c} for c, _ in named], present=flags)
            ctx.warn_when(
                [(f"packing_sign_{c}", f"packing: packed rows may see each other: {CAUSES[c]}") for c, _ in named],
                flags,
                _log_count(monitor),
            )
        if measured is not None:
            cause, change = measured
            ctx.emit("packing_leak_logit_change", change.reshape(1), [{"cause": cause}])

    def reset(self) -> None:
        self._kept = None
        self._signs = []
        self._measured = None


def _log_count(monitor: MonitorView) -> Any:
    """``warn_when``'s callback: the message once per key (its count is a flag here)."""

    def warn(key: str, message: str, count: Any) -> None:
        monitor.warn_once(key, message)

    return warn
