"""Packed rows in the job itself: sample boundaries read from the forward's arguments
(against sample ids made from the lengths), per-sample figures against autograd truth
on a tiny Llama's plain loop, withheld with a reason where boundaries cannot be read,
events that say no loss only when that is true, and the boundary-leak probe leaving the
job's RNG stream, weights and modes as they were, reading the host on probe steps only.

The Trainer and the collators' layouts, with the rules: tests/integrations/test_packed.py."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainvitals
from tests.integrations import _packed_job as job
from trainvitals.hooks import attach
from trainvitals.hooks.signals.packing.boundaries import media_codes_per_sample, read_boundaries
from trainvitals.hooks.signals.packing.leak import static_causes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")

LENGTHS = [3, 5, 2]


def truth_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def same_samples(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal partitions of the positions into samples, a sample being a (row, id) pair
    (the ids themselves may differ)."""
    rows = torch.arange(got.shape[0])[:, None] * 1_000_000
    g, w = (got + rows).reshape(-1), (want + rows).reshape(-1)
    return bool(((g[:, None] == g[None, :]) == (w[:, None] == w[None, :])).all())


@pytest.mark.parametrize("start", [0, 2])  # position_ids_start: RoBERTa-like models start at 2
def test_boundaries_from_restarting_position_ids(start):
    pos = torch.cat([torch.arange(n) + start for n in LENGTHS])[None]
    found = read_boundaries({"position_ids": pos}, (1, 10))
    assert found is not None and found.source == "position_ids" and not found.withheld
    assert same_samples(found.segments, truth_ids(LENGTHS))


def test_boundaries_from_cu_seq_lens_seq_idx_and_megatron_params():
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    want = truth_ids(LENGTHS)
    for kwargs, source in [
        ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, "cu_seq_lens_q"),
        ({"cu_seqlens": cu}, "cu_seqlens"),
        ({"seq_idx": want.to(torch.int32)}, "seq_idx"),
        ({"packed_seq_params": type("PackedSeqParams", (), {"cu_seqlens_q": cu})()}, "packed_seq_params"),
        # a segment-id tensor wins over position ids that say otherwise
        ({"seq_idx": want, "position_ids": torch.arange(10)[None]}, "seq_idx"),
    ]:
        found = read_boundaries(kwargs, (1, 10))
        assert found is not None and found.source == source, kwargs
        assert same_samples(found.segments, want), kwargs


def test_plain_rows_and_left_padding_are_one_sample_each():
    # plain 0..T-1 rows: one sample per row; left padding that repeats position 1 makes
    # samples of pads only (no label tokens there: they count nowhere)
    rows = read_boundaries({"position_ids": torch.arange(6)[None].expand(2, 6)}, (2, 6))
    assert rows is not None and same_samples(rows.segments, torch.tensor([[0] * 6, [1] * 6]))
    padded = read_boundaries({"position_ids": torch.tensor([[1, 1, 0, 1, 2, 3]])}, (1, 6))
    assert padded is not None
    assert len(set(padded.segments[0, 2:].tolist())) == 1  # the real tokens: one sample
    assert read_boundaries({"attention_mask": torch.ones(2, 6)}, (2, 6)) is None  # nothing says


def test_boundaries_from_multimodal_rotary_positions():
    """Qwen2-VL's [3, B, T]: temporal positions, constant over an image's tokens, never
    decreasing within a sample; [4, B, T] leads with the text positions."""
    temporal = torch.tensor([0, 1, 2, 0, 1, 1, 1, 2, 0, 1])  # samples of 3, 5 (an image at 1), 2
    mrope = read_boundaries({"position_ids": temporal.expand(3, 1, 10)}, (1, 10))
    assert mrope is not None and same_samples(mrope.segments, truth_ids(LENGTHS))
    text = torch.cat([torch.arange(n) for n in LENGTHS])
    four = torch.stack([text, temporal, temporal, temporal])[:, None]
    found = read_boundaries({"position_ids": four}, (1, 10))
    assert found is not None and same_samples(found.segments, truth_ids(LENGTHS))
    plain = read_boundaries({"position_ids": torch.tensor([0, 1, 1, 1, 2, 3]).expand(3, 2, 6)}, (2, 6))
    assert plain is not None and same_samples(plain.segments, torch.tensor([[0] * 6, [1] * 6]))


