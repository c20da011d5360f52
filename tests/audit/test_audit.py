"""``trainvitals audit`` on checkpoints written by real training of a tiny model (I4
and its healthy twin, ``tests/audit/_i4.py``), in every format it reads; each figure
against the plain-torch truth computed here."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.audit import _i4
from tests.browser import browser
from tests.support import needs_tools
from trainvitals.audit.analysis import E4M3_BITS, INT8_BITS
from trainvitals.audit.sources import CHUNK
from trainvitals.hooks.signals.optimizer.resets import reset_between
from trainvitals.monitor.cli import main


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread: the tiny jobs gain nothing from more, and the machine is shared."""


@pytest.fixture(scope="module")
def runs() -> dict[str, _i4.Saved]:
    return {v: _i4.train(v) for v in ("bug", "healthy")}


def audit(*args: str) -> tuple[int, dict, str]:
    """Run the CLI; (exit status, its JSON, stderr)."""
    result = CliRunner().invoke(main, ["audit", "--json", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    data = json.loads(result.stdout) if result.stdout.strip().startswith("{") else {}
    return result.exit_code, data, result.stderr


def by_alert(data: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in data["findings"]:
        out.setdefault(f["alert"], []).append(f)
    return out


def test_i4_pages_and_locates_the_reset_between_checkpoints_2_and_3(runs, tmp_path: Path):
    saved = runs["bug"]
    _i4.write_torch(saved, tmp_path)
    status, data, _ = audit(str(tmp_path))
    assert status == 1  # a page-severity finding
    assert [c["step"] for c in data["checkpoints"]] == list(_i4.CHECKPOINTS)
    found = by_alert(data)

    # ParamDrift: the scale, in bits as the live signal, its walk against the truth.
    (drift,) = found["ParamDrift"]
    truth = _i4.drift_truth(saved, "out_scale")
    assert truth[-1] > 1.0  # the incident: over the rule's 1 bit
    assert drift["severity"] == "page" and drift["subject"] == "out_scale"
    assert drift["value"] == pytest.approx(truth[-1], rel=1e-6)
    assert drift["detail"]["walk"] == pytest.approx(truth, rel=1e-6, abs=1e-9)
    assert drift["detail"]["not_checked"] == [] and drift["detail"]["failed"] == []
    walk = data["one_d"]["out_scale"]
    assert walk["monotone"] is True and walk["consistency"] == 1.0 and walk["weight_decay"] == 0.0
    assert "earliest checkpoint ckpt-5.pt" in data["reference"]["description"]

    # The biases the loss moves far and steadily are not the incident.
    for bias in ("lin1.bias", "lin2.bias"):
        assert data["one_d"][bias]["walk"] == pytest.approx(_i4.drift_truth(saved, bias), rel=1e-6, abs=1e-9)
    assert all(f["severity"] == "info" for f in found["ParamDrift"] if f["subject"] != "out_scale")

    # The reset: between checkpoints 2 and 3, every parameter's step count went back.
    (reset,) = found["OptimizerStateReset"]
    assert reset["detail"]["between"] == [2, 3]
    steps_2, steps_3 = _i4.CHECKPOINTS[1], _i4.CHECKPOINTS[2] - _i4.REBUILD_AT
    assert reset["detail"]["params"]["out_scale"] == f"its step count went back ({steps_2} -> {steps_3})"
    assert len(reset["detail"]["params"]) == 5

    # Adam's eps share at each checkpoint, against the element-wise truth.
    (eps,) = found["AdamEpsilonDominated"]
    assert eps["subject"] == "out_scale" and eps["severity"] == "warning"
    ratios = [_i4.eps_truth(saved, i, "out_scale") for i in range(3)]
    assert eps["value"] == max(r for r, _ in ratios) == 1.0
    assert eps["detail"]["checkpoints"] == [1, 2, 3]
    assert walk["adam_eps_dominated_ratio"] == pytest.approx(ratios[-1][0])
    assert walk["adam_normalized_update_rms"] == pytest.approx(ratios[-1][1], rel=1e-6)

    # Weight-decay coverage: every 1D parameter, the scale among the drifted.
    (wd,) = found["WeightDecayCoverage"]
    assert wd["detail"]["no_weight_decay"] == ["lin1.bias", "lin2.bias", "out_scale"]
    assert "out_scale" in wd["detail"]["drifted"]


def test_the_healthy_twin_is_clean(runs, tmp_path: Path):
    _i4.write_torch(runs["healthy"], tmp_path)
    status, data, _ = audit(str(tmp_path))  # --fail-on warning, the default
    assert status == 0
    assert [f for f in data["findings"] if f["severity"] != "info"] == []
    assert data["one_d"]["out_scale"]["walk"] == [0.0, 0.0, 0.0]
    assert "OptimizerStateReset" not in by_alert(data)


def _key(data: dict, strip: str = "") -> set[tuple]:
    return {
        (f["alert"], f["severity"], (f["subject"] or "").removeprefix(strip), round(f["value"], 9))
        for f in data["findings"]
    }


@pytest.mark.parametrize("layout", ["state_dict", "model_state_dict", "lightning", "hf", "dcp"])
def test_each_format_gives_the_same_findings(runs, tmp_path: Path, layout: str):
    saved = runs["bug"]
    _i4.write_torch(saved, tmp_path / "reference")
    _, expected, _ = audit(str(tmp_path / "reference"))
    folder = tmp_path / layout
    if layout == "lightning":
        _i4.write_lightning_layout(saved, folder)
    elif layout == "hf":
        _i4.write_hf(saved, folder)
    elif layout == "dcp":
        _i4.write_dcp(saved, folder)
    else:
        _i4.write_torch(saved, folder, layout)
    status, data, _ = audit(str(folder))
    assert status == 1
    assert _key(data, "model." if layout == "lightning" else "") == _key(expected)
    assert [c["step"] for c in data["checkpoints"]] == list(_i4.CHECKPOINTS)


@pytest.mark.parametrize("layout", ["safetensors", "bare"])
def test_model_only_checkpoints_say_what_they_could_not_check(runs, tmp_path: Path, layout: str):
    saved = runs["bug"]
    if layout == "safetensors":
        paths = _i4.write_safetensors(saved, tmp_path)
    else:
        paths = _i4.write_torch(saved, tmp_path, "bare")
    status, data, _ = audit(*map(str, reversed(paths)))  # taken in step order whatever the order given
    assert [c["step"] for c in data["checkpoints"]] == list(_i4.CHECKPOINTS)
    (drift,) = [f for f in data["findings"] if f["subject"] == "out_scale"]
    assert drift["alert"] == "ParamDrift" and drift["severity"] == "warning"
    assert drift["value"] == pytest.approx(_i4.drift_truth(saved, "out_scale")[-1], rel=1e-6)
    assert any("param_weight_decay" in c and "not checked" in c for c in drift["detail"]["not_checked"])
    assert status == 1  # a warning, under the default --fail-on warning
    assert audit("--fail-on", "page", *map(str, paths))[0] == 0


def test_reference_checkpoint_and_init(runs, tmp_path: Path):
    saved = runs["bug"]
    paths = _i4.write_torch(saved, tmp_path)
    # --reference: the first checkpoint given apart, the last one audited
    _, data, _ = audit("--reference", str(paths[0]), str(paths[-1]))
    assert data["one_d"]["out_scale"]["walk"] == pytest.approx([_i4.drift_truth(saved, "out_scale")[-1]], rel=1e-6)
    # One checkpoint: the known initial values; a norm scale by its name, biases withheld.
    model = {"norm.weight": torch.full((4,), 3.0), "norm.bias": torch.zeros(4), "lin.weight": torch.ones(4, 4)}
    torch.save(model, tmp_path / "one.pt")
    _status, data, _ = audit(str(tmp_path / "one.pt"))
    assert data["reference"]["kind"] == "init"
    assert data["one_d"]["norm.weight"]["walk"] == [pytest.approx(math.log2(1 + 2.0 / 1.0))]
    assert "a bias starts at 0" in data["one_d"]["norm.bias"]["withheld"]
    (drift,) = by_alert(data)["ParamDrift"]
    assert drift["severity"] == "warning"  # no optimizer state: conditions not checked


def test_quantization_range_against_hand_computed_truth(tmp_path: Path):
    from safetensors.torch import save_file

    n = CHUNK + 1000  # more than one chunk
    spiky = torch.ones(n)
    spiky[123] = 300.0  # one outlier
    rows = torch.randn(3 * CHUNK // 1000 + 1, 1000, generator=torch.Generator().manual_seed(0))  # row slices
    tensors = {"spiky": spiky, "rows": rows, "flat": torch.full((10,), -2.0)}
    save_file(tensors, str(tmp_path / "q.safetensors"))
    torch.save(tensors, tmp_path / "q.pt")
    for f in ("q.safetensors", "q.pt"):
        _status, data, _ = audit(str(tmp_path / f))
        q = {e["tensor"]: e for e in data["quantization"]}
        assert [e["tensor"] for e in data["quantization"]] == ["spiky", "rows", "flat"]  # worst first
        rms = math.sqrt((n - 1 + 300.0**2) / n)
        bits = math.log2(300.0 / rms)
        assert q["spiky"]["range_bits"] == pytest.approx(bits, rel=1e-6)  # float32 norms per chunk
        assert q["spiky"]["int8_bulk_bits"] == pytest.approx(INT8_BITS - bits, rel=1e-6)
        assert q["spiky"]["e4m3_headroom_bits"] == pytest.approx(math.log2(448 * 64) - bits, rel=1e-6)
        assert E4M3_BITS == pytest.approx(math.log2(448 / 2**-6))
        r64 = rows.double()
        assert q["rows"]["range_bits"] == pytest.approx(
            math.log2(float(r64.abs().max()) / math.sqrt(float(r64.square().mean()))), rel=1e-6
        )
        assert q["flat"]["range_bits"] == 0.0
        (finding,) = by_alert(data)["QuantizationRange"]
        assert finding["subject"] == "spiky" and finding["severity"] == "warning" and bits > 5


def test_non_finite_values_page(runs, tmp_path: Path):
    saved = runs["bug"]
    o = saved.optimizers[-1]
    state = {k: dict(v) for k, v in o["state"].items()}
    key = list(_i4.Readout().state_dict()).index("out_scale")  # its place in the optimizer's order
    v = state[key]["exp_avg_sq"].clone()
    v.fill_(float("nan"))
    state[key]["exp_avg_sq"] = v
    model = dict(saved.models[-1])
    w = model["lin1.weight"].clone()
    w[0, :3] = float("inf")
    model["lin1.weight"] = w
    torch.save({"model": model, "optimizer": {**o, "state": state}, "step": 60}, tmp_path / "bad.pt")
    status, data, _ = audit(str(tmp_path / "bad.pt"))
    assert status == 1
    bad = {f["subject"]: f["value"] for f in by_alert(data)["NonFiniteTensor"]}
    assert bad == {"lin1.weight": 3.0, "out_scale (exp_avg_sq)": 1.0}


def test_unreadable_input_is_refused_with_the_file_named(tmp_path: Path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    status, _, err = audit(str(garbage))
    assert status == 2 and str(garbage) in err
    module = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), module)
    status, _, err = audit(str(module))
    assert status == 2 and "weights_only" in err and "state dicts" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    status, _, err = audit(str(empty))
    assert status == 2 and "no checkpoint in this folder" in err
    status, _, err = audit(str(tmp_path / "missing"))
    assert status == 2 and "no such file" in err
    (tmp_path / "x.pt").write_bytes(pickle.dumps(object()))
    assert audit(str(tmp_path / "x.pt"))[0] == 2


def test_unnamed_optimizer_parameters_are_said_not_guessed(tmp_path: Path):
    """Two parameters of one shape in a model file that does not keep their order: the
    optimizer's entries cannot be told apart, so they are not named."""
    from safetensors.torch import save_file

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    save_file(dict(model.state_dict()), str(d / "model.safetensors"))
    torch.save(opt.state_dict(), d / "optimizer.pt")
    (d / "trainer_state.json").write_text('{"global_step": 1}')
    _, data, _ = audit(str(d))
    assert data["checkpoints"][0]["optimizer_names"].startswith("not matched to names")
    assert all(f["subject"] is None or not f["subject"].startswith("optimizer param") for f in data["findings"])
    # pytorch_model.bin keeps the definition order: named by order and shape.
    (d / "model.safetensors").unlink()
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    _, data, _ = audit(str(d))
    assert data["checkpoints"][0]["optimizer_names"] == "matched to the model's tensors by order and shape"


def test_reset_between_truth():
    assert reset_between(None, 3.0, 10) is None  # new parameter
    assert reset_between(20.0, None, 10) == "its optimizer state vanished"
    assert reset_between(20.0, 15.0, 30) == "its step count went back (20 -> 15)"
    assert reset_between(5.0, 8.0, 10) == "its step count restarted (5 -> 8 over 10 steps)"
    assert reset_between(5.0, 15.0, 10) is None
    assert reset_between(5.0, 15.0, None) is None


def test_html_page_and_table(runs, tmp_path: Path):
    _i4.write_torch(runs["bug"], tmp_path / "ck")
    out = tmp_path / "audit.html"
    result = CliRunner().invoke(main, ["audit", "--html", str(out), str(tmp_path / "ck")])
    assert result.exit_code == 1
    text = result.stdout
    assert text.splitlines()[0] == "3 checkpoint(s), in step order:"
    head = next(line for line in text.splitlines() if line.startswith("SEVERITY"))
    assert head.split() == ["SEVERITY", "FINDING", "PARAM/TENSOR", "VALUE", "WHERE", "WHAT", "TO", "DO"]
    assert any(line.startswith("page") and "ParamDrift" in line and "out_scale" in line for line in text.splitlines())
    assert "reading checkpoints" in result.stderr
    page = out.read_text()
    assert "ParamDrift" in page and "OptimizerStateReset" in page and "Content-Security-Policy" in page


@needs_tools("chromium")
def test_the_audit_page_in_chromium(runs, tmp_path: Path):
    _i4.write_torch(runs["bug"], tmp_path / "ck")
    out = tmp_path / "audit.html"
    CliRunner().invoke(main, ["audit", "--html", str(out), str(tmp_path / "ck")])
    with browser() as b:
        b.open(out.as_uri())
        facts = b.evaluate(
            """({incidents: Array.from(document.querySelectorAll('tr.incident')).map(r =>
                    Array.from(r.querySelectorAll('td')).slice(0, 3).map(td => td.textContent)),
                 plots: Array.from(document.querySelectorAll('figure.plot')).map(f => f.dataset.panel)})"""
        )
        requests, console = b.requests, b.console
    assert requests == [out.as_uri()] and console == []
    assert ["ParamDrift", "page", "param=out_scale"] in facts["incidents"]
    assert {"drift", "adam_eps"} <= set(facts["plots"])


def test_tied_weights_and_two_groups_are_named(tmp_path: Path):
    """A head tied to the embedding is one parameter under two names in the state dict;
    the optimizer holds it once, in the decay group, with the norm in the other."""
    torch.manual_seed(0)
    emb, norm, head = torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, norm, head)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ]
    )
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, tmp_path / "tied.pt")
    _, data, _ = audit(str(tmp_path / "tied.pt"))
    assert list(model.state_dict()) == ["0.weight", "1.weight", "1.bias", "2.weight"]
    assert data["checkpoints"][0]["optimizer_names"] == "matched to the model's tensors by order and shape"
    (wd,) = by_alert(data)["WeightDecayCoverage"]
    assert wd["detail"]["no_weight_decay"] == ["1.bias", "1.weight"]


