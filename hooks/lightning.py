"""PyTorch Lightning integration: ``Trainer(callbacks=[TrainvitalsCallback()])``.

Lightning ships under two import names, ``lightning`` (``lightning.pytorch``) and
``pytorch_lightning``; the callback is built on whichever is installed (the first
when both are: its callbacks run under a ``pytorch_lightning.Trainer`` too).

The callback attaches a :class:`~trainvitals.hooks.Monitor` to the LightningModule
and its optimizer when training starts, with zero-code loss accounting (every
token's loss weight read from the gradient at the LM head's output,
docs/integrations.md), and closes it when training ends.

Lightning runs the last micro-batch's forward and backward of a step inside
``optimizer.step(closure)``, after the optimizer's pre-step hooks: the monitor is
attached with ``step_boundary="manual"`` and the step's gradients are declared final
at ``on_before_optimizer_step`` (after the closure, before Lightning clips them), so a
step with ``accumulate_grad_batches`` > 1 is accounted whole. The monitor's state
rides in Lightning's checkpoints (the callback's ``state_dict``). Under DDP every rank
attaches; rank 0 sends.

Each report's headline figures (:mod:`trainvitals.hooks.headline`: a handful per signal,
named as on ``/metrics``, and the alerts firing in the job) go to the Trainer's loggers
(TensorBoard, wandb, MLflow, CSV ...) at the report's step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # only the older import name is installed
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError(
            "trainvitals.hooks.lightning needs Lightning: pip install 'trainvitals[integrations]' "
            "(or pip install lightning)"
        ) from exc

from trainvitals.hooks.attach import attach
from trainvitals.hooks.integration_support import batch_value, run_name, torch_optimizer
from trainvitals.hooks.job_monitor import Monitor
from trainvitals.hooks.logits_finder import AUTO

__all__ = ["TrainvitalsCallback"]

Field = str | Callable[[Any], Any] | None


class TrainvitalsCallback(Callback):
    """Training-health monitoring for a ``lightning.pytorch.Trainer`` (or a
    ``pytorch_lightning.Trainer``).

    ``run``: the run name (default: the logger's ``name/version``, else
    ``"lightning"``). ``collector``: a collector URL (default:
    ``$TRAINVITALS_COLLECTOR``, else a JSONL file ``./trainvitals-<run>.jsonl``); or
    ``sink=``. ``every``: report every N optimizer steps (default
    ``$TRAINVITALS_EVERY``, else 10). ``modalities``: names of the
    integer codes that ``modality`` finds in each batch: a key of a dict batch, an
    attribute, or a function of the batch returning codes [B] or [B, T]; ``segments``
    likewise for packed rows' sample ids [B, T]. ``loss_from_logits``: zero-code loss
    accounting ("auto", the default: find the LM head, and say why it is off when there
    is none; True: find it or raise; a module name; False: off). Other keywords go
    to :func:`~trainvitals.hooks.attach`. ``monitor`` is the attached
    :class:`~trainvitals.hooks.Monitor` once training starts.
    """

    def __init__(
        self,
        run: str | None = None,
        collector: str | None = None,
        every: int | None = None,
        *,
        modalities: Sequence[str] = (),
        modality: Field = None,
        segments: Field = None,
        loss_from_logits: Any = AUTO,
        **options: Any,
    ) -> None:
        if modality is not None and not modalities:
            raise ValueError(
                "TrainvitalsCallback: modality needs modalities=('text', 'image', ...), the names of its integer codes"
            )
        if "step_boundary" in options:
            raise TypeError("TrainvitalsCallback sets step_boundary itself (Lightning steps with a closure)")
        self.run = run
        self.collector = collector
        self.every = every
        self.modalities = tuple(modalities)
        self.modality = modality
        self.segments = segments
        self.loss_from_logits = loss_from_logits
        self.options = options
        self.monitor: Monitor | None = None
        self._saved: dict[str, Any] | None = None
        self._logged_step = -1

    # -- Lightning hooks -------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"TrainvitalsCallback watches one optimizer; this Trainer has "
                f"{len(trainer.optimizers)} (attach() a monitor per optimizer by hand)"
            )
        logger = trainer.logger
        name = run_name(
            self.run, f"{logger.name}/{logger.version}" if logger is not None else None, default="lightning"
        )
        opts = dict(self.options)
        if self.loss_from_logits:
            opts["loss_from_logits"] = self.loss_from_logits
        self.monitor = attach(
            pl_module,
            torch_optimizer(trainer.optimizers[0]),
            run=name,
            collector=self.collector,
            every=self.every,
            modalities=self.modalities,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            step_boundary="manual",
            **opts,
        )
        if self._saved is not None:
            self.monitor.load_state_dict(self._saved)
            self._saved = None
        elif trainer.global_step > 0:
            self.monitor.step = trainer.global_step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is None or not self.monitor.reads_logits:
            return
        modality = batch_value(batch, self.modality)
        segments = batch_value(batch, self.segments)
        if modality is not None or segments is not None:
            self.monitor.tag_batch(modality=modality, segments=segments)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is not None:
            self.monitor.gradients_ready()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log_headline(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()  # kept: its latest report stays readable after training
            self._log_headline(trainer)

    def _log_headline(self, trainer: Any) -> None:
        """A report's headline figures not logged yet go to the module's loggers, at its step."""
        latest = self.monitor.headline() if self.monitor is not None else None
        if latest is None or latest[0] <= self._logged_step:
            return
        self._logged_step = latest[0]
        for logger in trainer.loggers:
            logger.log_metrics(latest[1], step=latest[0])

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor.state_dict()} if self.monitor is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("monitor")
        if saved is None:
            return
        if self.monitor is not None:
            self.monitor.load_state_dict(saved)
        else:
            self._saved = saved
