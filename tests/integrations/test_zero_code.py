"""Zero-code loss accounting (``attach(loss_from_logits=True)``): the weights read from
the logits' gradient give the figures ``track_loss`` gives on the same job (every
normalization scheme, several accumulation counts, packed rows, data parallel);
gradients that are not a plain cross-entropy one are reported as such, not as
figures; non-report steps place no hook; no host sync; nothing of the graph kept."""

from __future__ import annotations

import gc
import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.hooks._loss_models import MODALITIES, VOCAB, TokenModel, padded, samples
from tests.integrations._alerts import read_reports
from tests.integrations._plain import loss_figures, micro_batches, run_job
from tests.support import HostSyncSpy, one_torch_thread, run_ranks
from trainvitals.hooks import attach
from trainvitals.hooks.signals.loss.logits import recover

pytestmark = pytest.mark.usefixtures("loss_emission")  # both emission paths: tests/conftest.py

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def assert_same_figures(track: list[dict], zero: list[dict]) -> None:
    a, b = loss_figures(track), loss_figures(zero)
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), key


# -- equal to track_loss --------------------------------------------------------------
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("accum", [1, 2, 4])
@pytest.mark.parametrize("scheme", ["token", "sqrt", "sample", "mean-of-means", "undivided"])
def test_zero_code_figures_equal_track_loss_figures(scheme, accum, layout):
    steps = [micro_batches(accum, layout, seed=s) for s in range(2)]
    track = run_job(False, scheme, steps)
    zero = run_job(True, scheme, steps)
    assert_same_figures(track, zero)
    figures = loss_figures(zero)
    assert figures[("microbatches", ())] == accum
    mass = figures[("loss_weight_mass", (("objective", "main"),))]
    assert mass == pytest.approx(accum if scheme == "undivided" else 1.0, rel=1e-5)
    spread = figures.get(("token_weight_spread_ratio", (("objective", "main"),)))
    if scheme == "token":
        assert spread == pytest.approx(1.0, abs=1e-5)
    if scheme == "mean-of-means" and accum > 1:
        assert spread > 1.25  # the micro-batches' label-token counts differ


def test_declared_normalization_reaches_zero_code_figures_too():
    steps = [micro_batches(2, "padded", seed=3)]
    for declared in ("token", "sample"):
        track = run_job(False, "token", steps, loss_normalization=declared)
        zero = run_job(True, "token", steps, loss_normalization=declared)
        assert_same_figures(track, zero)


