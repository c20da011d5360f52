"""The labels and event texts of loss accounting's per-modality figures, made once per
set of modality names and shared by the report's figures and its events."""

from __future__ import annotations

__all__ = ["ROW_FIGURES", "ModalityLabels"]

ROW_FIGURES = ("modality_loss", "modality_sample_share_ratio", "modality_token_share_ratio")
"""The per-modality figures that lie end to end in one part of the report's ratios."""


class ModalityLabels:
    """The labels and event texts of a report's per-modality figures, made once per
    modality names (never written: the report's samples and events refer to them)."""

    def __init__(self, names: list[str]) -> None:
        self.modality: list[dict[str, str]] = [{"modality": n} for n in names]
        self.rows = [(name, self.modality) for name in ROW_FIGURES]
        self.output = [{"modality": n, "scope": "output"} for n in names]
        self.unlabelled = [
            (
                "modality_without_label_tokens",
                f"modality {name!r} marks positions only of samples without label tokens: none of its "
                "samples carries loss (docs/signals.md, 'Loss accounting')",
                {"modality": name},
            )
            for name in names
        ]
