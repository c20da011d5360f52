"""Hugging Face Trainer integration: ``Trainer(callbacks=[TrainvitalsCallback()])``.

The callback attaches a :class:`~trainvitals.hooks.Monitor` to the Trainer's model
and optimizer when training begins, with zero-code loss accounting (every token's
loss weight read from the gradient at the LM head's output: no change to the loss,
docs/integrations.md), and closes it when training ends. Gradient accumulation needs
nothing: a step is an optimizer step. The monitor's state is saved into each
checkpoint folder and restored when training resumes from one. Under DDP every rank
attaches; rank 0 sends.

Modality tags come from a batch field (``modality_field``), removed from the inputs
before the model's forward; keep it through the Trainer's column pruning with
``TrainingArguments(label_names=["labels", "modality"])`` (or
``remove_unused_columns=False``). Packed rows (``DataCollatorWithFlattening``) are
split into their samples by what the model is passed: restarting ``position_ids``,
the flash kwargs' ``cu_seq_lens_q``, or ``seq_idx``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError(
        "trainvitals.hooks.transformers needs transformers (and accelerate, for its Trainer): "
        "pip install 'trainvitals[integrations]' (or pip install transformers accelerate)"
    ) from exc

from trainvitals.hooks import integrations_rl
from trainvitals.hooks.attach import build_monitor
from trainvitals.hooks.integration_support import (
    run_name,
    state_file,
    torch_optimizer,
)
from trainvitals.hooks.integrations_distill import distillation_watch, find_trainer
from trainvitals.hooks.job_monitor import Monitor
from trainvitals.hooks.logits_finder import AUTO
from trainvitals.hooks.naming import unwrap

__all__ = ["TrainvitalsCallback"]

log = logging.getLogger("trainvitals")


def _log_first(callback: Any) -> None:
    """Put ``callback`` first among the Trainer's callbacks, so the figures it adds to the
    logs in ``on_log`` reach the ``report_to`` integrations, which the Trainer puts before
    the callbacks the user passes. The handler is the caller of ``on_train_begin`` (the
    Trainer passes no reference to it); where it cannot be found the figures still reach
    ``state.log_history`` and the callbacks after this one, and a line says so."""
    import sys

    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(2)  # _log_first <- on_train_begin <- CallbackHandler.call_event
    handler = frame.f_locals.get("self") if frame is not None else None
    if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
        handler.callbacks.remove(callback)
        handler.callbacks.insert(0, callback)
    else:
        log.info("trainvitals: cannot put the callback before the report_to integrations; they miss its figures")


class TrainvitalsCallback(TrainerCallback):
    """Training-health monitoring for a ``transformers.Trainer``.

    ``run``: the run name (default: ``args.run_name``, else the output folder's
    name). ``collector``: a collector URL (default: ``$TRAINVITALS_COLLECTOR``, else a
    JSONL file ``./trainvitals-<run>.jsonl``); or ``sink=``. ``every`` (default
    ``$TRAINVITALS_EVERY``, else 10): report every N
    optimizer steps. ``modalities``: names of the integer codes found in the batch
    field ``modality_field`` (one per sample [B], or per token [B, T]).
    ``loss_from_logits``: zero-code loss accounting ("auto", the default: find the LM
    head, and say why it is off when there is none; True: find it or raise; a module
    name; False: off). Other keywords go to :func:`~trainvitals.hooks.attach` (e.g.
    ``rules="default"``, ``loss_normalization="token"``). ``monitor`` is the attached
    :class:`~trainvitals.hooks.Monitor` while training runs.
    """

    def __init__(
        self,
        run: str | None = None,
        collector: str | None = None,
        every: int | None = None,
        *,
        modalities: Sequence[str] = (),
        modality_field: str | None = None,
        loss_from_logits: Any = AUTO,
        **options: Any,
    ) -> None:
        if modality_field is not None and not modalities:
            raise ValueError(
                "TrainvitalsCallback: modality_field needs modalities=('text', 'image', ...), "
                "the names of its integer codes"
            )
        self.run = run
        self.collector = collector
        self.every = every
        self.modalities = tuple(modalities)
        self.modality_field = modality_field
        self.loss_from_logits = loss_from_logits
        self.options = options
        self.monitor: Monitor | None = None
        self._pre_hook: Any = None
        self._objective_seam: integrations_rl.PolicyLossSeam | None = None
        self._distill: Any = None

    # -- Trainer events ---------------------------------------------------------------
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        self._close()  # a second train() on the same Trainer
        _log_first(self)
        if model is None or optimizer is None:
            raise ValueError("TrainvitalsCallback: the Trainer passed no model or optimizer to on_train_begin")
        name = run_name(
            self.run, args.run_name, os.path.basename(os.path.normpath(str(args.output_dir))), default="hf-trainer"
        )
        opts = dict(self.options)
        # TRL's RL and preference trainers: the objective is read for what it is (their
        # policy loss, or withheld), never from the head's gradient as a cross-entropy.
        trainer = integrations_rl.find_trainer() if self.loss_from_logits else None  # False: no loss accounting
        objective = integrations_rl.identify(trainer) if trainer is not None else None
        # TRL's distillation trainers: a divergence, not a cross-entropy (withheld, said
        # why); both models' distributions are observed at the loss's temperature.
        self._distill = distillation_watch(find_trainer(model)) if objective is None else None
        from_logits = self.loss_from_logits if objective is None and self._distill is None else False
        if from_logits or objective is not None or self._distill is not None:
            opts["loss_from_logits"] = from_logits
        self.monitor = build_monitor(
            model,
            torch_optimizer(optimizer),
            run=name,
            collector=self.collector,
            every=self.every,
            modalities=self.modalities,
            scaler=getattr(optimizer, "scaler", None),
            **opts,
        )
        if objective is not None:
            self._objective_seam = integrations_rl.install(self.monitor, trainer, objective)
        if self._distill is not None:
            self._distill.install(self.monitor)
        log.info("trainvitals: %s", self.monitor.start_line())
        if from_logits:
            self._pre_hook = unwrap(model).register_forward_pre_hook(self._tag_inputs, with_kwargs=True)
        if state.global_step > 0:
            self._restore(args, state)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Add the latest report's headline figures (and the alerts the job's rules see
        firing) to the Trainer's logs: every ``report_to`` backend records them."""
        if self.monitor is None or logs is None:
            return
        latest = self.monitor.headline()
        if latest is not None:
            logs.update(latest[1])

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        try:
            os.makedirs(folder, exist_ok=True)
            torch.save(self.monitor.state_dict(), state_file(folder, self.monitor.rank))
        except OSError as exc:
            log.warning("trainvitals: could not save the monitor's state into %s: %s", folder, exc)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    # -- internals -----------------------------------------------------------------------
    def _tag_inputs(self, module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        monitor = self.monitor
        if monitor is None:
            return None
        modality = None
        if self.modality_field is not None and self.modality_field in kwargs:
            kwargs = dict(kwargs)
            modality = kwargs.pop(self.modality_field)  # never reaches the model's forward
        # Packed rows' samples are read by zero-code accounting from the forward's own
        # arguments (position ids, cu_seq_lens, seq_idx: trainvitals.hooks.signals.packing).
        if modality is not None and monitor.reads_logits:
            monitor.tag_batch(modality=modality)
        return args, kwargs

    def _restore(self, args: Any, state: Any) -> None:
        assert self.monitor is not None
        path = state_file(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), self.monitor.rank)
        if not os.path.isfile(path):
            log.warning(
                "trainvitals: resuming at step %d without the monitor's state (%s not found): step "
                "numbers continue from the Trainer's, drift references start afresh",
                state.global_step,
                path,
            )
            self.monitor.step = state.global_step
            return
        self.monitor.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    def _close(self) -> None:
        if self._objective_seam is not None:
            self._objective_seam.remove()
            self._objective_seam = None
        if self._distill is not None:
            self._distill.remove()  # kept, like the monitor: what it observed stays readable
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        if self.monitor is not None:
            self.monitor.close()  # kept: its latest report stays readable after training
