"""A registration's undo handle (the store's ``on_ingest``, the exposition's family sources)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["RemovableHandle"]


class RemovableHandle:
    """Undo a registration with :meth:`remove` (like ``torch.utils.hooks``)."""

    __slots__ = ("_remove",)

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Callable[[], None] | None = remove

    def remove(self) -> None:
        """Remove the registration; a second call does nothing."""
        fn, self._remove = self._remove, None
        if fn is not None:
            fn()
