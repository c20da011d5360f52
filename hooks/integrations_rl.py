"""TRL's RL and preference trainers: the objective identified before its figures are trusted.

The zero-code seams read a token's weight as minus the gradient at its log-probability
(or from the logits' gradient). For a policy gradient that gradient is weight x
advantage: signed, zero-mean per group, no normalization weight at all; for a
preference loss (DPO and kin) it is a difference of two sequences' terms. So on TRL's
trainers the objective is identified from the trainer itself, and:

- ``GRPOTrainer`` (every ``loss_type``) and ``RLOOTrainer``: the weights are read apart
  from the advantages, at the trainer's own policy-loss tensor. Each micro-batch's
  ``compute_loss`` runs (on report steps only) under a torch function mode that follows
  what is computed from ``inputs["advantages"]``: the first such tensor that requires
  grad and is reduced (``sum``/``mean``) is the per-token policy loss (GRPO's
  ``per_token_loss * mask``, [B, T]) or the per-sequence one (RLOO's, [B]). It goes to
  ``track_loss``, so the gradient at it, read during the job's own backward, is
  ``dL / dl``: exactly the normalization weights, with the trainer's division by the
  accumulation steps (and a subclass's missing one) in it. Nothing in TRL is patched:
  the trainer object's ``compute_loss`` is wrapped while the monitor is attached.
- What each stock loss type intends is known (:data:`INTENT`): ``grpo`` and ``sapo``
  average each sequence over its own tokens and ``bnpo`` each micro-batch over its own
  (per-sample / per-micro-batch intent, declared ``normalization="sample"``: no spread
  fault); ``dapo``, ``cispo``, ``vespo`` normalize over the generation batch's tokens
  (per token); ``dr_grpo`` divides by a constant (``max_completion_length``) and
  ``luspo`` scales each sequence by its length on purpose: their weight mass is not
  a normalization check, so their loss figures are withheld (coverage
  ``objective_scaled``). A loss type this release does not know is withheld likewise.
  A subclass with its own ``compute_loss`` / ``_compute_loss`` is read as it is, no
  intent assumed: the write-up's DAPO, a micro-batch mean not divided by the
  accumulation steps, reads mass N.
- Preference trainers (``DPOTrainer``, ``KTOTrainer``, ``CPOTrainer``,
  ``ORPOTrainer``, ``OnlineDPOTrainer``): loss figures withheld, coverage
  ``not_cross_entropy``, never a cross-entropy weight mass.

Nothing here raises into the training loop: a failure is logged once and the original
``compute_loss`` result is always what the trainer gets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from trainvitals.hooks.integration_support import find_trainer

__all__ = ["INTENT", "Objective", "PolicyLossSeam", "find_trainer", "identify", "install"]

log = logging.getLogger("trainvitals")

RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
PREFERENCE_TRAINERS = ("DPOTrainer", "KTOTrainer", "CPOTrainer", "ORPOTrainer", "OnlineDPOTrainer")

INTENT: dict[str, str | None] = {
    "grpo": "sample",  # each sequence averaged over its own tokens
    "sapo": "sample",
    "bnpo": "sample",  # each micro-batch averaged over its own tokens: a mean of means by design
    "dapo": None,  # over the generation batch's tokens: per token
    "cispo": None,
    "vespo": None,
}
"""Stock ``GRPOTrainer`` loss types whose weights are read, with the normalization each
intends (declared to loss accounting; None: per token, the default)."""

SCALED: dict[str, str] = {
    "dr_grpo": "divides by a constant completion length (max_completion_length), so its weight mass is the "
    "share of completion slots filled, not a normalization check",
    "luspo": "scales each sequence's loss by its length on purpose, so its weight mass is the mean completion "
    "length, not a normalization check",
}
"""Stock loss types that scale the loss on purpose: their figures are withheld."""


@dataclass(frozen=True)
class Objective:
    """What a trainer's loss is: ``kind`` "policy" (weights read at the policy loss) or
    "preference"; ``normalization`` the intent declared with each micro-batch; ``withheld``
    (coverage reason, detail) when the figures are not reported."""

    trainer: str
    kind: str
    loss_type: str | None = None
    own_loss: bool = False
    normalization: str | None = None
    withheld: tuple[str, str] | None = None

    def describe(self) -> str:
        what = self.trainer + (f" (loss_type {self.loss_type!r})" if self.loss_type else "")
        if self.own_loss:
            what += ", a subclass with its own compute_loss: read as it is"
        return what


def _trl_base(trainer: Any, names: tuple[str, ...]) -> type | None:
    for cls in type(trainer).__mro__:
        if cls.__name__ in names and cls.__module__.startswith("trl."):
            return cls
    return None


def identify(trainer: Any) -> Objective | None:
    """The objective of a TRL RL or preference trainer; None for any other trainer (its
    loss is read by the usual seams)."""
    base = _trl_base(trainer, PREFERENCE_TRAINERS)
    if base is not None:
        return Objective(
            base.__name__,
            "preference",
            withheld=(
                "not_cross_entropy",
                f"{base.__name__}: a preference loss (log-probability ratios of chosen and rejected "
                "sequences), not a cross-entropy: its per-token gradients are not normalization weights",
            ),
        )
    base = _trl_base(trainer, RL_TRAINERS)
    if base is None:
        return None
    cls = type(trainer)
    own = any(getattr(cls, name, None) is not getattr(base, name, None) for name in ("compute_loss", "_compute_loss"))
    if base.__name__ == "RLOOTrainer":
        return Objective(base.__name__, "policy", own_loss=own)
    loss_type = str(getattr(trainer, "loss_type", getattr(getattr(trainer, "args", None), "loss_type", "")))
    if own:
        return Objective(base.__name__, "policy", loss_type, own_loss=True)
    if loss_type in SCALED:
        detail = f"{base.__name__} loss_type {loss_type!r} {SCALED[loss_type]}"
        return Objective(base.__name__, "policy", loss_type, withheld=("objective_scaled", detail))
    if loss_type not in INTENT:
        detail = (
            f"{base.__name__} loss_type {loss_type!r} is not one trainvitals knows the normalization of: "
            "its weight mass would rest on a guess"
        )
        return Objective(base.__name__, "policy", loss_type, withheld=("objective_scaled", detail))
    return Objective(base.__name__, "policy", loss_type, normalization=INTENT[loss_type])


class _FindPolicyLoss(TorchFunctionMode):
    """Follows what is computed from the advantages; ``found``: the first such tensor
    that requires grad and is reduced by ``sum`` or ``mean`` (the policy loss)."""

    def __init__(self, advantages: torch.Tensor) -> None:
        super().__init__()
        self._ids = {id(advantages)}
        self._keep: list[torch.Tensor] = [advantages]  # alive while followed: ids stay unique
        self.found: torch.Tensor | None = None
        self.failed: str = ""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None and not self.failed:
            try:
                self._see(func, args, kwargs or {}, out)
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                self.failed = f"{type(exc).__name__}: {exc}"
        return out

    def _tainted(self, values: Any) -> bool:
        for v in values:
            if isinstance(v, torch.Tensor):
                if id(v) in self._ids:
                    return True
            elif isinstance(v, (list, tuple)):
                if any(isinstance(x, torch.Tensor) and id(x) in self._ids for x in v):
                    return True
        return False

    def _see(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if not (self._tainted(args) or self._tainted(kwargs.values())):
            return
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if (
            name in ("sum", "mean")
            and isinstance(first, torch.Tensor)
            and id(first) in self._ids
            and first.requires_grad
            and first.is_floating_point()
            and torch.is_grad_enabled()
        ):
            self.found = first
            self._ids.clear()
            self._keep.clear()
            return
        outs = out if isinstance(out, (list, tuple)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor):
                self._ids.add(id(t))
                self._keep.append(t)


class PolicyLossSeam:
    """Wraps one trainer object's ``compute_loss`` so that, on report steps, its policy
    loss tensor is handed to ``monitor.track_loss`` (see the module docstring)."""

    def __init__(self, trainer: Any, monitor: Any, objective: Objective) -> None:
        self.trainer = trainer
        self.monitor = monitor
        self.objective = objective
        self._had = "compute_loss" in vars(trainer)
        self._previous = vars(trainer).get("compute_loss")
        self._original = trainer.compute_loss
        self._missing = False

        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            finder = self._finder(inputs)
            if finder is None:
                return self._original(model, inputs, *args, **kwargs)
            with finder:
                result = self._original(model, inputs, *args, **kwargs)
            self._track(finder, inputs)
            return result

        self._wrapper = compute_loss
        trainer.compute_loss = compute_loss

    def remove(self) -> None:
        """Give the trainer its ``compute_loss`` back."""
        if vars(self.trainer).get("compute_loss") is not self._wrapper:
            return  # replaced since: leave what is there
        if self._had:
            self.trainer.compute_loss = self._previous
        else:
            del self.trainer.compute_loss

    def _finder(self, inputs: Any) -> _FindPolicyLoss | None:
        try:
            monitor = self.monitor
            if not torch.is_grad_enabled() or not monitor.reporting_next:
                return None
            if not getattr(self.trainer.model, "training", True):
                return None
            advantages = inputs.get("advantages") if hasattr(inputs, "get") else None
            if not isinstance(advantages, torch.Tensor):
                return None
            return _FindPolicyLoss(advantages)
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self.monitor.warn_once("rl_seam_error", "trainvitals: the policy-loss seam failed: %s", exc)
            return None

    def _track(self, finder: _FindPolicyLoss, inputs: Any) -> None:
        monitor = self.monitor
        try:
            loss = finder.found
            mask = _mask(loss, inputs) if loss is not None else None
            if loss is None or mask is False:
                self._missing = True
                why = finder.failed or (
                    "no tensor computed from the advantages was reduced by sum() or mean() with a gradient"
                    if loss is None
                    else f"the policy loss has shape {tuple(loss.shape)}, not the completions' "
                    f"{tuple(getattr(inputs.get('completion_mask'), 'shape', ()))}"
                )
                monitor.coverage.set_inactive(
                    "loss", "no_input", f"{self.objective.describe()}: its policy loss was not found ({why})"
                )
                monitor.warn_once(
                    "rl_seam_missing",
                    "trainvitals: %s: the policy loss was not found: %s",
                    self.objective.describe(),
                    why,
                )
                return
            if self._missing:
                self._missing = False
                monitor.coverage.clear("loss")
            monitor.track_loss(
                loss, mask=mask if isinstance(mask, torch.Tensor) else None, normalization=self.objective.normalization
            )
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            monitor.warn_once(
                "rl_seam_error", "trainvitals: the policy-loss seam failed: %s: %s", type(exc).__name__, exc
            )


def _mask(loss: torch.Tensor, inputs: Any) -> torch.Tensor | bool | None:
    """The label-token mask for the policy loss: the completion mask (times the tool
    mask) for a per-token loss [B, T]; None for a per-sequence loss [B]; False when the
    shape matches neither."""
    completion = inputs.get("completion_mask")
    if loss.dim() == 1 and isinstance(completion, torch.Tensor) and loss.shape[0] == completion.shape[0]:
        return None
    if not isinstance(completion, torch.Tensor) or tuple(loss.shape) != tuple(completion.shape):
        return False
    with torch.no_grad():
        mask = completion.bool()
        tool = inputs.get("tool_mask")
        if isinstance(tool, torch.Tensor) and tool.shape == completion.shape:
            mask = mask & tool.bool()
    return mask


def install(monitor: Any, trainer: Any, objective: Objective | None = None) -> PolicyLossSeam | None:
    """Set ``monitor`` up for ``trainer``'s objective: withheld figures declared in its
    coverage, or the policy-loss seam (returned: ``remove()`` it at the end)."""
    objective = objective or identify(trainer)
    if objective is None:
        return None
    if objective.withheld is not None:
        monitor.coverage.set_inactive("loss", *objective.withheld)
        log.info("trainvitals: %s: loss figures withheld: %s", objective.describe(), objective.withheld[1])
        return None
    log.info(
        "trainvitals: %s: loss weights read at its policy loss, apart from the advantages%s",
        objective.describe(),
        f" (normalization {objective.normalization!r} intended)" if objective.normalization else "",
    )
    return PolicyLossSeam(trainer, monitor, objective)
