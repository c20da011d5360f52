"""Loss accounting's events and log-once warnings about a reported step's values: mixed
and unknown modality codes, a declared modality on no label token, a non-finite loss,
a gradient that is not a plain cross-entropy one (zero-code accounting's gate). Apart
from the figures (:mod:`~trainvitals.hooks.signals.loss.report`), whose emitter
:class:`~trainvitals.hooks.signals.loss.report.LossReport` these methods belong to."""

from __future__ import annotations

from typing import Any

import torch

from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.signals.loss.accumulated import Snapshot
from trainvitals.hooks.signals.loss.labels import ModalityLabels
from trainvitals.hooks.signals.loss.layout import SumsLayout
from trainvitals.hooks.signals.loss.plan import Plan
from trainvitals.hooks.step import StepContext

__all__ = ["LossEvents"]


class LossEvents:
    """The events and late warnings of :class:`~trainvitals.hooks.signals.loss.report.LossReport`."""

    _layout: SumsLayout
    _warnings: dict[tuple[Any, ...], tuple[tuple[tuple[str, str], ...], list[int]]]

    def _late_warnings(
        self, monitor: MonitorView | Snapshot, nonfinite: bool, zero_code: bool
    ) -> tuple[tuple[tuple[str, str], ...], list[int]]:
        """The log-once warnings about this rank's values (read a step later, no host
        sync): (key, message) pairs and where each count lies in the sums, in the order
        of ``Plan.warn_counts``; made once per set of modalities and flags."""
        key = (tuple(monitor.modalities), nonfinite, zero_code)
        found = self._warnings.get(key)
        if found is None:
            if len(self._warnings) >= 16:
                self._warnings.clear()
            warnings = self._warning_list(monitor, nonfinite, zero_code)
            found = self._warnings[key] = (tuple((k, msg) for k, msg, _ in warnings), [at for _, _, at in warnings])
        return found

    def _warning_list(
        self, monitor: MonitorView | Snapshot, nonfinite: bool, zero_code: bool
    ) -> list[tuple[str, str, int]]:
        lay = self._layout
        warnings = [
            (
                "loss_mixed_modality",
                "%d sample(s) mix modalities among their label tokens; each counts under the "
                "highest code. Pass one modality per sample (or per label token of it).",
                lay.mixed,
            ),
            (
                "loss_unknown_modality",
                f"%d label token(s) carry a modality code outside 0..{lay.bins - 2} "
                f"(attach(modalities={list(monitor.modalities)})); they count toward totals only",
                lay.unknown,
            ),
        ]
        if zero_code:
            warnings.append(
                (
                    "loss_not_cross_entropy",
                    "loss_from_logits: %d micro-batch(es) of a reported step had a loss that is not a "
                    "plain cross-entropy (signed per-token weights: a policy gradient's advantages or a "
                    "preference loss; or, at the logits, label smoothing, a distillation or z-loss term, "
                    "logit soft-capping after the hooked module); their token weights cannot be read from "
                    "the gradient, so that step's loss-accounting figures are left out. Use track_loss "
                    "with the per-token cross-entropy (docs/integrations.md)",
                    lay.not_ce,
                )
            )
            warnings.append(
                (
                    "loss_logits_overwritten",
                    "loss_from_logits: %d micro-batch(es) of a reported step had their logits overwritten "
                    "in place between the forward and the backward (a fused cross-entropy that reuses the "
                    "logits' memory, as Megatron's on float32 logits); the logits' values are gone, so the "
                    "token weights cannot be read from their gradient and that step's loss-accounting "
                    "figures are left out",
                    lay.overwritten,
                )
            )
        if nonfinite:
            warnings.append(
                (
                    "loss_nonfinite",
                    "%d micro-batch(es) had a non-finite per-token loss on a label token",
                    lay.nonfinite,
                )
            )
        return warnings

    def _zero_code_gate(
        self, ctx: StepContext, plan: Plan, first: tuple[torch.Tensor, ...], verdict: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """Zero-code accounting: the coverage verdicts on the gradient read, and the gate
        every figure is present under (only where the weights are sound)."""
        # Weights read from a gradient that is not a plain cross-entropy one are wrong:
        # say so (_warn_late's log line, the coverage) and leave the step's figures out.
        ctx.inactive_when(
            "loss",
            first[plan.overwritten],
            "logits_overwritten",
            "the logits were overwritten in place between the forward and the backward (a fused "
            "cross-entropy reusing their memory); the step's figures are left out",
        )
        ctx.inactive_when(
            "loss",
            first[plan.not_ce],
            "not_cross_entropy",
            "the loss is not a plain cross-entropy: signed per-token weights (a policy gradient's "
            "advantages, a preference loss) at the per-token log-probabilities or losses, or a logits "
            "gradient with label smoothing, a distillation or z-loss term, soft-capping after the head; "
            "the step's figures are left out",
        )
        return verdict[plan.gate]

    def _emit_events(
        self,
        monitor: MonitorView | Snapshot,
        ctx: StepContext,
        plan: Plan,
        first: tuple[torch.Tensor, ...],
        verdicts: torch.Tensor,
        verdict: tuple[torch.Tensor, ...],
        labels: ModalityLabels,
        zero_code: bool,
        withheld: str,
    ) -> None:
        """The step's events and late warnings about the modality codes and the loss
        (``withheld``: the samples are not known, so nothing is said about them)."""
        # Mixed and unknown codes, a gradient that is not cross-entropy (their counts);
        # then a declared modality that marks positions only of samples without label
        # tokens (positions where its label tokens are 0): no sample of it carries loss,
        # so it reads as absent.
        events: list[tuple[str, str, dict[str, str] | None, torch.Tensor]] = [
            (
                "loss_sample_mixed_modality",
                "samples whose label tokens mix modalities (counted under the highest code)",
                None,
                first[plan.mixed],
            ),
            (
                "loss_unknown_modality_code",
                "label tokens with a modality code outside attach(modalities=...)",
                None,
                first[plan.unknown],
            ),
        ]
        if zero_code:
            events.append(
                (
                    "loss_not_cross_entropy",
                    "loss_from_logits: a micro-batch's loss is not a plain cross-entropy (signed per-token "
                    "weights, or a logits gradient of another loss); "
                    "this step's loss-accounting figures are left out (docs/integrations.md)",
                    None,
                    first[plan.not_ce],
                )
            )
        if not withheld:
            events.extend(
                (kind, detail, labs, verdict[plan.flags + i])
                for i, (kind, detail, labs) in enumerate(labels.unlabelled)
            )
        for kind, detail, labs, flag in events:
            ctx.event(kind, detail, labs, when=flag)
        if withheld:
            return
        ctx.warn_when(
            [
                (
                    "loss_modality_without_labels",
                    "%d declared modality(ies) mark positions only of samples without label tokens, so they "
                    "read as absent from the shares (docs/signals.md, 'Loss accounting')",
                )
            ],
            verdicts,
            monitor.warn_once,
            positive_from=plan.flags_at,
        )
