"""``trainvitals audit`` on checkpoints the frameworks write themselves: a two-rank FSDP2
job on gloo (distributed checkpoints, one shard file per rank), the Hugging Face
Trainer (``checkpoint-N/``) and Lightning's ``ModelCheckpoint`` (``.ckpt``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.audit import _i4
from tests.support import run_ranks
from trainvitals.monitor.cli import main

pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("_fsdp_job.py")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread: the tiny jobs gain nothing from more, and the machine is shared."""


def audit(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["audit", "--json", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.stdout)


def _key(data: dict) -> set[tuple]:
    return {(f["alert"], f["severity"], f["subject"], round(f["value"], 5)) for f in data["findings"]}


@pytest.mark.parametrize("variant", ["bug", "healthy"])
def test_fsdp2_distributed_checkpoints_give_the_one_process_findings(tmp_path: Path, variant: str):
    folder = tmp_path / "dcp"
    written = run_ranks(JOB, tmp_path / "out.json", str(folder), variant)["written"]
    assert len(written) == 3
    assert sorted(p.name for p in (folder / "step-60").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    status, data = audit(str(folder))
    # The same run in one process, saved with torch.save: the same findings and figures.
    saved = _i4.train(variant, (1,))
    _i4.write_torch(saved, tmp_path / "one")
    _, expected = audit(str(tmp_path / "one"))
    assert _key(data) == _key(expected)
    for name in ("out_scale", "lin1.bias", "lin2.bias"):
        assert data["one_d"][name]["walk"] == pytest.approx(_i4.drift_truth(saved, name), rel=1e-5, abs=1e-6)
    # The matrices are read shard by shard (one stored chunk per rank): the same figures.
    for q, e in zip(data["quantization"], expected["quantization"], strict=True):
        assert q["tensor"] == e["tensor"]
        assert q["absmax"] == pytest.approx(e["absmax"], rel=1e-5) and q["rms"] == pytest.approx(e["rms"], rel=1e-5)
    w = saved.models[-1]["lin1.weight"].double()
    lin1 = next(q for q in data["quantization"] if q["tensor"] == "lin1.weight")
    assert lin1["rms"] == pytest.approx(float(w.square().mean().sqrt()), rel=1e-5)
    if variant == "bug":
        assert status == 1
        reset = next(f for f in data["findings"] if f["alert"] == "OptimizerStateReset")
        assert reset["detail"]["between"] == [2, 3]
        assert data["checkpoints"][0]["optimizer_names"] == "the distributed checkpoint's parameter names"
    else:
        assert status == 0 and all(f["severity"] == "info" for f in data["findings"])


def test_hugging_face_trainer_checkpoints(tmp_path: Path):
    """A tiny Llama under the Trainer: its two param groups (decay, no decay) are named
    from config.json's model built on the meta device; the coverage is the Trainer's."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from tests.integrations._hf_models import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, 60, (16, 12), generator=g)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=4,
        weight_decay=0.1,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        trainer.save_model()  # the final model beside the checkpoints, in output_dir
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert (tmp_path / "model.safetensors").is_file()
    status, data = audit(str(tmp_path))
    assert [c["step"] for c in data["checkpoints"]] == [3, 6]
    assert [c["format"] for c in data["checkpoints"]] == ["hf-trainer", "hf-trainer"]
    assert data["checkpoints"][0]["optimizer_names"] == "matched to the model's tensors by order and shape"
    decayed = set(trainer.get_decay_parameter_names(model))
    truth = sorted(n for n, p in model.named_parameters() if p.ndim <= 1 and n not in decayed)
    (wd,) = [f for f in data["findings"] if f["alert"] == "WeightDecayCoverage"]
    assert wd["detail"]["no_weight_decay"] == truth and truth
    assert all(data["one_d"][n]["weight_decay"] == 0.0 for n in truth)
    assert "OptimizerStateReset" not in {f["alert"] for f in data["findings"]}
    assert status == 0


def test_lightning_model_checkpoints(tmp_path: Path):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _i4.Readout()

        def training_step(self, batch, i):
            x, y = batch
            return (self.model(x) - y).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(
                [
                    {"params": [p for p in self.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                    {"params": [p for p in self.parameters() if p.ndim < 2], "weight_decay": 0.0},
                ],
                lr=1e-2,
            )

    data_ = [_i4.batch(i) for i in range(8)]
    loader = torch.utils.data.DataLoader(data_, batch_size=None)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            max_steps=6,
            callbacks=[ckpt],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
        )
        trainer.fit(Module(), loader)
    status, data = audit(str(tmp_path))
    assert [c["step"] for c in data["checkpoints"]] == [3, 6]
    assert {c["format"] for c in data["checkpoints"]} == {"lightning"}
    assert data["checkpoints"][0]["optimizer_names"] == "matched to the model's tensors by order and shape"
    (wd,) = [f for f in data["findings"] if f["alert"] == "WeightDecayCoverage"]
    assert wd["detail"]["no_weight_decay"] == ["model.lin1.bias", "model.lin2.bias", "model.out_scale"]
    assert data["one_d"]["model.out_scale"]["weight_decay"] == 0.0
    assert status == 0
