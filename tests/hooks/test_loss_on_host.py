"""On one rank loss accounting's figures are made on the sender thread from the host
copy of the step's sums (``StepContext.on_host``); across ranks and on the probe's
steps they are tensor ops on the training thread. Both ways, the same job must send
the same reports: every sample, value, event and coverage entry, in the same order.

The twin jobs here go through the real sender into a file sink, with what a job can
throw at the accounting: per-token modality codes, a sample mixing codes, an unknown
code, a declared modality without label tokens, two objectives (one weighted, one
missing its accumulation division), packed rows, the output gradient, a non-finite
loss, zero-code weights from the logits' gradient and a gradient that is not a
cross-entropy one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.hooks._loss_models import (
    MODALITIES,
    VOCAB,
    TokenModel,
    masked_steps,
    packed,
    padded,
    per_token_loss,
    samples,
)
from trainvitals.hooks import attach
from trainvitals.hooks.pack import pack
from trainvitals.hooks.signals.loss.report import LossReport
from trainvitals.hooks.step import StepContext

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _reports(path: Path) -> list[str]:
    """The file sink's reports without what differs between two runs (the wall time,
    the sender's id), as JSON text (NaN compares equal as text)."""
    out = []
    for line in path.read_text().splitlines():
        report = json.loads(line)
        for key in ("time", "sender"):
            report.pop(key, None)
        out.append(json.dumps(report))
    return out