def test_recovered_weights_and_losses_equal_autograd_per_token():
    """The recovery itself against autograd: w = dL/dl_t and l_t = CE_t, per position."""
    torch.manual_seed(1)
    logits = (3 * torch.randn(6, 11, 50, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 50, (6, 11))
    labels[0, :4] = -100
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    w_true = torch.rand(per_token.shape, dtype=torch.float64) + 0.1
    (g,) = torch.autograd.grad((per_token * w_true).sum(), logits)
    rec = recover(g.reshape(-1, 50), logits.detach().reshape(-1, 50), torch.float64)
    label = labels.flatten() != -100
    assert torch.equal(rec.label, label)
    assert torch.equal(rec.target[label], labels.flatten()[label])
    torch.testing.assert_close(rec.weight[label], w_true[label], rtol=1e-10, atol=0)
    torch.testing.assert_close(rec.loss[label], per_token.detach()[label], rtol=1e-10, atol=1e-12)
    assert torch.all(rec.weight[~label] == 0)


# -- not a plain cross-entropy gradient -------------------------------------------------
def _peaked_step(loss_kind: str, dtype: torch.dtype, caplog) -> object:
    """One step of a model whose predictions are peaked (at a uniform softmax a smoothed
    gradient is exactly a cross-entropy one of weight (1 - eps) w), under ``loss_kind``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)).to(dtype)
    with torch.no_grad():
        model[1].weight.mul_(6.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, opt, run="ce-check", sink="null", every=1, loss_from_logits=True)
    rows = padded(samples([40, 9, 33], [0, 1, 0], seed=4))
    for _ in range(2):  # the log line comes at the next step, once the count is on the host
        logits = model(rows.ids).float().reshape(-1, VOCAB)[rows.mask.reshape(-1)]
        labels = rows.labels.reshape(-1)[rows.mask.reshape(-1)]
        ce = F.cross_entropy(logits, labels)
        if loss_kind == "ce":
            loss = ce
        elif loss_kind == "label-smoothing":
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        elif loss_kind == "distillation":
            teacher = torch.randn_like(logits)
            loss = ce + F.kl_div(
                F.log_softmax(logits, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean"
            )
        elif loss_kind == "z-loss":
            loss = ce + 1e-3 * torch.logsumexp(logits, -1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    return mon


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("loss_kind", ["label-smoothing", "distillation", "z-loss"])
def test_a_gradient_that_is_not_cross_entropy_is_said_not_reported(loss_kind, dtype, caplog):
    if loss_kind == "z-loss" and dtype == torch.bfloat16:
        # Its gradient 2c lse(z) p leaves the weights exact and is below bfloat16 rounding:
        # the figures are right, and nothing is said.
        mon = _peaked_step(loss_kind, dtype, caplog)
        assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=0.02)
        return
    caplog.set_level(logging.WARNING, logger="trainvitals")
    mon = _peaked_step(loss_kind, dtype, caplog)
    for name in ("loss_weight_mass", "token_weight_spread_ratio"):
        assert mon.value(name, objective="main") is None, name
    assert mon.value("loss") is None
    assert any("not a plain cross-entropy" in r.getMessage() for r in caplog.records), caplog.text
    assert [e["kind"] for e in mon.latest_events()] == ["loss_not_cross_entropy"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_plain_cross_entropy_gradient_reports_its_figures(dtype, caplog):
    caplog.set_level(logging.WARNING, logger="trainvitals")
    mon = _peaked_step("ce", dtype, caplog)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=tol)
    assert mon.value("token_weight_spread_ratio", objective="main") == pytest.approx(1.0, rel=tol)
    assert not [r for r in caplog.records if "cross-entropy" in r.getMessage()]
    assert not [e for e in mon.latest_events() if e["kind"] == "loss_not_cross_entropy"]


# -- cost: nothing off report steps, no host sync on them -----------------------------------
def test_non_report_steps_place_no_hook_and_report_steps_no_host_sync(monkeypatch):
    model = TokenModel(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = attach(model, opt, run="cost", sink="null", every=3, modalities=MODALITIES, loss_from_logits=True)
    hooked = []
    for step in range(1, 7):
        rows = padded(samples([12, 5, 9], [0, 1, 0], seed=step))
        spy = HostSyncSpy(monkeypatch) if step == 1 else None
        mon.tag_batch(modality=rows.modality)
        logits = model(rows.ids)
        hooked.append(bool(logits._backward_hooks))
        per_token = F.cross_entropy(logits.flatten(0, 1), rows.labels.flatten(), reduction="none")
        (per_token * rows.mask.flatten()).sum().div(rows.mask.sum()).backward()
        if spy is not None:
            assert spy.stop() == []
        opt.step()
        opt.zero_grad()
    mon.close()
    assert hooked == [mon.reports_at(s) for s in range(1, 7)] == [True, False, True, False, False, True]


# -- wrong use raises at once ----------------------------------------------------------------
def test_wrong_use_raises_with_what_to_do():
    model = TokenModel(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"no such module.*named_modules"):
        attach(model, opt, run="x", sink="null", loss_from_logits="lm_head")
    with pytest.raises(ValueError, match="cannot find the module that outputs the logits"):
        attach(nn.Sequential(nn.Linear(4, 4)), opt, run="x", sink="null", loss_from_logits=True)
    with pytest.raises(ValueError, match="loss_from_logits must be"):
        attach(model, opt, run="x", sink="null", loss_from_logits=3)
    with attach(model, opt, run="x", sink="null", modalities=MODALITIES, loss_from_logits=False) as mon:
        with pytest.raises(ValueError, match="tag_batch needs zero-code"):
            mon.tag_batch(modality="text")
    with attach(model, opt, run="x", sink="null", modalities=MODALITIES, loss_from_logits="head") as mon:
        assert mon.model.head._forward_hooks
        logits = model(torch.zeros(2, 3, dtype=torch.long))
        per_token = F.cross_entropy(logits.flatten(0, 1), torch.zeros(6, dtype=torch.long), reduction="none")
        with pytest.raises(ValueError, match="count them twice"):
            mon.track_loss(per_token, modality="text")
        with pytest.raises(TypeError, match="segments must be an integer tensor"):
            mon.tag_batch(segments=torch.zeros(2, 3))
    assert not model.head._forward_hooks  # close() removed it


# -- long run: nothing of the graph survives, memory flat --------------------------------------
def _graph_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def _long_run_micro_batch(model: nn.Module, mon, gen: torch.Generator) -> None:
    ids = torch.randint(0, 200, (8, 16), generator=gen)
    labels = ids.roll(-1, dims=1)
    labels[6:, :8] = -100  # short image answers
    mon.tag_batch(modality=torch.tensor([0] * 6 + [1] * 2))
    logits = model(ids)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).div(2).backward()


def test_200_zero_code_steps_keep_no_graph_and_flat_memory():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Embedding(200, 32), nn.RMSNorm(32), nn.Linear(32, 200))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    baseline = _graph_tensors()
    rss = {}
    with attach(
        model, opt, run="long-zero", sink="null", modalities=("text", "image"), every=1, loss_from_logits=True
    ) as mon:
        for step in range(1, 201):
            for _ in range(2):
                _long_run_micro_batch(model, mon, gen)
            opt.step()
            opt.zero_grad()
            if step % 50 == 0:
                assert _graph_tensors() == baseline, f"autograd graph kept after step {step}"
                rss[step] = _rss_mib()
        assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-5)
    assert rss[200] - rss[50] < 20, f"RSS grew {rss[200] - rss[50]:.1f} MiB from step 50 to 200: {rss}"


# -- data parallel ------------------------------------------------------------------------------
@pytest.mark.slow
def test_zero_code_equals_track_loss_on_two_gloo_ranks(tmp_path):
    results = run_ranks(HERE / "_plain.py", tmp_path / "rank0.json", world=2, timeout=180)
    assert_same_figures(results["track_loss"], results["zero_code"])
    figures = loss_figures(results["zero_code"])
    # Each rank normalizes by its own tokens, DDP averages: the step's mass is 1.
    assert figures[("loss_weight_mass", (("objective", "main"),))] == pytest.approx(1.0, rel=1e-5)
    assert figures[("microbatches", ())] == 2


# -- the head found by what it is; layouts and in-place losses -----------------------------
class _NanoLike(nn.Module):
    """65 tokens, 256 positions, an MLP sized like the position table, an untied head."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.wte = nn.Embedding(65, width)
        self.wpe = nn.Embedding(256, width)
        self.c_fc = nn.Linear(width, 256)
        self.c_proj = nn.Linear(256, width)
        self.lm_head = nn.Linear(width, 65, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        return self.lm_head(x + self.c_proj(torch.relu(self.c_fc(x))))


class _FunctionalHead(nn.Module):
    """A head that is not an nn.Linear: its own weight, applied with F.linear."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width) * 0.1)

    def forward(self, x):
        return F.linear(x, self.weight)


class _SeqFirst(nn.Module):
    """Logits [S, B, V], as Megatron's output layer gives them; ``inplace``: the loss
    overwrites them with their softmax before the backward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = _FunctionalHead(50, 16)

    def forward(self, ids):
        return self.head(self.embed(ids.t()))


def test_the_head_is_found_by_what_it_is():
    from trainvitals.hooks.logits_finder import find_logits_module, token_embedding

    untied = _NanoLike()
    assert token_embedding(untied) is untied.wte
    assert find_logits_module(untied, True) is untied.lm_head  # not c_fc, sized like wpe
    tied = _NanoLike()
    tied.wte.weight = tied.lm_head.weight
    tied.lm_head = nn.Linear(64, 65, bias=False)  # a decoy sized like the vocabulary...
    tied.out = nn.Linear(64, 65, bias=False)
    tied.out.weight = tied.wte.weight  # ...while the real head is the tied one
    assert find_logits_module(tied, True) is tied.out
    functional = _SeqFirst()
    assert find_logits_module(functional, True) is functional.head


def _weights_truth(logits_fn, ids, labels):
    """True weights by autograd on the per-token losses of the job's loss."""
    logits = logits_fn(ids)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    loss = per_token.sum() / 7.0
    (w,) = torch.autograd.grad(loss, per_token)
    return w


def test_sequence_first_logits_and_a_non_linear_head_give_the_true_weights():
    torch.manual_seed(0)
    model = _SeqFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ids = torch.randint(0, 50, (3, 9))
    labels = torch.randint(0, 50, (9, 3))  # sequence-first, as the logits
    labels[:, 0] = -100  # sample 0 is prompt only for half of it
    labels[:4, 0] = torch.randint(0, 50, (4,))
    w = _weights_truth(model, ids, labels.clamp_min(0)).view(9, 3)
    lab = labels != -100
    image = torch.tensor([False, True, True])  # per sample: a column of the [S, B] labels
    with attach(
        model, opt, run="seq-first", sink="null", every=1, modalities=("text", "image"), loss_from_logits=True
    ) as mon:
        mon.tag_batch(modality=image.long())
        logits = model(ids)
        per_token = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), reduction="none", ignore_index=-100)
        (per_token.sum() / 7.0).backward()
        opt.step()
        true_w = torch.where(lab, w, 0.0)
        assert mon.value("loss_weight_mass", objective="main") == pytest.approx(float(true_w.sum()), rel=1e-5)
        share = float(true_w[:, image].sum() / true_w.sum())
        assert share == pytest.approx(18 / 22)
        assert mon.value("modality_grad_share_ratio", modality="image") == pytest.approx(share, rel=1e-5)
        assert mon.value("modality_sample_share_ratio", modality="image") == pytest.approx(2 / 3)
        assert mon.value("token_weight_spread_ratio", objective="main") == pytest.approx(1.0, rel=1e-5)


