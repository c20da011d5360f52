"""TRL's distillation trainers, zero-code: ``DistillationTrainer`` and ``GKDTrainer``
read for what their loss is, through the Hugging Face callback.

Neither loss is a cross-entropy, and neither hands the LM head's logits to the place
zero-code loss accounting reads them: ``DistillationTrainer`` projects the student's
and the teacher's last hidden states through their ``lm_head`` weights inside a fused
divergence kernel (the ``lm_head`` module never runs); ``GKDTrainer`` runs both models
whole and compares their logits with ``generalized_jsd_loss``. So, for both:

- **Loss accounting is withheld**, said as coverage ``not_cross_entropy`` from the
  start (the start line, every report, ``/metrics``, the close line and the verdict):
  a KL / JSD / generalized JSD (``beta``) between two distributions has no per-token
  weight of a cross-entropy to read, and is never reported as a weight mass.
- **Both distributions are observed** (``Monitor.observe_distillation``, docs/signals.md)
  at the temperature the loss uses, with no code in the job and the trainers' code
  untouched: forward hooks on the student and the teacher keep, on report steps only,
  at most ``softmax_max_positions`` rows of each one's output (the backbone's last
  hidden state, projected here through the model's own ``lm_head`` weight, bias,
  logit scale and soft-capping exactly as TRL's kernel does; or ``GKDTrainer``'s
  logits), the same rows of both (a fixed stride, coprime with the sequence length);
  the positions the loss counts are the rows where the student's output gets a
  gradient in the job's own backward (a tensor hook: prompt, padding, tool-output and
  other masked positions get none), so no mask needs to be rebuilt here.

The temperature is the loss's: ``DistillationTrainer`` divides both distributions by
``trainer.temperature`` (``DistillationConfig.temperature``); ``GKDTrainer.compute_loss``
in TRL 1.16 calls ``generalized_jsd_loss`` without a temperature, so its loss compares
the distributions at 1 whatever ``GKDConfig.temperature`` says (that one sets the
sampling temperature of on-policy generation; a line says so when it differs). A
subclass that overrides the method that sets the loss's temperature
(``DistillationTrainer._compute_loss``; ``GKDTrainer.compute_loss`` or
``generalized_jsd_loss``) leaves it unknown: the distributions are then not observed,
and the softmax coverage says why (call ``observe_distillation`` in that method).

Cost: nothing on steps that are not reported (one flag read per forward). On a report
step, per micro-batch: two row gathers of at most ``softmax_max_positions`` rows, two
projections ``[rows, hidden] x [hidden, vocab]`` (``DistillationTrainer``), one
``[rows, vocab]`` gather of the gradient, and the softmax signal's own passes. No host
sync, nothing raised into the training loop (a failure is logged once and the
observation stops).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainvitals.hooks.integration_support import find_trainer
from trainvitals.hooks.naming import unwrap
from trainvitals.hooks.signals.softmax import maths as sm

__all__ = ["DistillationWatch", "distillation_watch", "find_trainer"]

log = logging.getLogger("trainvitals")

_TRAINERS = ("DistillationTrainer", "GKDTrainer")
GKD_LOSS_TEMPERATURE = 1.0
"""``GKDTrainer.compute_loss`` (TRL 1.16) calls ``generalized_jsd_loss`` without ``temperature=``."""
_LOSS_METHODS = {"DistillationTrainer": ("_compute_loss",), "GKDTrainer": ("compute_loss", "generalized_jsd_loss")}
"""The methods whose override leaves the loss's temperature unknown."""


def _trl_base(trainer: Any) -> type | None:
    """TRL's distillation trainer class that ``trainer`` is (or subclasses)."""
    for c in type(trainer).__mro__:
        if c.__name__ in _TRAINERS and c.__module__.startswith("trl."):
            return c
    return None


def divergence_name(beta: float) -> str:
    """TRL's generalized JSD by its ``beta``: 0 forward KL, 1 reverse KL (both trainers)."""
    if beta == 0:
        return "forward KL(teacher || student)"
    if beta == 1:
        return "reverse KL(student || teacher)"
    return f"generalized JSD (beta={beta:g})"


