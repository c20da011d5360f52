"""LossNotAccumNormalized tells the on-call what the missing division does to this job's
optimizer, checked against what it does: each job is trained twice from the same start
on the same data, with and without dividing the micro-batch loss by the accumulation
count, and the parameters' movement compared."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.integrations._alerts import read_reports
from tests.support import one_torch_thread
from trainvitals.alerts import Engine, resolve_rules
from trainvitals.hooks import attach
from trainvitals.hooks.optimizer_family import optimizer_family
from trainvitals.wire.schema import Report

N = 4  # micro-batches per optimizer step
STEPS = 50
VOCAB, DIM = 50, 16


def _train(tmp_path, optimizer: str, divide: bool) -> tuple[float, list[dict]]:
    """Parameter movement ||theta_T - theta_0|| after STEPS steps, and the reports."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    path = tmp_path / f"{optimizer}-{divide}.jsonl"
    mon = attach(
        model,
        opt,
        run=f"{optimizer}-{'div' if divide else 'nodiv'}",
        sink=f"file:{path}",
        every=5,
        modalities=("text",),
    )
    data = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for _ in range(N):
            ids = torch.randint(0, VOCAB, (4, 8), generator=data)
            logits = model(ids)
            per_token = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="none")
            per_token = per_token.view_as(ids)
            mon.track_loss(per_token, modality=torch.zeros(4, dtype=torch.long), output=logits)
            loss = per_token.mean()
            (loss / N if divide else loss).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    end = torch.cat([p.detach().flatten() for p in model.parameters()])
    return (end - start).norm().item(), read_reports(path)


def _alerts(reports: list[dict]):
    engine = Engine(resolve_rules("default"))
    for i, r in enumerate(reports):
        if any(e["kind"] == "run_end" for e in r.get("events", [])):
            break  # judge the run while it runs (its end resolves everything)
        engine.observe(Report.model_validate(r), now=1000.0 + i)
    return [a for a in engine.firing() if a.alertname == "LossNotAccumNormalized"]


def test_impact_text_and_severity_follow_the_measured_movement_per_optimizer_family(tmp_path):
    with one_torch_thread():
        sgd_div, sgd_ok = _train(tmp_path, "sgd", True)
        sgd_nodiv, sgd_bad = _train(tmp_path, "sgd", False)
        adam_div, adam_ok = _train(tmp_path, "adamw", True)
        adam_nodiv, adam_bad = _train(tmp_path, "adamw", False)
    sgd_ratio, adam_ratio = sgd_nodiv / sgd_div, adam_nodiv / adam_div
    print(f"movement without / with the division, N={N}, {STEPS} steps: SGD {sgd_ratio:.3f}x, AdamW {adam_ratio:.3f}x")

    assert _alerts(sgd_ok) == [] and _alerts(adam_ok) == []  # the healthy twins stay quiet
    (sgd,) = _alerts(sgd_bad)
    (adam,) = _alerts(adam_bad)
    assert dict(sgd.labels) == {"run": "sgd-nodiv", "objective": "main"}
    assert dict(adam.labels) == {"run": "adamw-nodiv", "objective": "main"}
    assert sgd.value == adam.value == N  # the mass: N micro-batch gradients added up

    # SGD: the page says an N-fold learning rate, and the parameters did move ~N times as far.
    assert abs(sgd_ratio - sgd.value) / sgd.value < 0.1
    assert sgd.severity == "page"
    assert f"for this SGD-like optimizer is a {N}x learning rate" in sgd.summary
    assert f"the parameters move {N}x as far as configured" in sgd.description

    # AdamW: the same steps (up to eps), so no N-fold learning rate; what is off is clipping,
    # eps and the logged loss, and it warns instead of paging.
    assert abs(adam_ratio - 1.0) < 0.02
    assert adam.severity == "warning"
    assert "learning rate" not in adam.summary
    assert "this Adam-like optimizer takes the same steps" in adam.summary
    assert f"gradient clipping engages {N}x sooner" in adam.summary and "logged loss" in adam.summary
    assert "its update is unchanged up to eps" in adam.description
    assert sgd.summary != adam.summary and sgd.description != adam.description

    families = {
        r["run"]: s["value"]
        for r in sgd_bad + adam_bad
        for s in r["samples"]
        if s["name"] == "optimizer_scale_invariant"
    }
    assert families == {"sgd-nodiv": 0.0, "adamw-nodiv": 1.0}  # the report carries the family


def test_optimizer_family_table():
    params = [nn.Parameter(torch.zeros(2))]
    assert optimizer_family(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)) == "sgd"
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.NAdam):
        assert optimizer_family(cls(params)) == "adam", cls

    class Lion(torch.optim.Optimizer):  # a third-party optimizer known by name
        def __init__(self, p):
            super().__init__(p, {})

    class Mystery(Lion):
        pass

    assert optimizer_family(Lion(params)) == "adam"
    assert optimizer_family(Mystery(params)) == "unknown"