class _InPlaceCE(torch.autograd.Function):
    """A fused cross-entropy that keeps its softmax in the logits' own memory."""

    @staticmethod
    def forward(ctx, logits, target):
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        logits.div_(logits.sum(-1, keepdim=True))  # now the softmax
        ctx.save_for_backward(logits, target)
        return -torch.log(logits.gather(-1, target[..., None])[..., 0])

    @staticmethod
    def backward(ctx, grad):
        p, target = ctx.saved_tensors
        g = p.clone()
        g.scatter_add_(-1, target[..., None], -torch.ones_like(target[..., None], dtype=g.dtype))
        return g * grad[..., None], None


class _WideHead(nn.Module):
    """The job names a block as its head (``loss_from_logits="body"``) whose output is not
    the token vocabulary's width: not logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 40), nn.Tanh())
        self.head = nn.Linear(40, 50)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def _blind_run(tmp_path, case: str, steps: int = 22):
    torch.manual_seed(0)
    model = _WideHead() if case == "layout" else _SeqFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = tmp_path / f"{case}.jsonl"
    head = "body" if case == "layout" else True
    ids = torch.randint(0, 50, (3, 9))
    with attach(model, opt, run=case, sink=f"file:{out}", every=1, loss_from_logits=head) as mon:
        for _ in range(steps):
            logits = model(ids)
            if case == "in-place":
                loss = _InPlaceCE.apply(logits, torch.randint(0, 50, (9, 3))).mean()
            else:
                loss = F.cross_entropy(logits.reshape(-1, 50), ids.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        coverage = {e["signal"]: e for e in mon.latest_coverage()}
        mass = mon.value("loss_weight_mass", objective="main")
    return coverage["loss"], mass, read_reports(out)


@pytest.mark.parametrize(
    ("case", "reason"),
    [("in-place", "logits_overwritten"), ("layout", "logits_layout"), ("healthy", None)],
)
def test_blind_zero_code_cases_say_their_true_reason_and_warn(tmp_path, caplog, case, reason):
    """Logits overwritten in place before the backward: "logits_overwritten", never "not
    a cross-entropy"; a named head whose output is not vocabulary-wide: "logits_layout".
    Each pages SignalInactive and is named in the close line; the healthy twin (the same
    model, a plain cross-entropy) is active and pages nothing."""
    caplog.set_level(logging.INFO, logger="trainvitals")
    loss, mass, reports = _blind_run(tmp_path, case)
    fired = {(a.rule.alert, tuple(sorted(a.labels.items()))) for a in firing_alerts(reports)}
    inactive = {labels for name, labels in fired if name == "SignalInactive"}
    text = caplog.text
    if reason is None:
        assert loss == {"signal": "loss", "active": True}
        assert mass == pytest.approx(1.0, rel=1e-5)
        assert not inactive
        assert "never engaged" not in text
        return
    assert loss["active"] is False and loss["reason"] == reason, loss
    assert mass is None
    assert (("reason", reason), ("signal", "loss")) in {tuple(x for x in lab if x[0] != "run") for lab in inactive}
    close = [r.getMessage() for r in caplog.records if "closed after 22 optimizer step(s)" in r.getMessage()]
    assert len(close) == 1 and f"never engaged: loss ({reason}" in close[0], close
    assert "not a plain cross-entropy" not in text
    if case == "layout":
        assert "has 40 entries in its last dimension, not the vocabulary's 50" in loss["detail"]


def firing_alerts(reports: list[dict]) -> list:
    from trainvitals.alerts import Engine, resolve_rules
    from trainvitals.wire.schema import Report, ends_run

    engine = Engine(resolve_rules("default"))
    for i, r in enumerate(reports):
        report = Report.model_validate(r)
        if not ends_run(report):
            engine.observe(report, now=1000.0 + i)
    return list(engine.firing())