def distillation_watch(trainer: Any) -> DistillationWatch | None:
    """What to watch on ``trainer`` if it is one of TRL's distillation trainers, else None."""
    base = _trl_base(trainer) if trainer is not None else None
    if base is None:
        return None
    name = base.__name__
    beta = float(getattr(trainer, "beta", float("nan")))
    objective = divergence_name(beta)
    problem = None
    temperature: float | None = None
    overridden = [m for m in _LOSS_METHODS[name] if getattr(type(trainer), m, None) is not getattr(base, m, None)]
    if overridden:
        problem = (
            f"{type(trainer).__name__} overrides {name}.{overridden[0]}, which sets the loss's temperature: it "
            "cannot be read; call monitor.observe_distillation(student_logits, teacher_logits, temperature=...) there"
        )
    elif name == "DistillationTrainer":
        temperature = float(trainer.temperature)
    else:
        temperature = GKD_LOSS_TEMPERATURE
        asked = float(getattr(trainer, "temperature", GKD_LOSS_TEMPERATURE))
        if asked != GKD_LOSS_TEMPERATURE:
            log.warning(
                "trainvitals: GKDConfig(temperature=%g) sets the sampling temperature only: GKDTrainer.compute_loss "
                "calls generalized_jsd_loss without it, so the loss compares the distributions at temperature %g "
                "(the one observed); to distill at %g, pass temperature= in a compute_loss of your own",
                asked,
                GKD_LOSS_TEMPERATURE,
                asked,
            )
    student = unwrap(trainer.model)
    teacher = getattr(trainer, "teacher_model", None)
    if problem is None and not isinstance(teacher, nn.Module):
        problem = f"{name} holds no teacher model in this process (teacher_model is {type(teacher).__name__})"
    teacher = unwrap(teacher) if isinstance(teacher, nn.Module) else None
    where = "a fused kernel" if name == "DistillationTrainer" else "generalized_jsd_loss"
    tau = "" if temperature is None else f" at temperature {temperature:g}"
    loss_detail = (
        f"TRL {name}: the loss is the {objective} between the teacher's and the student's distributions{tau} "
        f"(computed in {where}), not a cross-entropy: it has no per-token weights to read"
    )
    watch = DistillationWatch(name, objective, temperature, loss_detail, problem)
    if problem is None and student is not None and teacher is not None:
        try:
            if name == "DistillationTrainer":
                watch.sites(
                    _backbone(trainer, student), _backbone(trainer, teacher), _projection(student), _projection(teacher)
                )
            else:
                watch.sites(student, teacher, None, None)
        except Exception as exc:  # noqa: BLE001 - a model TRL itself could not train either
            watch.problem = f"cannot find where {name} reads the models' outputs: {type(exc).__name__}: {exc}"
    return watch


