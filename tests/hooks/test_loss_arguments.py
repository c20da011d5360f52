"""track_loss: wrong arguments that can be seen without reading values raise at once."""

from __future__ import annotations

import pytest
import torch

from tests.hooks._loss_models import MODALITIES, TokenModel
from trainvitals.hooks import attach

B, T, V = 3, 5, 7


def call_args(**overrides):
    per_token = torch.rand(B, T, requires_grad=True)
    args = {
        "per_token": per_token,
        "modality": torch.tensor([0, 1, 0]),
        "mask": torch.ones(B, T, dtype=torch.bool),
        "segments": None,
        "output": torch.rand(B, T, V, requires_grad=True),
    }
    args.update(overrides)
    return args


CASES = {
    "per_token-not-a-tensor": ({"per_token": [0.5, 0.2]}, TypeError, "reduction='none'"),
    "per_token-without-grad": ({"per_token": torch.rand(B, T)}, ValueError, "does not require grad.*reduction='none'"),
    "per_token-integer": ({"per_token": torch.ones(B, T, dtype=torch.long)}, TypeError, "floating point"),
    "per_token-3d": ({"per_token": torch.rand(B, T, 2, requires_grad=True)}, ValueError, r"\[B, T\]"),
    "unknown-name": ({"modality": "audio"}, ValueError, r"unknown modality 'audio'.*\['text', 'image'\]"),
    "unknown-name-in-list": ({"modality": ["text", "video", "text"]}, ValueError, "known modalities"),
    "list-wrong-length": ({"modality": ["text", "image"]}, ValueError, "one entry per row"),
    "float-codes": ({"modality": torch.tensor([0.0, 1.0, 0.0])}, TypeError, "integers"),
    "modality-wrong-shape": ({"modality": torch.zeros(B, T + 1, dtype=torch.long)}, ValueError, "per sample"),
    "modality-not-tensor": ({"modality": {"a": 1}}, TypeError, "names"),
    "mask-wrong-shape": ({"mask": torch.ones(B, T - 1, dtype=torch.bool)}, ValueError, "mask has shape"),
    "mask-not-bool": ({"mask": torch.ones(B, T)}, TypeError, "labels != -100"),
    "segments-float": ({"segments": torch.zeros(B, T)}, TypeError, "integer sample ids"),
    "segments-wrong-shape": ({"segments": torch.zeros(B, dtype=torch.long)}, ValueError, "segments has shape"),
    "output-without-grad": ({"output": torch.rand(B, T, V)}, ValueError, "output does not require grad"),
    "output-wrong-shape": ({"output": torch.rand(T, B, V, requires_grad=True)}, ValueError, "must start with"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_track_loss_rejects_wrong_arguments_at_once(case):
    overrides, error, match = CASES[case]
    model = TokenModel()
    with attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), run="args", sink="null", modalities=MODALITIES
    ) as mon:
        args = call_args(**overrides)
        per_token = args.pop("per_token")
        with pytest.raises(error, match=match):
            mon.track_loss(per_token, **args)


def test_track_loss_needs_modality_names_at_attach():
    model = TokenModel()
    with attach(model, torch.optim.SGD(model.parameters(), lr=0.1), run="args", sink="null") as mon:
        args = call_args()
        with pytest.raises(ValueError, match=r"attach\(\.\.\., modalities="):
            mon.track_loss(args.pop("per_token"), **args)


def test_track_loss_accepts_flattened_logits_and_scalar_codes():
    model = TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, opt, run="args", sink="null", modalities=MODALITIES, every=1) as mon:
        logits = torch.rand(B * T, V, requires_grad=True)
        per_token = logits.logsumexp(-1).view(B, T)
        mon.track_loss(per_token, modality=torch.tensor(1), output=logits)
        per_token.mean().backward()
        opt.step()
        assert mon.value("modality_sample_share_ratio", modality="image") == 1.0
        assert mon.value("modality_grad_norm", modality="image", scope="output") > 0