def test_boundaries_that_cannot_be_read_are_withheld_with_a_reason():
    rows = read_boundaries({"cu_seq_lens_q": torch.tensor([0, 3, 8, 10])}, (2, 5))
    assert rows is not None and rows.segments is None and "over 2 rows" in rows.withheld
    odd = read_boundaries({"position_ids": torch.zeros(2, 1, 10, dtype=torch.long)}, (1, 10))
    assert odd is not None and odd.segments is None and "(2, 1, 10)" in odd.withheld


def test_image_tokens_class_each_sample_of_a_row():
    ids = torch.tensor([[5, 9, 6, 7, 63, 1, 2, 3, 63, 4]])  # samples of 3, 5, 2: the 2nd holds 63
    ids[0, 8] = 4  # only the second sample holds the image token
    codes = media_codes_per_sample(ids, [(0, -1), (1, 63)], truth_ids(LENGTHS))
    assert codes.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 0, 0]]


def test_a_plain_loop_gets_per_true_sample_figures_untagged(tmp_path):
    """Restarting position ids and no mask (the proper layout), the image token in the
    config, no tag: every per-sample figure equals the autograd truth per true sample."""
    torch.set_num_threads(1)
    result = job._loop(str(tmp_path), "loopmask", False, "token", 2, 1)
    truth = {t["step"]: t for t in result["truth"]}
    reports = [json.loads(line) for line in Path(result["reports"]).read_text().splitlines()]
    for r in reports:
        if any(e["kind"] == "run_end" for e in r.get("events", [])):
            continue  # close()'s report: no step of its own
        got = {(s["name"], s["labels"].get("modality")): s["value"] for s in r["samples"]}
        t = truth[r["step"]]
        assert got[("modality_grad_share_ratio", "image")] == pytest.approx(t["grad_share"], rel=1e-3)
        assert got[("modality_sample_share_ratio", "image")] == pytest.approx(t["sample_share"], rel=1e-6)
        assert got[("modality_token_share_ratio", "image")] == pytest.approx(t["token_share"], rel=1e-6)
        assert got[("modality_dilution_ratio", "image")] == pytest.approx(t["dilution"], rel=1e-3)
        assert got[("loss_norm_exponent", None)] == pytest.approx(t["exponent"], rel=1e-3)
        leak = [(s["labels"], s["value"]) for s in r["samples"] if s["name"] == "packing_leak_logit_change"]
        assert leak == ([({"cause": "unknown"}, 0.0)] if r["step"] == 1 else [])  # probed once: no leak


class PositionsLM(nn.Module):
    """A language model that takes position ids and ignores them (any shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def test_per_sample_figures_are_withheld_where_boundaries_cannot_be_read(caplog):
    """Cumulative lengths over two rows: which row a sample lies in is not said, so no
    per-sample or per-modality figure is made per row; the weight mass (no samples
    needed) still is."""
    model = PositionsLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (2, 5))
    with attach(model, opt, run="mrope", sink="null", every=1, modalities=("text",), loss_from_logits="head") as mon:
        for _ in range(2):
            logits = model(ids, cu_seq_lens_q=torch.tensor([0, 3, 8, 10], dtype=torch.int32))
            F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
            names = {s["name"] for s in mon.latest()}
            assert "loss_weight_mass" in names and mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0)
            assert not {n for n in names if n.startswith("modality_")} and "loss_norm_exponent" not in names
            (event,) = [e for e in mon.latest_events() if e["kind"] == "loss_samples_withheld"]
            assert "cumulative lengths over 2 rows" in event["detail"]
    assert any("figures withheld" in r.getMessage() for r in caplog.records)


def test_no_loss_is_claimed_for_a_modality_whose_tokens_carry_weight():
    """Text-coded positions inside samples that count as image (each holds image
    positions): text has no samples of its own, yet its label tokens carry all the loss.
    No event may say that none of its samples carries loss; one says so when every
    position of a modality lies in samples without label tokens."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ids = torch.randint(0, 64, (2, 8))
    labels, mask = ids.roll(-1, 1), torch.ones(2, 8, dtype=torch.bool)
    mask[:, :4] = False  # the image positions are no label tokens
    codes = torch.zeros(2, 8, dtype=torch.long)
    codes[:, :4] = 1  # both samples hold an image
    with attach(model, opt, run="vlm", sink="null", every=1, modalities=("text", "image")) as mon:
        for m in (mask, torch.zeros_like(mask)):
            pt = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
            mon.track_loss(pt, modality=codes, mask=m)
            ((pt * m).sum() / m.sum().clamp_min(1) + 0 * pt.sum()).backward()
            opt.step()
            opt.zero_grad()
            events = [e["labels"] for e in mon.latest_events() if e["kind"] == "modality_without_label_tokens"]
            if m.any():  # text tokens carry all the weight: no claim about text
                assert mon.value("modality_grad_share_ratio", modality="image") == 1.0
                assert events == []
            else:  # no label token anywhere: every position of both codes lies in label-less samples
                assert events == [{"modality": "text"}, {"modality": "image"}]


