"""The headline figures in the tracker the job already uses: the HF Trainer with
``report_to="tensorboard"``, a Lightning job with its TensorBoard logger, and the
TensorBoard sink of a plain loop, each read back with tensorboard's own event reader
and compared with the monitor's own latest report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import attach
from trainvitals.hooks.headline import HEADLINE, figure_name, headline_figures
from trainvitals.hooks.sinks import TensorBoardSink

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# One rule that fires on every report: the alerts the job's rules see firing reach the trackers.
ALWAYS = "- {alert: AlwaysOn, metric: grad_norm, above: 0, clear: 0, severity: info, summary: s}\n"


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of every event file under ``logdir``: tag -> [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    folders = {p.parent for p in logdir.rglob("events.out.tfevents.*")}
    assert folders, f"no event file under {logdir}"
    for folder in folders:
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def _reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rules(tmp_path: Path) -> list[object]:
    path = tmp_path / "always.yaml"
    path.write_text(ALWAYS)
    return ["default", path]


def _expected(mon) -> dict[str, float]:
    return headline_figures(mon.latest(), ["AlwaysOn"])


def test_headline_is_a_handful_per_signal_named_as_on_metrics():
    samples = [{"name": "grad_norm", "labels": {}, "value": 2.0}]
    samples += [{"name": "param_drift_log2", "labels": {"param": f"p{i}"}, "value": float(i)} for i in range(50)]
    samples += [{"name": "group_grad_norm", "labels": {"group": "0"}, "value": 1.0}]  # not a headline
    samples += [{"name": "modality_excess_dilution_ratio", "labels": {"modality": "image"}, "value": 17.0}]
    figures = headline_figures(samples, ["GradientDilution"])
    assert figures == {
        "trainvitals_grad_norm": 2.0,
        "trainvitals_param_drift_log2/param:p49": 49.0,
        "trainvitals_param_drift_log2/param:p48": 48.0,
        "trainvitals_param_drift_log2/param:p47": 47.0,
        "trainvitals_modality_excess_dilution_ratio/modality:image": 17.0,
        "trainvitals_alerts_firing/alertname:GradientDilution": 1.0,
    }
    from trainvitals.wire import METRICS

    assert set(HEADLINE) <= set(METRICS) and "alerts_firing" in METRICS
    assert figure_name("loss_weight_mass", {"objective": "main"}) == "trainvitals_loss_weight_mass/objective:main"


def test_tensorboard_sink_of_a_plain_loop(tmp_path: Path, one_torch_thread: None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.RMSNorm(16), nn.Linear(16, 50))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logdir = tmp_path / "tb"
    sink = TensorBoardSink(logdir, also=f"file:{tmp_path / 'r.jsonl'}")
    mon = attach(model, opt, run="plain", sink=sink, every=2, modalities=("text",), rules=_rules(tmp_path))
    for _ in range(6):
        ids = torch.randint(0, 50, (4, 8))
        logits = model(ids)
        per_token = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view_as(ids)
        mon.track_loss(per_token, modality="text")
        per_token.mean().backward()
        opt.step()
        opt.zero_grad()
    assert mon.flush(30)
    expected = _expected(mon)
    mon.close()
    scalars = _scalars(logdir)
    assert {"trainvitals_grad_norm", "trainvitals_loss_weight_mass/objective:main"} <= set(expected)
    for tag, value in expected.items():
        assert scalars[tag][-1] == (6, pytest.approx(value, rel=1e-6)), tag
    assert [s for s, _ in scalars["trainvitals_grad_norm"]] == [1, 2, 4, 6]  # each report, at its step
    assert scalars["trainvitals_alerts_firing/alertname:AlwaysOn"][-1] == (6, 1.0)
    assert (tmp_path / "r.jsonl").read_text().count("\n") == 5  # 4 reports and the run_end, kept too
    assert not any(t.startswith("trainvitals_group_") for t in scalars)  # headline only


def test_hf_trainer_report_to_tensorboard(tmp_path: Path, one_torch_thread: None):
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

    from trainvitals.hooks.transformers import TrainvitalsCallback

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 12))]
    logdir = tmp_path / "out"  # TensorBoardCallback writes under output_dir/runs/
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=4,
        logging_steps=1,
        report_to="tensorboard",
        use_cpu=True,
        save_strategy="no",
    )
    callback = TrainvitalsCallback(every=1, sink=f"file:{tmp_path / 'r.jsonl'}", rules=_rules(tmp_path))
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    scalars = _scalars(logdir)
    # on_log adds the latest report the sender has handled: one of the run's reports.
    reported = [headline_figures(r["samples"]) for r in _reports(tmp_path / "r.jsonl") if r["samples"]]
    for tag in ("trainvitals_grad_norm", "trainvitals_update_ratio", "trainvitals_loss_weight_mass/objective:main"):
        (tb_tag,) = [t for t in scalars if t.endswith(tag)]  # the Trainer prefixes "train/"
        assert tb_tag == "train/" + tag
        logged = [v for _, v in scalars[tb_tag]]
        assert len(logged) >= 3  # at most the first logging step precedes the first report handled
        for v in logged:
            assert any(v == pytest.approx(r[tag], rel=1e-6) for r in reported if tag in r), (tag, v)
    masses = [v for _, v in scalars["train/trainvitals_loss_weight_mass/objective:main"]]
    assert masses == [pytest.approx(1.0, rel=1e-5)] * len(masses)  # accumulation divided: 1 per step
    assert "train/trainvitals_alerts_firing/alertname:AlwaysOn" in scalars


# Lightning's own deprecations and advice (torch's LeafSpec, dataloader workers), not ours.
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning:lightning.*")
def test_lightning_tensorboard_logger(tmp_path: Path, one_torch_thread: None):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from trainvitals.hooks.lightning import TrainvitalsCallback

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)

        def training_step(self, batch, batch_idx):
            logits = self.head(self.embed(batch["ids"]))
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = [{"ids": ids, "labels": ids.roll(-1)} for ids in torch.randint(0, 64, (16, 12))]
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="tiny")
    callback = TrainvitalsCallback(every=1, sink=f"file:{tmp_path / 'r.jsonl'}", rules=_rules(tmp_path))
    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        accelerator="cpu",
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(TinyLM(), torch.utils.data.DataLoader(data, batch_size=4))
    scalars = _scalars(tmp_path / "tb")
    expected = _expected(callback.monitor)
    assert {"trainvitals_grad_norm", "trainvitals_loss_weight_mass/objective:main"} <= set(expected)
    for tag, value in expected.items():
        assert scalars[tag][-1] == (4, pytest.approx(value, rel=1e-6)), tag
    assert scalars["trainvitals_loss_weight_mass/objective:main"][-1][1] == pytest.approx(1.0, rel=1e-5)
