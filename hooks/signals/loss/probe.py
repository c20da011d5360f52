"""Exact per-modality gradients in parameter space, every ``probe_every`` steps (opt-in).

On a probe step the per-token loss hook of ``track_loss`` receives the weights
``w_it = dL/dl_it`` while the user's backward is running and before anything below
the per-token loss has run, so that part of the graph is still intact. There, for
each modality m, one extra backward runs from the per-token loss to the
parameters::

    g_m += torch.autograd.grad(per_token, params, grad_outputs=w * [token in m],
                               retain_graph=True)

``g_m = sum_{it in m} w_it dl_it/dtheta`` is exactly the part of the step's
gradient that modality m's label tokens contribute (summed over the step's
micro-batches); the user's backward then continues on the retained graph.
Reported: ``modality_grad_norm{modality, scope="params"}`` = ||g_m|| (in the unit
of ``loss_weight_mass``: divided by the world size, or by ``loss_scale`` with
``loss_reduction="sum"``), and ``modality_grad_cosine{modality, other}`` =
<g_m, g_k> / (||g_m|| ||g_k||) for every ordered pair of modalities.

Cost, on probe steps only: M extra backward passes from the loss to the
parameters (about M times the backward of the micro-batch), M float32 gradient
buffers of the model's size, and under data parallelism one ``all_reduce`` of
those buffers (the global g_m is the mean over ranks, as DDP averages). Other
steps pay nothing.

Limits: the probe's backward passes run inside the user's, so backward hooks in
the model (other than trainvitals') see them too. Turned off, with a warning,
where parameters are sharded (FSDP, DTensor): their gradients only exist after
FSDP's own reduce-scatter. Not tested with activation checkpointing or with DDP's
``find_unused_parameters`` / ``static_graph``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from trainvitals.hooks import distributed
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.step import StepContext
from trainvitals.wire.signals import SignalSpec


class ModalityProbe:
    spec: ClassVar[SignalSpec] = SignalSpec(
        name="probe",
        covers="the per-modality gradient probe, probe_every",
        how_to_ask="attach(probe_every=N) is off",
    )
    """Its declaration: the probe runs inside the loss accounting, not as a signal of its own."""

    def __init__(self, monitor: MonitorView) -> None:
        every = monitor.config.probe_every
        assert every is not None  # a probe is only built when probe_every is set
        self.every: int = every
        self.modalities = len(monitor.modalities)
        self._last_period = -1
        self.supported = not monitor.sharded and not any(
            type(m).__name__ == "FullyShardedDataParallel" for m in monitor.model.modules()
        )
        if not self.supported:
            monitor.warn_once(
                "probe_sharded",
                "probe_every is not supported with sharded parameters "
                "(FSDP/DTensor); the per-modality parameter probe is off",
            )

    def due(self, monitor: MonitorView, step: int) -> bool:
        """Whether optimizer step ``step`` is a probe step: the first report step of each
        window of ``probe_every`` steps (so the rate holds whatever ``every`` is)."""
        return self.supported and monitor.reports_at(step) and step // self.every > self._last_period

    @staticmethod
    def _params(monitor: MonitorView) -> list[torch.Tensor]:
        seen: set[int] = set()
        out = []
        for _, group in monitor.groups():
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def accumulate(
        self,
        buf: torch.Tensor | None,
        per_token: torch.Tensor,
        grad: torch.Tensor,
        masks: torch.Tensor,
        inv_scale: torch.Tensor | None,
        monitor: MonitorView,
    ) -> torch.Tensor:
        """Add this micro-batch's per-modality parameter gradients into ``buf`` [M, P].
        Called from the per-token loss hook, during the user's backward."""
        params = self._params(monitor)
        if buf is None:
            total = sum(p.numel() for p in params)
            buf = torch.zeros(self.modalities, total, dtype=torch.float32, device=monitor.device)
        offsets = []
        off = 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        grad = grad.detach()
        for m in range(self.modalities):
            grads = torch.autograd.grad(
                per_token, params, grad_outputs=grad * masks[m].view_as(grad), retain_graph=True, allow_unused=True
            )
            dst, src = [], []
            for p, o, g in zip(params, offsets, grads, strict=True):
                if g is not None:
                    dst.append(buf[m, o : o + p.numel()])
                    src.append(g.reshape(-1).to(buf.device, torch.float32))
            if not dst:
                continue
            if inv_scale is not None:
                torch._foreach_mul_(src, inv_scale.to(buf.device, torch.float32))
            torch._foreach_add_(dst, src)
        return buf

    def gram(self, monitor: MonitorView, buf: torch.Tensor | None, step: int) -> torch.Tensor | None:
        """<g_m, g_k> for all pairs, [M, M] float64; combined over ranks first. All ranks
        call it on the same steps (the collective must line up); None where this rank
        has nothing to report."""
        self._last_period = step // self.every
        if monitor.world_size > 1:
            import torch.distributed as dist

            ran = buf is not None
            if buf is None:
                total = sum(p.numel() for p in self._params(monitor))
                buf = torch.zeros(self.modalities, total, dtype=torch.float32, device=monitor.device)
            dist.all_reduce(buf)
            distributed.handed(buf)
            return (buf @ buf.T).double() if ran else None
        return None if buf is None else (buf @ buf.T).double()

    def emit(self, ctx: StepContext, gram: torch.Tensor, names: list[str], scale: float | torch.Tensor) -> None:
        norms = gram.diagonal().clamp_min(0).sqrt()
        ctx.emit(
            "modality_grad_norm",
            norms / (scale.to(norms.dtype) if isinstance(scale, torch.Tensor) else scale),
            [{"modality": n, "scope": "params"} for n in names],
        )
        pairs = [(i, j) for i in range(len(names)) for j in range(len(names)) if i != j]
        if not pairs:
            return
        # Built on the host and copied without waiting (a tensor made on the device would).
        rows = torch.tensor([i for i, _ in pairs]).to(gram.device, non_blocking=True)
        cols = torch.tensor([j for _, j in pairs]).to(gram.device, non_blocking=True)
        cos = gram[rows, cols] / (norms[rows] * norms[cols])
        ctx.emit(
            "modality_grad_cosine",
            cos,
            [{"modality": names[i], "other": names[j]} for i, j in pairs],
            present=((norms[rows] > 0) & (norms[cols] > 0)).float(),
        )
