"""The global gradient norm before clipping, on every step (docs/signals.md,
"Optimizer step").

Clipping rewrites the gradients in place before ``optimizer.step()``: a 50x spike
clipped to 1.0 reads 1.0 there. So the norm is taken when the step's backward has
finished accumulating, before the user's code sees the gradients: a post-accumulate
hook on each parameter queues one autograd end-of-backward callback per backward,
and that callback queues itself once more so it runs after the callbacks DDP and
FSDP queue during the backward (their gradient reductions are done by then).

With gradient accumulation only the step's last backward holds its whole gradient:
the callback counts the step's backward passes and computes from the count the
previous step had (a step with more computes again on each extra one and keeps the
last; a shorter step, the last of an epoch, is measured after ``optimizer.step()``,
after any clipping). The per-parameter norms of that computation are the report
step's :class:`~trainvitals.hooks.grad_norms.GradNorms`, handed to every signal that
uses them (per-group norms, relative gradient RMS): no second pass over the
gradients. After ``optimizer.step()`` the value (a 0-d tensor on the device) joins
those of the steps since the previous report, stacked at the report.
At the report: the last step's norm, the max and the mean over the steps since the
previous report (non-finite steps left out of both and counted), so a spike on any
step reaches the next report without a host sync. Cost: one pass over the gradients
per optimizer step (``NormPlan``: small tensors of one shape normed together, the
others by a foreach norm); with a GradScaler the norm is unscaled by its scale
tensor. Per parameter tensor, every backward pays one hook call into Python and one
``.grad`` read, about 3 us together on the development CPU
(``tests/benchmarks/bench_tensors.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.param_series import groups_key
from trainvitals.hooks.tensors import NormPlan, local, real

log = logging.getLogger("trainvitals")


def _queue_callback() -> Any:
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    return getattr(engine, "queue_callback", None)


class BackwardGradNorms:
    """Squared global gradient norm at the end of every backward, kept per step.

    Owned by :class:`~trainvitals.hooks.signals.optimizer.stats.OptimizerStats`,
    which calls :meth:`bind`, :meth:`end_step` and :meth:`take`.
    """

    def __init__(self, signal: Signal) -> None:
        self._signal = signal  # failures turn it off
        self._queue = _queue_callback()
        self._handles: list[Removable] = []
        self._params: list[torch.Tensor] = []
        self._plain = True  # see _hook_params
        # NormPlan.cached's slot; its key: the params with a grad (None: all of them)
        self._plan: list[Any] = [None]
        self._weight_of: tuple[tuple[Any, ...] | None, list[torch.Tensor], torch.Tensor] | None = None
        self._key: tuple[Any, ...] | None = None
        self._queued = False
        self._monitor: MonitorView | None = None
        self._current: torch.Tensor | None = None  # this step's squared norm so far
        # and per parameter, with each one's share of the sums over ranks (None: all 1)
        self._per_param: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None] | None = None
        self._backwards = 0  # backward passes seen in the current step
        self._expected = 1  # ... in the previous step: the one that completes the gradient
        self._since: list[torch.Tensor] = []  # the squared norms of the steps since the last take()
        # A kept vector of one report interval's squared norms, step k of the interval
        # written into element k (its 0-d views): a full interval is taken without a
        # stack. The vector goes out at the report and is written again from the next step.
        self._buf: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []

    @property
    def available(self) -> bool:
        return self._queue is not None

    def bind(self, monitor: MonitorView) -> None:
        self._monitor = monitor
        if self.available:
            self._hook_params(monitor)

    def _hook_params(self, monitor: MonitorView) -> None:
        self.remove()
        self._key = groups_key(monitor)
        seen: set[int] = set()
        for _, group in monitor.groups():
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self._params.append(p)
                    self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        # no DTensor shard to unwrap and no complex gradient to view as pairs: the
        # gradients go to the norm as they are (no Python call per tensor)
        self._plain = not any(
            p.is_complex() or isinstance(getattr(p, "_local_tensor", None), torch.Tensor) for p in self._params
        )
        self._plan = [None]

    # -- during the user's backward ---------------------------------------------
    def _accumulated(self, _param: torch.Tensor) -> None:
        if self._queued or self._signal.broken:
            return
        self._queued = True
        with self._signal.guard("the gradient-norm hook"):
            # Queued now, it would run before the DDP/FSDP reductions queued later in this
            # backward; so it queues the real work once more, to run after them.
            self._queue(lambda: self._queue(self._end_of_backward))

    def _end_of_backward(self) -> None:
        self._queued = False
        self._backwards += 1
        if self._backwards < self._expected:
            return  # an earlier micro-batch: its gradient is not the step's yet
        self._measure()

    def _measure(self) -> None:
        monitor = self._monitor
        if monitor is None or self._signal.broken:
            return
        with self._signal.guard("the end-of-backward gradient norm"):
            # one .grad read per parameter (each costs about a microsecond)
            grads: list[Any] = [p.grad for p in self._params]
            if any(g is None for g in grads):  # some parameters got no gradient in this step (`in` would call ==)
                params = [p for p, g in zip(self._params, grads, strict=True) if g is not None]
                grads = [g for g in grads if g is not None]
                key: tuple[int, ...] | None = tuple(map(id, params))
            else:
                params, key = self._params, None
            if not params:
                return
            if not self._plain:
                grads = [real(local(g)) for g in grads]
            # rebuilt when the set or the shapes change (a parameter's .data replaced)
            norms = NormPlan.cached(self._plan, key, grads, monitor.device)
            scale = self._scale(monitor)
            if scale is not None:
                norms = norms / scale
            weights = self._weights(monitor, params, key) if monitor.weighted else None
            self._per_param = (params, norms, weights)
            self._current = self._squared(norms, max(1, monitor.config.every), weights)

    def _weights(self, monitor: MonitorView, params: list[torch.Tensor], key: tuple[Any, ...] | None) -> torch.Tensor:
        """Each parameter's share of the sums over ranks (replicated pieces count 1 / k),
        kept while the parameters with a gradient stay the same."""
        kept = self._weight_of
        if kept is None or kept[0] != key or kept[1] is not self._params:
            w = torch.tensor([monitor.weight_of(p) for p in params], dtype=torch.float32).to(monitor.device)
            kept = self._weight_of = (key, self._params, w)
        return kept[2]

    def _squared(self, norms: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The squared norm of ``norms`` (each square times its weight when given), in
        this step's element of the kept vector when it has one (no step since the last
        take holds that element)."""
        other = norms if weights is None else norms * weights
        k = len(self._since)
        if k >= size or norms.requires_grad:
            return torch.dot(norms, other)
        buf = self._buf
        if buf is None or buf.numel() != size or buf.dtype != norms.dtype or buf.device != norms.device:
            buf = self._buf = torch.empty(size, dtype=norms.dtype, device=norms.device)
            self._slots = list(buf.unbind())
        return torch.dot(norms, other, out=self._slots[k])

    def fresh(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None] | None:
        """This step's per-parameter gradient norms (unscaled, before clipping) and their
        shares of the sums over ranks (None: all 1), once the backward that completes the
        step's gradient has run; else None."""
        if self._current is None or self._backwards < self._expected:
            return None
        return self._per_param

    @staticmethod
    def _scale(monitor: MonitorView) -> torch.Tensor | None:
        scaler = monitor.scaler
        if scaler is None or (getattr(scaler, "is_enabled", None) and not scaler.is_enabled()):
            return None
        scale = getattr(scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return None
        return scale.detach().reshape(()).to(monitor.device, torch.float32, non_blocking=True)

    # -- around the optimizer step ------------------------------------------------
    def end_step(self, monitor: MonitorView) -> None:
        """After ``optimizer.step()``: the step's value joins those since the previous
        report (a list of 0-d tensors: no op per step, no host sync)."""
        if not self.available:
            return
        if groups_key(monitor) != self._key:
            self._hook_params(monitor)  # parameters added or replaced: hook the new ones
        if self._backwards and self._current is None:
            self._measure()  # fewer backward passes than the step before: measure now
        if self._backwards:
            self._expected = self._backwards
        self._backwards = 0
        self._per_param = None
        current, self._current = self._current, None
        if current is None:
            return
        self._since.append(current)
        size = max(1, monitor.config.every)
        if len(self._since) > size:  # the last report interval's worth
            del self._since[:-size]

    def take(self) -> torch.Tensor | None:
        """The squared norms of the steps since the previous take (oldest first), or None."""
        if not self._since:
            return None
        if len(self._since) == len(self._slots) and all(t is s for t, s in zip(self._since, self._slots, strict=True)):
            self._since = []
            return self._buf  # every step of the interval in its element: no stack
        first = self._since[0].device
        if all(t.device == first for t in self._since):
            values = torch.stack(self._since)
        else:
            values = torch.stack([t.to(first) for t in self._since])
        self._since = []
        return values

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._params = []  # a new list: the last step's per-parameter norms may hold the old one

    def reset(self) -> None:
        self._current = self._per_param = None
        self._since = []
        self._backwards = 0