def _peft_inner(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper, as TRL's ``_get_last_hidden_state`` takes it."""
    if hasattr(model, "peft_config") and hasattr(model, "base_model"):
        return model.base_model.model
    return model


def _backbone(trainer: Any, model: nn.Module) -> Any:
    """The module whose ``last_hidden_state`` ``DistillationTrainer`` projects (its
    ``_get_last_hidden_state``: ``base_model``; ``.model`` for a VLM before transformers 5)."""
    inner = _peft_inner(model)
    if getattr(trainer, "_is_vlm", False):
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version("5.0.0"):
            return inner.model
    backbone = inner.base_model
    if not isinstance(backbone, nn.Module) or backbone is inner:
        raise TypeError(f"{type(inner).__name__} has no separate base_model")
    return backbone


def _projection(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of last hidden states -> the logits ``DistillationTrainer``'s kernel forms from
    them: ``lm_head`` weight and bias, then the config's logit scale (read in TRL's order:
    ``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``, ``logits_scaling``),
    then ``final_logit_softcapping``; in float32."""
    head = model.get_output_embeddings()
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"{type(model).__name__}.get_output_embeddings() has no weight")
    if type(head.weight).__name__ == "DTensor":
        raise TypeError("its lm_head weight is a DTensor (sharded)")
    config = model.config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    for attr in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(config, attr, None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if config.model_type == "hyperclovax" else 1 / scaling
    scale = 1.0 if scale is None else float(scale)
    softcap = getattr(config, "final_logit_softcapping", None)

    def project(rows: torch.Tensor) -> torch.Tensor:
        weight, bias = head.weight, getattr(head, "bias", None)
        z = nn.functional.linear(
            rows.to(weight.device, torch.float32), weight.float(), None if bias is None else bias.float()
        )
        if scale != 1.0:
            z = z * scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        return z

    return project


@dataclass
class _Rows:
    """One micro-batch's kept rows: their flat indices, the student's and (once its
    forward ran) the teacher's logits there."""

    shape: tuple[int, int]
    index: torch.Tensor
    student: torch.Tensor
    teacher: torch.Tensor | None = None


class DistillationWatch:
    """The hooks that observe a TRL distillation trainer's two distributions (module doc)."""

    def __init__(
        self, trainer: str, objective: str, temperature: float | None, loss_detail: str, problem: str | None
    ) -> None:
        self.trainer = trainer
        self.objective = objective
        self.temperature = temperature
        self.loss_detail = loss_detail
        self.problem = problem
        self.observed = 0  # micro-batches handed to observe_distillation
        self._student: nn.Module | None = None
        self._teacher: nn.Module | None = None
        self._projections: tuple[Any, Any] = (None, None)
        self._monitor: Any = None
        self._handles: list[Any] = []
        self._pending: _Rows | None = None
        self._failed = False

    def sites(self, student: nn.Module, teacher: nn.Module, project_student: Any, project_teacher: Any) -> None:
        self._student, self._teacher = student, teacher
        self._projections = (project_student, project_teacher)

    # -- lifecycle -----------------------------------------------------------------------
    def install(self, monitor: Any) -> None:
        """Declare the loss withheld and place the hooks (before the start line is logged)."""
        self._monitor = monitor
        monitor.coverage.set_inactive("loss", "not_cross_entropy", self.loss_detail)
        if self.problem is not None or self._student is None or self._teacher is None:
            problem = self.problem or "no student or teacher model found"
            monitor.coverage.set_inactive("softmax", "not_requested", problem)
            log.warning("trainvitals: %s: the distillation's distributions are not observed: %s", self.trainer, problem)
            return
        self._handles = [
            self._student.register_forward_hook(self._student_forward),
            self._teacher.register_forward_hook(self._teacher_forward),
        ]
        log.info(
            "trainvitals: TRL %s: the teacher's and the student's distributions observed at temperature %g, the "
            "loss's (%s); loss accounting withheld (not a cross-entropy)",
            self.trainer,
            self.temperature,
            self.objective,
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = None
        self._monitor = None

    # -- hooks -----------------------------------------------------------------------------
    def _student_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        monitor = self._monitor
        if monitor is None or self._failed or not monitor.reporting_next:
            return
        if not (torch.is_grad_enabled() and module.training):
            return  # generation, evaluation, a forward outside the loss
        try:
            out = _main_output(output)
            if out is None or not out.requires_grad:
                return
            b, t, width = out.shape
            stride = sm.subsample_stride(b * t, monitor.config.softmax_max_positions, t)
            index = torch.arange(0, b * t, stride, device=out.device)
            rows = out.detach().reshape(b * t, width).index_select(0, index)
            project = self._projections[0]
            self._pending = _Rows((b, t), index, rows if project is None else project(rows))
            out.register_hook(self._gradient_of(self._pending))
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self._fail(exc)

    def _teacher_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        rows = self._pending
        if rows is None or rows.teacher is not None or self._failed:
            return
        try:
            out = _main_output(output)
            if out is None or tuple(out.shape[:2]) != rows.shape:
                return  # not the loss's forward (generation)
            b, t, width = out.shape
            kept = out.detach().reshape(b * t, width).index_select(0, rows.index.to(out.device))
            project = self._projections[1]
            rows.teacher = (kept if project is None else project(kept)).to(rows.student.device)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _gradient_of(self, rows: _Rows) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if rows is not self._pending:
                return
            self._pending = None
            monitor = self._monitor
            if monitor is None or rows.teacher is None or self._failed:
                return
            try:
                with torch.no_grad():
                    g = grad.reshape(-1, grad.shape[-1]).index_select(0, rows.index)
                    counted = (g != 0).any(-1).to(rows.student.device)  # positions the loss counts
                assert self.temperature is not None
                monitor.observe_distillation(rows.student, rows.teacher, temperature=self.temperature, mask=counted)
                self.observed += 1
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

        return hook

    def _fail(self, exc: BaseException) -> None:
        self._failed = True
        self._pending = None
        log.warning(
            "trainvitals: %s: observing the distillation failed and stops: %s: %s",
            self.trainer,
            type(exc).__name__,
            exc,
        )


def _main_output(output: Any) -> torch.Tensor | None:
    """The [B, T, D] tensor a model's forward returns first (last hidden state, logits)."""
    for attr in ("last_hidden_state", "logits"):
        value = getattr(output, attr, None)
        if isinstance(value, torch.Tensor):
            break
    else:
        value = output[0] if isinstance(output, (tuple, list)) and output else output
    if isinstance(value, torch.Tensor) and value.ndim == 3 and value.is_floating_point():
        return value
    return None