def test_static_causes_are_read_from_keywords_and_config():
    model = job.tiny_llama()
    pos = torch.arange(4)[None]
    assert static_causes(model, {"position_ids": pos}, "position_ids") == ["cache_in_training"]  # config use_cache
    model.config.use_cache = False
    assert static_causes(model, {"position_ids": pos}, "position_ids") == []
    ones = {"position_ids": pos, "attention_mask": torch.ones(1, 4)}
    assert static_causes(model, ones, "position_ids") == ["mask_beside_positions"]
    assert static_causes(model, {"cu_seq_lens_q": torch.tensor([0, 4])}, "cu_seq_lens_q") == ["varlen_ignored"]
    model.config._attn_implementation = "flash_attention_2"
    assert static_causes(model, ones, "position_ids") == []


def _dropout_job(signals, steps: int = 3):
    """A leaky layout (all-ones mask beside packed positions) with attention dropout: the
    probe runs on every report step when the packing signal is on."""
    torch.manual_seed(0)
    config = job.tiny_llama_config(image_token_id=job.IMAGE, attn_implementation="eager", attention_dropout=0.3)
    model = job.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    model.model.layers[0].mlp.eval()  # a submodule the job keeps in eval mode
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    collate = job.Collate("ones", False)
    measured = []
    with attach(model, opt, run="rng", sink="null", every=1, signals=signals, packing_probe_every=1) as mon:
        torch.manual_seed(1)
        for step in range(steps):
            batch = collate(job.samples(step))
            batch.pop("truth_sid"), batch.pop("truth_mod")
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            measured.append(mon.value("packing_leak_logit_change", cause="mask_beside_positions"))
    modes = {n: m.training for n, m in model.named_modules()}
    return [p.detach().clone() for p in model.parameters()], torch.get_rng_state(), modes, measured


def test_the_probe_leaves_the_rng_stream_weights_and_modes_as_they_were():
    probed, rng, modes, measured = _dropout_job(None)
    plain, rng_plain, modes_plain, unmeasured = _dropout_job(("optimizer", "params", "adam"))
    assert all(m is not None and m > 1e-3 for m in measured)  # the probe ran, and found the leak
    assert unmeasured == [None] * 3
    assert torch.equal(rng, rng_plain)
    assert all(torch.equal(a, b) for a, b in zip(probed, plain, strict=True))
    assert modes == modes_plain and modes["model.layers.0.mlp"] is False and modes[""] is True


HOOKS_DIR = str(Path(trainvitals.hooks.__file__).parent)


def test_the_packing_signal_reads_the_host_on_probe_steps_only(monkeypatch, tmp_path):
    """Host reads made by the packing signal's code, per step: none on report steps the
    probe does not run (static signs are device flags), a few on the probe's."""
    reads: Counter[int] = Counter()
    main = threading.get_ident()
    current = [0]
    packing_dir = str(Path(HOOKS_DIR) / "signals" / "packing")

    def spy_on(name: str) -> None:
        orig = getattr(torch.Tensor, name)

        def spy(t, *a, **k):
            if threading.get_ident() == main:
                frame = sys._getframe(1)
                while frame is not None:
                    if frame.f_code.co_filename.startswith(packing_dir):
                        reads[current[0]] += 1
                        break
                    frame = frame.f_back
            return orig(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)

    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "__index__", "numpy", "cpu"):
        spy_on(name)
    torch.set_num_threads(1)
    model = job.tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collate = job.Collate("ones", False)
    with attach(model, opt, run="sync", sink="null", every=1, packing_probe_every=3):
        for step in range(1, 7):
            current[0] = step
            batch = collate(job.samples(step))
            batch.pop("truth_sid"), batch.pop("truth_mod")
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    probe_steps = {1, 4}
    assert set(reads) <= probe_steps and reads[1] > 0, reads