def test_a_stage_that_adds_parameters_is_a_regrouping_not_a_walk_back(tmp_path: Path):
    """Stage 2 adds a parameter group (a new head): the groups changed between the
    checkpoints; the old parameters' step counts go on, the new one's start later."""
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(body.parameters(), lr=1e-2)
    paths = []
    for step in range(1, 9):
        if step == 5:
            opt.add_param_group({"params": list(head.parameters())})
        out = head(body(torch.randn(3, 4))) if step >= 5 else body(torch.randn(3, 4))
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step in (4, 8):
            model = {**{f"body.{k}": v for k, v in body.state_dict().items()}}
            model.update({f"head.{k}": v for k, v in head.state_dict().items()})
            paths.append(tmp_path / f"ckpt-{step}.pt")
            torch.save({"model": model, "optimizer": opt.state_dict(), "step": step}, paths[-1])
    _, data, _ = audit(*map(str, paths))
    resets = by_alert(data)["OptimizerStateReset"]
    between = next(f for f in resets if f["detail"].get("between") == [1, 2])
    assert between["detail"]["groups"].startswith("param groups changed (1 -> 2 groups, 2 parameters added, 0 removed)")
    assert between["detail"]["params"] == {}  # body's step counts went 4 -> 8: no reset
    spread = next(f for f in resets if f["where"].startswith("ckpt-8.pt"))
    assert spread["detail"]["step_counts"] == {"8": 2, "4": 2}


