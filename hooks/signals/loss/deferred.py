"""Loss accounting: the per-micro-batch sums a reported step leaves to its report.

On one rank a reported step's figures are made on the sender thread from the host
copy of the step's sums (:mod:`~trainvitals.hooks.signals.loss.report`). The tensor
hooks then need not finish their per-sample sums on the training thread either: a
hook makes the reduction over its tokens (the pass only it can make, on the
gradient it is handed) and keeps the small per-sample results here
(:func:`~trainvitals.hooks.signals.loss.binning.weight_rows`,
:func:`~trainvitals.hooks.signals.loss.binning.output_norms`); the report hands them
to the sender thread with the sums, where the same functions finish them and add
them in the order the hooks ran. The figures are the same: these entries of the sums
(the weights per bin, the exponent fit, the masses, the output norms) are written by
the hooks alone, and the extremes combine by their maximum.

A step keeps at most :data:`MAX_ENTRIES` micro-batch results and :data:`MAX_NUMEL`
elements; at the first result past that, what it kept is added into its sums on the
training thread and its hooks add their own from then on, as on several ranks, so the
sums add in the same order either way. On a CPU the figures are the same bit for bit;
on a GPU the sender thread's CPU sums may differ from the device's kernels in the last
bits.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from trainvitals.hooks.signals.loss.binning import output_finish, weight_finish
from trainvitals.hooks.signals.loss.layout import SumsLayout

__all__ = ["MAX_ENTRIES", "MAX_NUMEL", "Deferred", "Entries", "add_weights"]

MAX_ENTRIES = 32
"""Micro-batch results a step keeps for its report (weights and output norms each count)."""
MAX_NUMEL = 1 << 18
"""Elements a step keeps for its report (2 MB of float64): what the report copies."""


def add_weights(
    layout: SumsLayout, sums: torch.Tensor, extremes: torch.Tensor, slot: int, values: torch.Tensor, ext: torch.Tensor
) -> None:
    """Add ``weight_finish``'s values of objective ``slot`` into ``sums``, and its
    extremes into the objective's (each by its maximum)."""
    sums.index_add_(0, layout.weight_targets(slot, sums.device), values)
    extremes.scatter_reduce_(0, layout.extreme_targets(slot, sums.device), ext, "amax")


Entries = tuple[tuple[tuple[Any, ...], int, list[tuple[int, ...]]], ...]
"""Per kept result: what finishes it (kind and arguments), where its tensors start in
the flat list, their shapes."""


class Deferred:
    """A reported step's kept micro-batch results, open until :meth:`close` hands them
    over once (to the report, or back to the training thread when the step keeps no
    more). Keeping and closing take a lock: the hooks of a model on several devices run
    on several autograd threads, and a result must be added exactly once."""

    def __init__(self) -> None:
        self._kept: list[tuple[tuple[Any, ...], list[torch.Tensor]]] = []  # what finishes it, its tensors
        self.numel = 0
        self._open = True
        self._lock = threading.Lock()

    def weights(
        self,
        slot: int,
        w_s: torch.Tensor,
        top: list[torch.Tensor],
        log_n: torch.Tensor,
        s_bin: torch.Tensor,
        rows_as_samples: bool,
        rtol: float,
    ) -> bool:
        """Keep ``weight_rows``' results of a micro-batch of objective ``slot`` with
        its samples' ``log_n`` and bins; False (nothing kept) when the step keeps no more."""
        return self._keep(("weights", slot, rows_as_samples, rtol), [w_s, *top, log_n, s_bin])

    def outputs(
        self, norms: torch.Tensor, bins: torch.Tensor, rows: tuple[int, int] | None, inv_scale: torch.Tensor | None
    ) -> bool:
        """Keep ``output_norms``' per-token norms with their bins (per row when ``rows``)
        and the ``GradScaler``'s inverse scale read at hook time; False as ``weights``."""
        if inv_scale is None:
            return self._keep(("outputs", rows, False), [norms, bins])
        return self._keep(("outputs", rows, True), [norms, inv_scale, bins])

    def fits(self, numel: int) -> bool:
        """Whether one more result of ``numel`` elements would be kept now (a hint,
        before its work: :meth:`weights` and :meth:`outputs` decide)."""
        return self._open and len(self._kept) < MAX_ENTRIES and self.numel + numel <= MAX_NUMEL

    def _keep(self, head: tuple[Any, ...], tensors: list[torch.Tensor]) -> bool:
        n = sum(t.numel() for t in tensors)
        with self._lock:
            if not self._open or len(self._kept) >= MAX_ENTRIES or self.numel + n > MAX_NUMEL:
                return False
            self._kept.append((head, tensors))
            self.numel += n
            return True

    def close(self) -> tuple[Entries, list[torch.Tensor]] | None:
        """What the step kept, once (None after the first call; nothing is kept after
        it): the entries for :meth:`apply` and the flat list of tensors."""
        with self._lock:
            if not self._open:
                return None
            self._open = False
            kept, self._kept = self._kept, []
        entries = []
        tensors: list[torch.Tensor] = []
        for head, mine in kept:
            entries.append((head, len(tensors), [tuple(t.shape) for t in mine]))
            tensors.extend(mine)
        return tuple(entries), tensors

    @staticmethod
    def apply(
        layout: SumsLayout,
        entries: Entries,
        tensors: list[torch.Tensor],
        sums: torch.Tensor,
        extremes: torch.Tensor,
    ) -> None:
        """Finish the kept results and add them into ``sums`` and ``extremes``, in
        order. ``tensors``: the kept ones, or their host copies (flat; the bins in the
        report's float when it was packed on a GPU)."""
        for head, start, shapes in entries:
            parts = [
                t if tuple(t.shape) == shape else t.reshape(shape)
                for t, shape in zip(tensors[start : start + len(shapes)], shapes, strict=True)
            ]
            bins = parts[-1] if parts[-1].dtype == torch.long else parts[-1].long()
            if head[0] == "weights":
                _, slot, rows_as_samples, rtol = head
                w_s, *top, log_n = parts[:-1]
                values, ext = weight_finish(layout, w_s, top, layout.fit_rows(log_n), bins, rows_as_samples, rtol)
                add_weights(layout, sums, extremes, slot, values, ext)
            else:
                _, rows, scaled = head
                output_finish(sums[layout.output], parts[0], bins, rows, parts[1] if scaled else None)
