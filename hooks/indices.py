"""Index tensors on the device, made once per distinct content.

Signals select and bin with index tensors whose content is known on the host (which
parameters have a series, which group each belongs to). Making such a tensor from
Python numbers at every report is a blocking host-to-device copy on a GPU; the cache
makes it once and hands the same tensor out while the content stays the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["IndexCache"]


class IndexCache:
    """Device tensors keyed by their content (a tuple of Python numbers)."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._tensors: dict[tuple[tuple[float, ...], torch.device, torch.dtype], torch.Tensor] = {}

    def get(
        self, values: Sequence[int] | Sequence[float], device: torch.device, dtype: torch.dtype = torch.long
    ) -> torch.Tensor:
        """The tensor holding ``values`` on ``device``: made on the first call only."""
        key = (tuple(values), device, dtype)
        cached = self._tensors.get(key)
        if cached is None:
            if len(self._tensors) >= self.max_entries:
                self._tensors.clear()  # layouts changed many times: start over
            cached = self._tensors[key] = torch.tensor(key[0], dtype=dtype).to(device)
        return cached

    def clear(self) -> None:
        self._tensors.clear()
