"""Zero-code loss accounting on the per-token paths (a fused head's per-token
log-probabilities, a model's per-token losses): a cross-entropy's token weights are
>= 0, so signed weights (a policy gradient's advantages, zero-mean per group) are
withheld with the reason ``not_cross_entropy``, never reported as a weight mass; non-
negative weights stay active, their mass exact against the weights the test chose."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support import HostSyncSpy, one_torch_thread
from trainvitals.hooks import attach

VOCAB = 32


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@dataclass
class FusedOutput:
    """What a fused LM head returns (TRL's shape of it): the labels' per-token
    log-probabilities and their mask, no logits."""

    log_probs: torch.Tensor
    label_mask: torch.Tensor
    logits: None = None


class FusedLM(nn.Module):
    """Its head's weight is used inside the forward; the ``lm_head`` module is never called."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> FusedOutput:
        logits = F.linear(self.embed(ids[:, :-1]), self.lm_head.weight)
        log_probs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return FusedOutput(log_probs, mask[:, 1:])


class PerTokenLM(nn.Module):
    """Calls its head and returns the per-token cross-entropy [B, S] (as Megatron's GPTModel)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.embed(ids[:, :-1]))
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


def token_weights(kind: str, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Per-token weights [B, T] on the label tokens: ``advantage``: GRPO-like, the token
    mean times a per-sample advantage, zero-mean over the group (signed); ``positive``:
    weights > 0 of unequal size (a weighted cross-entropy)."""
    n = mask.sum()
    if kind == "advantage":
        reward = torch.rand(mask.shape[0], 1, generator=gen, dtype=torch.float64)
        adv = (reward - reward.mean()) / reward.std()
        return (adv / n * mask).float()
    return (torch.rand(mask.shape, generator=gen, dtype=torch.float64) + 0.5) / n * mask


def run(model_cls: type, kind: str, monkeypatch: pytest.MonkeyPatch, steps: int = 3) -> tuple[object, list[float]]:
    """``steps`` reported steps; the second one's forward and backward (the hooks' work)
    are checked for host syncs."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = model_cls()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, opt, run=f"signed-{kind}", sink="null", every=1, loss_from_logits="lm_head")
    masses = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (4, 10), generator=gen)
        mask = torch.ones(4, 10, dtype=torch.bool)
        mask[1, 7:] = False
        mask[3, 4:] = False
        w = token_weights(kind, mask[:, 1:], gen)
        spy = HostSyncSpy(monkeypatch) if step == 1 else None
        out = model(ids, mask)
        loss = -(w.float() * out.log_probs).sum() if isinstance(out, FusedOutput) else (w.float() * out).sum()
        loss.backward()
        if spy is not None:
            assert spy.stop() == []  # the sign check runs on the device: no host sync
        opt.step()
        opt.zero_grad()
        assert (float(w.min()) < 0) == (kind == "advantage")
        masses.append(float(w.sum()))
    return mon, masses


@pytest.mark.parametrize("model_cls", [FusedLM, PerTokenLM], ids=["fused", "per-token"])
def test_signed_per_token_weights_are_withheld_with_the_reason(model_cls, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="trainvitals")
    mon, masses = run(model_cls, "advantage", monkeypatch)
    try:
        assert masses[-1] != 0  # a sum of signed weights: a "mass" that means nothing
        loss = {e["signal"]: e for e in mon.latest_coverage()}["loss"]
        assert loss["active"] is False and loss["reason"] == "not_cross_entropy", loss
        assert "signed per-token weights" in loss["detail"] and "policy gradient" in loss["detail"]
        for name in ("loss_weight_mass", "token_weight_spread_ratio", "loss_accumulation_exponent"):
            assert mon.value(name, objective="main") is None, name
        assert mon.value("loss") is None
        assert [e["kind"] for e in mon.latest_events()] == ["loss_not_cross_entropy"]
    finally:
        mon.close()
    assert any("signed per-token weights" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("model_cls", [FusedLM, PerTokenLM], ids=["fused", "per-token"])
def test_non_negative_per_token_weights_are_active_and_exact(model_cls, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="trainvitals")
    mon, masses = run(model_cls, "positive", monkeypatch)
    try:
        loss = {e["signal"]: e for e in mon.latest_coverage()}["loss"]
        assert loss == {"signal": "loss", "active": True}
        assert mon.value("loss_weight_mass", objective="main") == pytest.approx(masses[-1], rel=1e-5)
        assert not mon.latest_events()
    finally:
        mon.close()
    assert not [r for r in caplog.records if "cross-entropy" in r.getMessage()]


def test_the_sign_check_flags_a_negative_weight_and_not_rounding():
    from trainvitals.hooks.signals.loss.zero_code import signed

    tiny = torch.finfo(torch.float32).tiny
    cases = [
        ((0.5, -1e-3), 1.0),  # one negative weight
        ((0.5, -2 * tiny), 1.0),
        ((0.5, 0.0), 0.0),
        ((0.5, -0.0), 0.0),
        ((0.5, -tiny / 4), 0.0),  # a denormal is rounding, not a sign
    ]
    for weights, flagged in cases:
        assert float(signed(torch.tensor(weights))) == flagged, weights
    assert float(signed(torch.zeros(0))) == 0.0  # no label token: nothing to flag
