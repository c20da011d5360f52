"""On one rank a reported step's loss hooks keep their per-sample results for the
report (hooks/signals/loss/deferred.py) instead of adding them into the step's sums:
the sender thread finishes and adds them. What a step keeps is bounded; past the
bound, and when the figures end up made on the training thread after all, the sums
are the same as when every hook adds its own."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import trainvitals.hooks.pack as pack_module
from tests.hooks._loss_models import MODALITIES, TokenModel, masked_steps, padded, per_token_loss, samples
from trainvitals.hooks import attach
from trainvitals.hooks.signals.loss import deferred as loss_deferred
from trainvitals.hooks.signals.loss.binning import SumsLayout
from trainvitals.hooks.signals.loss.deferred import MAX_ENTRIES, Deferred
from trainvitals.hooks.signals.loss.report import LossReport
from trainvitals.hooks.signals.loss.step import LossStep, StepBook

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _reports(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        report = json.loads(line)
        for key in ("time", "sender"):
            report.pop(key, None)
        out.append(report)
    return out


def _job(path: Path, micro_batches: int, steps: int = 3, flip_at: int | None = None, monkeypatch=None) -> None:
    """``micro_batches`` per optimizer step: rows without a mask (every token a label
    token, rows weighted 1, 3, 2) and padded rows with one (uniform weights),
    alternately, with the output gradient.
    ``flip_at``: that step's figures are switched to the training thread after its
    first backward (the hooks of that step kept their results)."""
    model = TokenModel(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(model, opt, run="deferred", sink=f"file:{path}", every=1, modalities=MODALITIES)
    for step in range(steps):
        for k in range(micro_batches):
            batch = samples([6, 6, 6] if k % 2 == 0 else [7, 3, 12], [0, 1, k % 2], seed=100 * step + k)
            rows = padded(batch)
            per_token, logits = per_token_loss(model, rows)
            if k % 2 == 0:
                # rows weighted their own ways, the first the least: the step's only
                # non-uniform weights, whose largest is never in the first row
                mon.track_loss(per_token, modality=rows.modality, output=logits)
                loss = (per_token * torch.tensor([1.0, 3.0, 2.0])[:, None]).sum()
            else:
                mon.track_loss(per_token, modality=rows.modality, mask=rows.mask, output=logits)
                loss = torch.where(rows.mask, per_token, 0.0).sum()
            (loss / (18 * micro_batches)).backward()
            if step == flip_at and k == 0:
                monkeypatch.setattr(LossReport, "on_host", False)
        opt.step()
        opt.zero_grad()
    mon.close()


def _loss_samples(report: dict[str, Any]) -> list[tuple[str, str, float]]:
    return [
        (s["name"], json.dumps(s["labels"], sort_keys=True), s["value"])
        for s in report["samples"]
        if s["name"].startswith(("modality_", "loss_", "output_", "token_"))
    ]


@pytest.fixture
def applied(monkeypatch) -> list[tuple[int, str]]:
    """Each ``Deferred.apply`` call: how many results it added, and on which thread."""
    calls: list[tuple[int, str]] = []
    real = Deferred.apply

    def spy(layout, entries, tensors, sums, extremes):
        training = threading.current_thread() is threading.main_thread()
        calls.append((len(entries), "training" if training else "sender"))
        real(layout, entries, tensors, sums, extremes)

    monkeypatch.setattr(Deferred, "apply", staticmethod(spy))
    return calls


def _same_reports(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b) >= 3
    assert json.dumps(a) == json.dumps(b)


def test_a_step_that_keeps_no_more_adds_what_it_kept_first(tmp_path, monkeypatch, applied):
    """24 micro-batches, two results each (weights, output norms): the step keeps 32,
    then adds them into its sums at the first result that does not fit, and its hooks
    add their own from then on. The sums add in the hooks' order either way: the
    reports are those of the same job with every hook adding its own, byte for byte."""
    micro = 24
    assert 2 * micro > MAX_ENTRIES
    sent = {}
    for on_host in (True, False):
        monkeypatch.setattr(LossReport, "on_host", on_host)
        path = tmp_path / f"long-{on_host}.jsonl"
        _job(path, micro)
        sent[on_host] = _reports(path)
    assert applied == [(MAX_ENTRIES, "training")] * 3, applied  # once a step, nothing left for the report
    names = {x[0] for r in sent[True] for x in _loss_samples(r)}
    assert {"modality_loss", "loss_weight_mass", "modality_dilution_ratio"} <= names, sorted(names)
    _same_reports(sent[True], sent[False])


def test_a_short_accumulation_leaves_its_results_to_the_sender_thread(tmp_path, monkeypatch, applied):
    monkeypatch.setattr(LossReport, "on_host", True)
    _job(tmp_path / "short.jsonl", 4)
    monkeypatch.setattr(LossReport, "on_host", False)
    _job(tmp_path / "short-device.jsonl", 4)
    assert applied and all(call == (8, "sender") for call in applied), applied
    _same_reports(_reports(tmp_path / "short.jsonl"), _reports(tmp_path / "short-device.jsonl"))


def test_kept_results_are_added_on_the_training_thread_when_the_figures_are_made_there(tmp_path, monkeypatch, applied):
    """A step whose hooks kept their results, whose figures are then made on the
    training thread (as on a probe step a live setting made due): the kept results are
    added there, before the figures, and the reports are those of a job whose hooks
    added their own, byte for byte (these entries of the sums have no other writer)."""
    monkeypatch.setattr(LossReport, "on_host", True)
    _job(tmp_path / "flipped.jsonl", 3, steps=3, flip_at=1, monkeypatch=monkeypatch)
    assert sorted(applied) == [(6, "sender"), (6, "training")], applied
    monkeypatch.setattr(LossReport, "on_host", False)
    _job(tmp_path / "device.jsonl", 3, steps=3)
    flipped, device = _reports(tmp_path / "flipped.jsonl"), _reports(tmp_path / "device.jsonl")
    assert json.dumps(flipped[1:]) == json.dumps(device[1:])
    assert _loss_samples(flipped[1]), "the flipped step has its loss figures"


def test_the_kept_tensors_are_let_go_once_the_report_is_taken(tmp_path, monkeypatch):
    """A step's kept results live until its report copies them, not longer."""
    monkeypatch.setattr(LossReport, "on_host", True)
    kept: list[weakref.ref] = []
    real = Deferred._keep

    def spy(self, head, tensors):
        kept.extend(weakref.ref(t) for t in tensors)
        return real(self, head, tensors)

    monkeypatch.setattr(Deferred, "_keep", spy)
    model = TokenModel(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = attach(model, opt, run="kept", sink=f"file:{tmp_path / 'kept.jsonl'}", every=1, modalities=MODALITIES)
    masked_steps(mon, model, opt, padded(samples([5, 9], [0, 1])), 2)
    gc.collect()
    alive = [tuple(t.shape) for t in (r() for r in kept) if t is not None]
    assert kept and not alive, alive
    mon.close()


def test_the_bound_on_what_a_step_keeps():
    d = Deferred()
    for _ in range(MAX_ENTRIES):
        assert d.fits(10)
        d.outputs(torch.zeros(5), torch.zeros(5, dtype=torch.long), None, None)
    assert not d.fits(1)
    assert not d.outputs(torch.zeros(1), torch.zeros(1, dtype=torch.long), None, None)
    d = Deferred()
    assert d.fits(loss_deferred.MAX_NUMEL) and not d.fits(loss_deferred.MAX_NUMEL + 1)
    assert d.outputs(torch.zeros(3), torch.zeros(3, dtype=torch.long), (1, 3), None)
    kept = d.close()
    assert kept is not None and len(kept[0]) == 1 and len(kept[1]) == 2
    assert d.close() is None, "handed over once"
    assert not d.fits(1) and not d.outputs(torch.zeros(1), torch.zeros(1, dtype=torch.long), None, None)


def test_kept_results_packed_in_one_float_vector_as_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU the report is one float64 vector (the bins and counts converted); the
    sender thread reads the kept results back from it. Forced here on the CPU: the
    reports are those of the per-dtype packing, byte for byte."""
    monkeypatch.setattr(LossReport, "on_host", True)
    _job(tmp_path / "per-dtype.jsonl", 4)
    monkeypatch.setattr(pack_module, "_by_dtype", lambda parts: None)
    _job(tmp_path / "one-vector.jsonl", 4)
    per_dtype, one_vector = _reports(tmp_path / "per-dtype.jsonl"), _reports(tmp_path / "one-vector.jsonl")
    assert len(per_dtype) >= 3 and _loss_samples(per_dtype[1])
    assert json.dumps(per_dtype) == json.dumps(one_vector)


def test_hooks_on_two_threads_add_a_full_steps_results_once(monkeypatch):
    """The hooks of a model on several GPUs run on several autograd threads: two that
    find the step full at once must add what it kept once, then their own."""
    book = StepBook()
    book._layout = SumsLayout(2, 1)
    step = LossStep(token=(0, None), reporting=True, probe=False)
    book._ensure_sums(step, torch.device("cpu"))
    step.later = kept = Deferred()
    bins = torch.tensor([0, 1, 2])
    for _ in range(MAX_ENTRIES):
        assert kept.outputs(torch.ones(3), bins, None, None)
    batch = SimpleNamespace(s_bin=bins, shape=(3, 1), tok_bin=bins)
    meet = threading.Barrier(2)
    fits = Deferred.fits

    def both_look_first(self, numel):
        answer = fits(self, numel)
        meet.wait(timeout=10)  # both hooks read step.later before either hands it over
        return answer

    monkeypatch.setattr(Deferred, "fits", both_look_first)
    hooks = [threading.Thread(target=book._outputs, args=(step, batch, torch.ones(3), 1, None)) for _ in range(2)]
    for t in hooks:
        t.start()
    for t in hooks:
        t.join(timeout=10)
    assert step.later is None
    assert step.output.tolist() == [float(MAX_ENTRIES + 2)] * 3
