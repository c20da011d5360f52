"""ParamDrift judges drift on a scale that matters: a zero-initialised attention key bias,
whose true gradient is exactly zero (softmax ignores a constant added to every key), is
nudged by AdamW to a size orders of magnitude below the model's other 1D parameters. Its
figure is measured against its neighbours' scale, not its own tiny one, and it does not page."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support import one_torch_thread
from trainvitals.alerts import Engine, resolve_rules
from trainvitals.alerts.state import AlertState
from trainvitals.hooks import attach
from trainvitals.hooks.signals.params.drift import NEIGHBOUR_FLOOR
from trainvitals.wire.schema import Report

V, D, STEPS = 64, 32, 80


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        nn.init.zeros_(self.k_proj.bias)  # as many attention implementations initialise it
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        scores = self.q_proj(x) @ self.k_proj(x).transpose(1, 2) / math.sqrt(D)
        return self.head(self.norm(x + torch.softmax(scores, -1) @ self.v_proj(x)))


def _drift(x: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    """The plain definition: bits the largest move from the reference amounts to on ``scale``."""
    return math.log2(1 + (x - ref).abs().max().item() / scale)


def test_a_zero_initialised_gradient_free_key_bias_under_adamw_does_not_page(tmp_path):
    torch.manual_seed(0)
    model = Attention()
    one_d = {n: p for n, p in model.named_parameters() if p.dim() == 1}
    at_attach = {n: p.detach().clone() for n, p in one_d.items()}
    groups = [
        {"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.01},
        {"params": list(one_d.values()), "weight_decay": 0.0},  # 1D parameters undecayed (Megatron)
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    path = tmp_path / "kbias.jsonl"
    data = torch.Generator().manual_seed(1)
    refs: dict[str, torch.Tensor] = {}
    with one_torch_thread():
        mon = attach(model, opt, run="kbias", sink=f"file:{path}", every=5, rules="off")
        for step in range(1, STEPS + 1):
            ids = torch.randint(0, V, (8, 12), generator=data)
            loss = F.cross_entropy(model(ids).flatten(0, 1), ((ids * 7 + 3) % V).flatten())
            loss.backward()
            # Its true gradient is zero: what reaches it is rounding noise.
            assert model.k_proj.bias.grad.abs().max() < 1e-5 * model.q_proj.bias.grad.abs().max()
            opt.step()
            opt.zero_grad()
            if step == 1:  # the first report: an all-zero reference is taken here
                refs = {
                    n: (at_attach[n] if at_attach[n].abs().max() > 0 else p.detach().clone()) for n, p in one_d.items()
                }
        mon.close()

    reports = [Report.model_validate(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    last = reports[-2]  # the last report before close()'s
    reported = {s.labels["param"]: s.value for s in last.samples if s.name == "param_drift_log2"}

    scales = sorted(r.abs().max().item() for r in refs.values())
    median = torch.tensor([s for s in scales if s > 0]).median().item()  # torch's median: the lower middle
    bias, ref = model.k_proj.bias.detach(), refs["k_proj.bias"]
    assert ref.abs().max() < 1e-3 * median  # orders of magnitude below its neighbours
    own = _drift(bias, ref, ref.abs().max().item())
    fair = _drift(bias, ref, max(ref.abs().max().item(), NEIGHBOUR_FLOOR * median))
    assert own > 2.0  # on its own scale it would read as more than doubling its range, twice over
    assert reported["k_proj.bias"] == pytest.approx(fair, rel=1e-3, abs=1e-4)
    assert fair < 0.5  # below ParamDrift's clear level, far from its 1-bit threshold
    for name in ("q_proj.bias", "norm.weight"):  # parameters of real size: judged on their own scale
        p = one_d[name].detach()
        assert reported[name] == pytest.approx(_drift(p, refs[name], refs[name].abs().max().item()), rel=1e-3, abs=1e-4)

    engine = Engine(resolve_rules("default"))
    fired = [
        t
        for i, r in enumerate(reports)
        for t in engine.observe(r, now=1000.0 + i)
        if t.alertname == "ParamDrift" and t.state is AlertState.FIRING
    ]
    assert fired == []
