"""``integrations_rl`` in one process, no training: the policy loss found by following
what is computed from the advantages (GRPO's computations written out in plain torch),
its gradient equal to the normalization weights autograd gives; and the objective each
TRL trainer class is identified as (real TRL classes, made without their ``__init__``)."""

from __future__ import annotations

import pytest
import torch

from trainvitals.hooks.integrations_rl import INTENT, SCALED, _FindPolicyLoss, identify

trl = pytest.importorskip("trl")


def _grpo_like(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """GRPO's ``_compute_loss`` from the log-probabilities on (sequence-level importance
    sampling reduces a gradient-carrying tensor before the policy loss: it must not be taken)."""
    old = logps.detach()
    log_ratio = logps - old
    if level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    adv = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    kept = per_token_loss * mask
    kept.retain_grad()
    loss = kept.sum(-1).mean() / 4
    (advantages < 0).float().mean()  # a metric on the advantages, without a gradient
    return loss, kept


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_policy_loss_is_the_first_reduced_tensor_computed_from_the_advantages(level: str):
    g = torch.Generator().manual_seed(0)
    logps = torch.randn(3, 5, generator=g).requires_grad_()
    advantages = torch.randn(3, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    finder = _FindPolicyLoss(advantages)
    with finder:
        loss, kept = _grpo_like(logps, advantages, mask, level)
    assert finder.found is kept and not finder.failed
    seen: list[torch.Tensor] = []
    finder.found.register_hook(seen.append)
    loss.backward()
    assert torch.equal(seen[0], kept.grad)  # what the hook reads is dL/dl: 1/(B N) per token
    assert torch.allclose(seen[0], torch.full((3, 5), 1 / 12))


def test_nothing_is_found_without_a_reduction_that_carries_a_gradient():
    advantages = torch.randn(4)
    finder = _FindPolicyLoss(advantages)
    with finder:
        (advantages * 2).sum()  # no gradient
        x = torch.randn(4, requires_grad=True)
        (x * 3).sum()  # a gradient, but nothing from the advantages
    assert finder.found is None


def _bare(cls: type, **attrs):
    obj = cls.__new__(cls)  # the real class, its __init__ (a model, a dataset) not needed here
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def test_each_trl_trainer_is_identified_with_its_loss_types_intent():
    from trl import DPOTrainer, GRPOTrainer, RLOOTrainer, SFTTrainer

    assert identify(_bare(SFTTrainer)) is None  # a cross-entropy: the usual seams
    for loss_type, normalization in INTENT.items():
        o = identify(_bare(GRPOTrainer, loss_type=loss_type))
        assert o is not None and (o.kind, o.normalization, o.withheld, o.own_loss) == (
            "policy",
            normalization,
            None,
            False,
        )
    for loss_type in SCALED:
        o = identify(_bare(GRPOTrainer, loss_type=loss_type))
        assert o is not None and o.withheld is not None and o.withheld[0] == "objective_scaled"
    o = identify(_bare(GRPOTrainer, loss_type="a_future_type"))
    assert o is not None and o.withheld is not None and "not one trainvitals knows" in o.withheld[1]
    o = identify(_bare(RLOOTrainer))
    assert o is not None and (o.kind, o.withheld, o.normalization) == ("policy", None, None)
    o = identify(_bare(DPOTrainer))
    assert o is not None and o.kind == "preference" and o.withheld is not None
    assert o.withheld[0] == "not_cross_entropy"

    class OwnLoss(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs) * 4

    o = identify(_bare(OwnLoss, loss_type="dr_grpo"))  # a subclass's own loss: read, no intent assumed
    assert o is not None and o.own_loss and o.withheld is None and o.normalization is None


class StandInTrainer:
    """A trainer's shape as the seam sees it (``model``, ``compute_loss(model, inputs)``)
    around a real model: a policy loss over ``inputs["advantages"]``, reduced with a sum
    (found) or through a boolean index (not found: nothing to read per token)."""

    def __init__(self, model: torch.nn.Module, indexed: bool) -> None:
        self.model = model
        self.indexed = indexed

    def compute_loss(self, model, inputs):
        logps = torch.log_softmax(model(inputs["x"]), dim=-1)[..., 0]  # [B, T]
        per_token_loss = -inputs["advantages"].unsqueeze(1) * logps
        mask = inputs["completion_mask"]
        if self.indexed:
            return per_token_loss[mask.bool()].mean() / 2
        return (per_token_loss * mask).sum() / mask.sum() / 2


@pytest.mark.parametrize("indexed", [False, True])
def test_the_seam_reads_the_found_policy_loss_or_says_why_not(tmp_path, indexed: bool):
    import json

    from trainvitals.hooks import attach
    from trainvitals.hooks.integrations_rl import Objective, PolicyLossSeam
    from trainvitals.hooks.sinks import FileSink

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "r.jsonl"
    mon = attach(model, opt, run="seam", sink=FileSink(path), every=1)
    trainer = StandInTrainer(model, indexed)
    seam = PolicyLossSeam(trainer, mon, Objective("StandIn", "policy", own_loss=True))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    for _ in range(3):
        for _ in range(2):  # two micro-batches, each a token mean / 2: mass 1
            inputs = {"x": torch.randn(2, 3, 3), "advantages": torch.randn(2), "completion_mask": mask}
            trainer.compute_loss(model, inputs).backward()
        opt.step()
        opt.zero_grad()
    seam.remove()
    assert "compute_loss" not in vars(trainer)  # the class's method is back
    mon.close()
    reports = [json.loads(line) for line in path.read_text().splitlines()]
    mass = [s["value"] for r in reports for s in r.get("samples", []) if s["name"] == "loss_weight_mass"]
    loss = [c for r in reports for c in r["coverage"] if c["signal"] == "loss"]
    if indexed:
        assert mass == []
        assert loss and all(c["reason"] == "no_input" and "its policy loss was not found" in c["detail"] for c in loss)
    else:
        assert len(mass) == 3 and all(abs(m - 1.0) < 1e-6 for m in mass), mass
        assert all(c["active"] for c in loss[:3])