def test_host_drift_maths_is_the_devices():
    """judged_scales and drift_log2 (what the audit and the sender thread use) against
    the device's own steps in DriftTracker.drift_bits: nanmedian of the scales that are
    not 0, times 1e-2, as a floor; log2(1 + moved / judged)."""
    from trainvitals.hooks.signals.params.drift import NEIGHBOUR_FLOOR, drift_log2, judged_scales

    scales = torch.tensor([0.0, 1e-8, 1.0, 2.0, 3.0])
    known = torch.where(scales > 0, scales, float("nan"))
    floor = torch.nan_to_num(torch.nanmedian(known), nan=0.0) * NEIGHBOUR_FLOOR
    device = torch.maximum(scales, floor)
    assert judged_scales(scales.tolist()) == pytest.approx(device.tolist(), rel=1e-7)
    moved = torch.tensor([0.5, 0.0, 55.0, 1.0, 3.0])
    on_device = torch.addcdiv(torch.ones(()), moved, device.clamp_min(1e-38)).log2()
    host = [drift_log2(m, j) for m, j in zip(moved.tolist(), judged_scales(scales.tolist()), strict=True)]
    assert host == pytest.approx(on_device.tolist(), rel=1e-6)
    assert drift_log2(55.0, 1.0) == pytest.approx(math.log2(56))  # I4: 1.0 -> 56, 5.8 bits
