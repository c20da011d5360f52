"""``trainvitals demo``: incident I1 live, on the CPU, in under a minute.

A tiny two-modality model trains first with the bug (per-token loss normalization
over a batch of long text samples and short image answers: the image samples get
~17x less gradient than their share), then with the fix (per-sample normalization),
reporting to a collector the caller started in-process. The live signals are
printed, and the GradientDilution alert is seen firing and then resolving. The
command, which starts the collector, is :mod:`trainvitals.monitor.cli_demo`'s: this
package imports the hooks only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import torch

# The batch of incident I1 (docs/incidents.md), scaled down 10x in length: 84% text samples with
# 400 label tokens, 16% image samples with 20 (the same 20:1 length ratio).
TEXT_SAMPLES, IMAGE_SAMPLES, TEXT_TOKENS, IMAGE_TOKENS = 21, 4, 400, 20
VOCAB, DIM = 64, 32


@dataclass
class Phase:
    name: str
    normalization: str  # "per-token" (the bug) or "per-sample" (the fix)


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    b = TEXT_SAMPLES + IMAGE_SAMPLES
    ids = torch.randint(0, VOCAB, (b, TEXT_TOKENS), generator=gen)
    labels = (ids * 7 + 3) % VOCAB  # a learnable mapping
    mask = torch.zeros(b, TEXT_TOKENS, dtype=torch.bool)
    mask[:TEXT_SAMPLES] = True
    mask[TEXT_SAMPLES:, :IMAGE_TOKENS] = True
    modality = torch.tensor([0] * TEXT_SAMPLES + [1] * IMAGE_SAMPLES)
    return ids, labels, mask, modality


def _loss(per_token: torch.Tensor, mask: torch.Tensor, normalization: str) -> torch.Tensor:
    per_token = per_token * mask
    if normalization == "per-token":  # divide by all label tokens: long samples dominate
        return per_token.sum() / mask.sum()
    return (per_token.sum(1) / mask.sum(1)).mean()  # mean of sample means: every sample counts once


def run_demo(
    *, steps: int, collector: AbstractContextManager[str], serve: bool, echo: Callable[[str], None] = click.echo
) -> dict[str, Any]:
    """Run both phases against the collector ``collector`` starts (a context manager
    giving its URL, stopped at the end); return what happened (for tests)."""
    import httpx
    import torch
    import torch.nn.functional as F
    from torch import nn

    from trainvitals.hooks import attach

    torch.set_num_threads(1)
    result: dict[str, Any] = {"fired_at": None, "resolved_at": None, "rows": []}
    with collector as url:
        echo(f"collector: {url}  (metrics: {url}/metrics, alerts: {url}/v1/alerts)")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        client = httpx.Client(base_url=url, timeout=5)
        # rules="off": the collector judges; the demo prints what it says as a table
        with attach(model, opt, run="demo", collector=url, modalities=("text", "image"), every=1, rules="off") as mon:
            header = f"{'step':>5} {'phase':<24} {'loss':>7} {'image grad share':>17} {'dilution':>9}  alert"
            global_step = 0
            for phase in (
                Phase("bug: per-token loss", "per-token"),
                Phase("fix: per-sample loss", "per-sample"),
            ):
                echo("")
                echo(f"== {phase.name} ==")
                echo(header)
                for i in range(steps):
                    ids, labels, mask, modality = _batch(gen)
                    logits = model(ids)
                    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(
                        labels
                    )
                    mon.track_loss(per_token, modality=modality, mask=mask, output=logits)
                    torch.autograd.backward(_loss(per_token, mask, phase.normalization))
                    opt.step()
                    opt.zero_grad()
                    global_step += 1
                    if i % 5 == 4 or i == steps - 1:
                        mon.flush(5)
                        alerts = [a for a in client.get("/v1/alerts").json() if a["alertname"] == "GradientDilution"]
                        state = alerts[0]["state"] if alerts else "inactive"
                        if state == "firing" and result["fired_at"] is None:
                            result["fired_at"] = global_step
                        if state == "resolved" and result["fired_at"] and result["resolved_at"] is None:
                            result["resolved_at"] = global_step
                        share = mon.value("modality_grad_share_ratio", modality="image")
                        dil = mon.value("modality_dilution_ratio", modality="image")
                        loss = mon.value("loss")
                        row = (global_step, phase.name, loss, share, dil, state)
                        result["rows"].append(row)
                        echo(
                            f"{global_step:>5} {phase.name:<24} {_fmt(loss, '7.3f')} "
                            f"{_fmt(share and share * 100, '16.2f')}% {_fmt(dil, '8.1f')}x  {state}"
                        )
        others = sorted({a["alertname"] for a in client.get("/v1/alerts").json()} - {"GradientDilution"})
        result["other_alerts"] = others
        client.close()
        echo("")
        if result["fired_at"]:
            echo(
                f"GradientDilution fired by step {result['fired_at']}: image samples got "
                f"~{result['rows'][len(result['rows']) // 2 - 1][4]:.0f}x less gradient than their share."
            )
        if result["resolved_at"]:
            echo(f"... and resolved by step {result['resolved_at']} once the loss was normalized per sample.")
        if others:
            echo(f"Other alerts seen: {', '.join(others)} (see {url}/v1/alerts).")
        pages = (
            f"  {url}/            the runs, their state and alerts\n"
            f"  {url}/runs/demo   this run: verdict, incident timeline, the signals behind each alert\n"
            f"  {url}/v1/alerts   the alerts as JSON\n"
            f"  {url}/metrics     what Prometheus scrapes"
        )
        result["pages"] = [f"{url}/", f"{url}/runs/demo", f"{url}/v1/alerts", f"{url}/metrics"]
        if serve:
            echo(f"\nOpen these pages while the demo's collector stays up (Ctrl-C to stop):\n{pages}")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                echo("bye")
        else:
            echo(
                "\nThe demo's collector stops now (--no-serve). Without --no-serve it stays up with these pages:\n"
                + pages.replace(url, "http://127.0.0.1:PORT")
            )
    return result


def _fmt(v: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return format(v, spec) if v is not None else "-".rjust(width)