def _tracked_job(path: Path) -> None:
    model = TokenModel(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(model, opt, run="twin", sink=f"file:{path}", every=1, modalities=(*MODALITIES, "audio"))
    for step in range(6):
        batch = samples([7, 3, 12, 5, 9, 4], [0, 1, 0, 5, 1, 0], seed=step)  # 5: an unknown code
        rows = [padded(batch[:3]), packed(batch[3:], row_len=16, first=3)]
        rows[1].modality[0, 1] = 0  # the packed row's first sample mixes codes
        rows[0].modality[2], rows[0].mask[2] = 2, False  # "audio" marks only a sample without label tokens
        tokens = sum(int(r.mask.sum()) for r in rows)
        for k, r in enumerate(rows):
            per_token, logits = per_token_loss(model, r)
            if step == 3 and k == 0:  # a non-finite loss on a label token, kept out of the backward
                per_token = per_token + torch.where(r.mask & (r.sample == 0), float("nan"), 0.0)
            finite = torch.where(per_token.isfinite() & r.mask, per_token, 0.0)
            mon.track_loss(per_token, modality=r.modality, mask=r.mask, segments=r.segments, output=logits)
            # a second objective on the same losses: weighted by 2, without the division by the micro-batches
            mon.track_loss(
                per_token, modality=r.modality, mask=r.mask, segments=r.segments, objective="aux", weight=2.0
            )
            (finite.sum() / tokens + 2.0 * finite.sum() / r.mask.sum()).backward()
        opt.step()
        opt.zero_grad()
    mon.close()


def _zero_code_job(path: Path, smoothing: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(
        model, opt, run="twin-zero", sink=f"file:{path}", every=1, modalities=MODALITIES, loss_from_logits=True
    )
    for step in range(5):
        rows = padded(samples([40, 9, 33, 12], [0, 1, 0, 1], seed=step))
        mon.tag_batch(rows.modality)
        logits = model(rows.ids).reshape(-1, VOCAB)[rows.mask.reshape(-1)]
        labels = rows.labels.reshape(-1)[rows.mask.reshape(-1)]
        F.cross_entropy(logits, labels, label_smoothing=smoothing if step >= 2 else 0.0).backward()
        opt.step()
        opt.zero_grad()
    mon.close()


@pytest.mark.parametrize("job", ["tracked", "zero-code", "zero-code-smoothed"])
def test_figures_made_on_the_host_equal_those_made_on_the_device(job, tmp_path, monkeypatch):
    sent = {}
    for on_host in (True, False):
        monkeypatch.setattr(LossReport, "on_host", on_host)
        path = tmp_path / f"{job}-{on_host}.jsonl"
        if job == "tracked":
            _tracked_job(path)
        else:
            _zero_code_job(path, 0.1 if job == "zero-code-smoothed" else 0.0)
        sent[on_host] = _reports(path)
    host, device = sent[True], sent[False]
    assert len(host) == len(device) >= 5
    names = {s["name"] for line in host for s in json.loads(line)["samples"]}
    assert "loss_weight_mass" in names and "modality_dilution_ratio" in names, sorted(names)
    for a, b in zip(host, device, strict=True):
        assert a == b


def test_a_section_lands_where_it_was_added_among_samples_events_and_verdicts():
    """``on_host``'s pieces go between what was written before and after it."""
    ctx = StepContext(step=4, device=torch.device("cpu"))
    ctx.emit("before", torch.tensor(1.0))
    ctx.event("early", "flagged before", when=torch.tensor(1.0))
    ctx.inactive_when("loss", torch.tensor(0.0), "no_input", "not this one")

    def section(sub: StepContext, parts: list[torch.Tensor]) -> None:
        (values,) = parts
        assert values.device.type == "cpu" and values.tolist() == [2.0, 3.0]
        sub.emit_block([("inside", [{"k": "a"}, {"k": "b"}])], values, present=values > 2.5, gated=[0, 1])
        sub.event("middle", "from the host", when=values[0])
        sub.inactive_when("loss", values[1], "not_cross_entropy", "the section's verdict")

    ctx.on_host([torch.tensor([2.0, 3.0], dtype=torch.float64)], section)
    ctx.emit("after", torch.tensor(4, dtype=torch.int64))
    ctx.event("late", "flagged after", when=torch.tensor(1.0))
    ctx.inactive_when("loss", torch.tensor(1.0), "logits_overwritten", "written after: loses to the section's")
    ctx.coverage = [{"signal": "loss", "active": True}]

    report = pack(ctx, run="r", rank=0).materialize()
    assert [(s["name"], s["labels"], s["value"]) for s in report["samples"]] == [
        ("before", {}, 1.0),
        ("inside", {"k": "b"}, 3.0),
        ("after", {}, 4.0),
    ]
    assert [e["kind"] for e in report["events"]] == ["early", "middle", "late"]
    assert report["coverage"] == [
        {"signal": "loss", "active": False, "reason": "not_cross_entropy", "detail": "the section's verdict"}
    ]


def test_a_section_that_raises_drops_its_report_and_a_bad_section_raises_at_once():
    ctx = StepContext(step=1, device=torch.device("cpu"))

    def broken(sub: StepContext, parts: list[torch.Tensor]) -> None:
        raise RuntimeError("boom")

    ctx.on_host([torch.zeros(2)], broken)

    with pytest.raises(RuntimeError, match="boom"):
        pack(ctx, run="r", rank=0).materialize()
    with pytest.raises(TypeError, match="on_host: run must be callable"):
        ctx.on_host([torch.zeros(1)], "not a function")  # type: ignore[arg-type]
    assert len(ctx.sections) == 1


def test_a_loss_emission_that_fails_on_the_sender_thread_loses_the_loss_figures_only(tmp_path, monkeypatch, caplog):
    """The other signals' figures still go out; the report says loss failed, and the
    signal is turned off at its next report, as a failure on the training thread does."""

    def broken(self, *args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(LossReport, "_emit", broken)
    path = tmp_path / "failing.jsonl"
    model = TokenModel(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(model, opt, run="failing", sink=f"file:{path}", every=1, modalities=MODALITIES)
    masked_steps(mon, model, opt, padded(samples([7, 3, 12], [0, 1, 0])), 4)  # the failing reports still materialize
    mon.close()
    reports = [json.loads(line) for line in path.read_text().splitlines()]
    loss = [next(c for c in r["coverage"] if c["signal"] == "loss") for r in reports if r.get("coverage")]
    assert all(not c["active"] and c["reason"] == "failed" for c in loss[:4]), loss
    assert "ZeroDivisionError: boom" in loss[0]["detail"]
    assert all(any(s["name"] == "grad_norm" for s in r["samples"]) for r in reports[:4])
    assert not any(s["name"] == "modality_loss" for r in reports for s in r["samples"])
    said = [r.getMessage() for r in caplog.records]
    turned_off = [m for m in said if m.startswith("trainvitals: signal LossAccounting failed")]
    assert len(turned_off) == 1 and "ZeroDivisionError: boom" in turned_off[0], said


@pytest.mark.parametrize("dtypes", ["one", "several"])
def test_a_sections_parts_are_read_as_tensors_never_as_python_floats(dtypes):
    """A section's parts may be large (a step's kept micro-batch results): the report's
    own values are turned into Python floats, the sections' parts never are."""
    ctx = StepContext(step=2, device=torch.device("cpu"))
    ctx.emit("own", torch.tensor([1.0, 2.0], dtype=torch.float64), [{"k": "a"}, {"k": "b"}])
    if dtypes == "several":
        ctx.emit("count", torch.tensor([3], dtype=torch.int64))
    big = torch.arange(100_000, dtype=torch.float64)
    seen = []

    def section(sub: StepContext, parts: list[torch.Tensor]) -> None:
        seen.append(parts[0].sum().item())
        sub.emit("from_section", parts[1].float())

    ctx.on_host([big, torch.tensor([7], dtype=torch.int64)], section)
    pending = pack(ctx, run="r", rank=0)
    values, parts = pending._values()
    assert [p.numel() for p in parts] == [100_000, 1]
    assert values == ([1.0, 2.0] if dtypes == "one" else [1.0, 2.0, 3.0])
    report = pending.materialize()
    assert seen == [big.sum().item()]
    assert [s["value"] for s in report["samples"]] == [*values, 7.0]
