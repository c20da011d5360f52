"""What ``trainvitals audit`` finds in checkpoints: the I4 family of failures (docs/audit.md).

Each checkpoint is read once, tensor by tensor in chunks (:func:`look`), into a few
numbers per tensor (absmax, RMS, non-finite count), per optimizer parameter (its step
count, Adam's eps-dominated share, normalized update RMS and gradient RMS from the
second moment) and the values of the 1D parameters (kept: they are small). The findings
(:func:`judge`) use the live signals' maths and the default rules' thresholds:

- ``ParamDrift``: ``param_drift_log2`` of each 1D parameter against its reference
  (:func:`~trainvitals.hooks.signals.params.drift.drift_log2`, judged scale and all), its
  walk across the checkpoints and the sign consistency of its changes; the rule's
  conditions (consistency, weight decay, relative gradient RMS) checked where the
  checkpoints have what they need, and said where they do not;
- ``AdamEpsilonDominated``: the share of elements with ``sqrt(v_hat) < eps``
  (:func:`~trainvitals.hooks.signals.optimizer.adam_moments.bias_factors`) with the rule's
  conditions;
- ``OptimizerStateReset``: step counts that went back or restarted between two
  checkpoints (:func:`~trainvitals.hooks.signals.optimizer.resets.reset_between`), or that
  differ across the parameters of one;
- ``WeightDecayCoverage``: the 1D parameters their param groups give no weight decay;
- ``QuantizationRange``: per tensor, ``log2(absmax / RMS)``, the bits of a per-tensor
  INT8 / FP8 E4M3 scale that its largest values take from the bulk;
- ``NonFiniteTensor``: NaN or inf in any tensor, parameter or moment.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from trainvitals.audit.sources import Checkpoint, TensorRef
from trainvitals.hooks.signals.optimizer.adam_moments import bias_factors
from trainvitals.hooks.signals.optimizer.resets import reset_between
from trainvitals.hooks.signals.params.drift import drift_log2, judged_scales, sign_consistency
from trainvitals.hooks.signals.params.weight_decay import decays, weight_decay_message

INT8_LEVELS = 127
"""A symmetric per-tensor INT8 scale maps absmax to 127."""
E4M3_MAX, E4M3_MIN_NORMAL = 448.0, 2.0**-6
"""FP8 E4M3 (``float8_e4m3fn``): its largest value and its smallest normal one."""
INT8_BITS = math.log2(INT8_LEVELS)
E4M3_BITS = math.log2(E4M3_MAX / E4M3_MIN_NORMAL)
QUANT_WARN_BITS = 5.0
"""QuantizationRange warns above this: values of the tensor's RMS get fewer than
log2(127) - 5 = 2 bits (4 INT8 levels). A Gaussian tensor of 1e8 elements reads ~2.6."""
SHOWN = 10
"""Tensors of the quantization ranking in the table (the JSON has every one)."""

_NORM_SCALE = re.compile(r"(?:^|\.)(?:[\w]*norm[\w]*|ln(?:_\w+|\d+)?)\.(?:weight|scale|gamma|g)$", re.I)


# -- reading a checkpoint --------------------------------------------------------------
@dataclass
class TensorFigures:
    numel: int
    absmax: float
    rms: float
    nonfinite: int

    @property
    def range_bits(self) -> float:
        """``log2(absmax / RMS)``; 0 for an all-zero tensor, NaN with a non-finite element."""
        if self.nonfinite:
            return math.nan
        if self.absmax == 0.0:
            return 0.0
        return math.log2(self.absmax / self.rms)


@dataclass
class AdamFigures:
    step: float | None
    group: int
    eps_ratio: float | None = None
    update_rms: float | None = None
    grad_rms: float | None = None
    """sqrt(mean v_hat): the gradient's RMS as Adam's second moment averages it."""
    nonfinite: dict[str, int] = field(default_factory=dict)


@dataclass
class Look:
    """What one checkpoint gave the audit (its tensors are let go)."""

    index: int
    label: str
    path: str
    format: str
    step: int | None
    step_from: str
    notes: list[str]
    one_d: dict[str, torch.Tensor]
    tensors: dict[str, TensorFigures]
    has_optimizer: bool
    naming: str = ""
    adam: dict[str, AdamFigures] = field(default_factory=dict)
    """Per parameter name (or the optimizer's own key when unnamed)."""
    weight_decay: dict[str, float] = field(default_factory=dict)
    """Per named parameter: its group's weight decay."""
    hyper: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: list[tuple[str, ...]] = field(default_factory=list)
    """Each param group's parameters (names, or the optimizer's keys when unnamed)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index + 1,
            "path": self.path,
            "format": self.format,
            "step": self.step,
            "step_from": self.step_from or None,
            "optimizer": self.has_optimizer,
            "optimizer_names": self.naming or None,
            "notes": self.notes,
        }


def _nonfinite(x: torch.Tensor) -> int:
    return int(x.numel() - torch.isfinite(x).sum())


_ROW = 1024


def _sumsq(x: torch.Tensor) -> float:
    """The sum of squares of a flat float tensor: norms of rows of 1024 elements (float32,
    as fast as one norm; relative error ~1e-9 where a single float32 norm of 4M elements
    errs by ~1e-4), their squares summed in float64."""
    n = x.numel()
    k = n - n % _ROW
    total = 0.0
    if k:
        total += float(torch.linalg.vector_norm(x[:k].view(-1, _ROW), dim=1).double().square().sum())
    if n > k:
        total += float(x[k:].double().square().sum())
    return total


def _figures(ref: TensorRef, progress: Callable[[int], None]) -> tuple[TensorFigures, torch.Tensor | None]:
    """absmax, RMS and non-finite count of one tensor, chunk by chunk (two passes over a
    chunk: its min and max, its sum of squares; the non-finite elements are counted only when those
    say there are some); the values too for a 1D tensor."""
    absmax, sumsq, bad = 0.0, 0.0, 0
    keep = ref.dtype.is_floating_point and len(ref.shape) <= 1
    kept: list[torch.Tensor] = []
    for chunk in ref.chunks():
        x = chunk if chunk.dtype in (torch.float32, torch.float64) else chunk.to(torch.float32)
        if x.numel():
            low, high = torch.aminmax(x)
            sq = _sumsq(x)
            top = max(-float(low), float(high))
            if not (math.isfinite(sq) and math.isfinite(top)):
                bad += _nonfinite(x)
                x = torch.where(torch.isfinite(x), x, 0.0)
                top = float(x.abs().amax())
                sq = _sumsq(x)
            absmax = max(absmax, top)
            sumsq += sq
        if keep:
            kept.append(x.to(torch.float32).clone())
        progress(chunk.numel() * chunk.element_size())
    n = ref.numel
    rms = math.sqrt(sumsq / n) if n else 0.0
    return TensorFigures(n, absmax, rms, bad), (torch.cat(kept) if kept else torch.zeros(0)) if keep else None


def _adam(
    moments: dict[str, TensorRef], hyper: dict[str, Any], step: float | None, progress: Callable[[int], None]
) -> AdamFigures:
    """Adam's figures for one parameter, in chunks (m and v read side by side), in
    float32 as the live signal computes them: the share of sqrt(v) < c, the RMS of
    m / (sqrt(v) + c) times g (:func:`bias_factors`), and the mean of v over 1 - b2**t."""
    out = AdamFigures(step, -1)
    v_name = "max_exp_avg_sq" if hyper.get("amsgrad") and "max_exp_avg_sq" in moments else "exp_avg_sq"
    if "exp_avg" not in moments or v_name not in moments or step is None or step <= 0:
        return out
    betas, eps = hyper.get("betas"), hyper.get("eps")
    if betas is None or eps is None:
        return out
    c, g = bias_factors(float(betas[0]), float(betas[1]), float(eps), float(step))
    bc2 = max(1.0 - float(betas[1]) ** float(step), 1e-30)
    below, upd, vsum, n = 0, 0.0, 0.0, 0
    bad: dict[str, int] = {}
    for m, v in zip(moments["exp_avg"].chunks(), moments[v_name].chunks(), strict=True):
        m32, v32 = m.to(torch.float32), v.to(torch.float32)
        vs = float(v32.sum())  # float32, cascade-summed per chunk; the chunks add up in float64
        root = v32.sqrt()  # a new tensor: the checkpoint's is not written
        below += int(torch.count_nonzero(root < c))
        un = _sumsq(m32 / root.add_(c))
        if not (math.isfinite(vs) and math.isfinite(un)):
            for name, t in (("exp_avg", m32), (v_name, v32)):
                k = _nonfinite(t)
                if k:
                    bad[name] = bad.get(name, 0) + k
        upd += un
        vsum += vs
        n += m.numel()
        progress(m.numel() * (m.element_size() + v.element_size()))
    if n:
        out.eps_ratio = below / n
        out.update_rms = g * math.sqrt(upd / n)
        out.grad_rms = math.sqrt(max(vsum / n / bc2, 0.0))
    out.nonfinite = bad
    return out


def look(
    ck: Checkpoint, index: int, progress: Callable[[int], None] = lambda n: None, *, one_d_only: bool = False
) -> Look:
    """Read ``ck`` once into the numbers the findings need."""
    lk = Look(
        index,
        ck.label,
        str(ck.path),
        ck.format,
        ck.step,
        ck.step_from,
        list(ck.notes),
        {},
        {},
        ck.optimizer is not None,
    )
    for name, ref in ck.model.items():
        if not ref.dtype.is_floating_point or (one_d_only and len(ref.shape) > 1):
            continue
        figs, values = _figures(ref, progress)
        lk.tensors[name] = figs
        if values is not None:
            lk.one_d[name] = values
    opt = ck.optimizer
    if opt is None or one_d_only:
        return lk
    lk.naming = opt.naming
    lk.groups = [tuple(opt.name(p) for p in g.params) for g in opt.groups]
    for g in opt.groups:
        for p in g.params:
            if p in opt.names:
                lk.weight_decay[opt.names[p]] = g.weight_decay
        lk.hyper[str(g.index)] = {
            k: v for k, v in g.hyper.items() if isinstance(v, (int, float, str, bool, tuple, list))
        }
    for key, st in opt.states.items():
        group = opt.groups[st.group] if 0 <= st.group < len(opt.groups) else None
        moments = _adam(st.tensors, group.hyper if group else {}, st.step, progress)
        moments.group = st.group
        for mname, t in st.tensors.items():  # moments not read above (non-Adam optimizers)
            if mname not in moments.nonfinite and moments.eps_ratio is None:
                tf, _ = _figures(t, progress)
                if tf.nonfinite:
                    moments.nonfinite[mname] = tf.nonfinite
        lk.adam[opt.name(key)] = moments
    return lk


# -- findings --------------------------------------------------------------------------
@dataclass
class Finding:
    alert: str
    severity: str
    subject: str | None
    """The parameter or tensor (None: the whole checkpoint)."""
    value: float | None
    unit: str
    where: str
    """The checkpoint, or the pair of checkpoints, it was seen at."""
    summary: str
    action: str
    runbook: str
    metric: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        if out["value"] is not None and not math.isfinite(out["value"]):
            out["value"] = None
        return out


SEVERITY_ORDER = {"page": 0, "warning": 1, "info": 2}


@lru_cache(maxsize=1)
def _rules() -> dict[str, Any]:
    from trainvitals.alerts.loading import resolve_rules

    return {r.alert: r for r in resolve_rules("default")}


AUDIT_FIXES = {
    "WeightDecayCoverage": "Give the drifted ones explicit weight decay in their own param group, or register a "
    "gradient hook that zeros their gradient.",
    "NonFiniteTensor": "Resume from the last checkpoint the audit finds clean, with a lower learning rate or "
    "gradient clipping.",
    "QuantizationRange": "Quantize that tensor per channel or per block instead of per tensor, or keep it in "
    "higher precision; if a drifted 1D parameter caused it, fix the drift first.",
}
"""What to do about the findings that have no live alert (and so no runbook section):
their sections in docs/audit.md say more."""


def _action(alert: str) -> tuple[str, str]:
    """The first sentence of the alert's runbook fix and the runbook's anchor; for the
    audit's own findings, :data:`AUDIT_FIXES` and their section in docs/audit.md."""
    from trainvitals.alerts.verdict import runbook_fix

    if alert in AUDIT_FIXES:
        return AUDIT_FIXES[alert], f"docs/audit.md#{alert.lower()}"
    return runbook_fix(alert) or f"see the runbook of {alert}", f"RUNBOOKS.md#{alert.lower()}"


@dataclass
class Reference:
    """What the 1D drifts are measured from."""

    kind: str  # "checkpoint" (the earliest given, or --reference) or "init"
    label: str
    values: dict[str, torch.Tensor]
    withheld: dict[str, str] = field(default_factory=dict)
    """1D parameters without a reference, with the reason."""
    look: int | None = None
    """The audited checkpoint (0-based) that is the reference, if one is."""

    def describe(self) -> str:
        if self.kind == "init":
            return "the known initial values (1.0 for a norm scale); " + self.label
        return self.label


def init_reference(looks: list[Look]) -> Reference:
    """1.0 for every norm scale the names tell; no reference for the others."""
    first = looks[0]
    values, withheld = {}, {}
    for name, v in first.one_d.items():
        if _NORM_SCALE.search(name):
            values[name] = torch.ones_like(v)
        elif name.rsplit(".", 1)[-1] == "bias":
            withheld[name] = (
                "a bias starts at 0, which has no range to measure a drift against; give an earlier checkpoint"
            )
        else:
            withheld[name] = "its initial value is not known from its name; give an earlier checkpoint or --reference"
    return Reference("init", "a single checkpoint", values, withheld)


@dataclass
class Audit:
    looks: list[Look]
    reference: Reference
    findings: list[Finding]
    one_d: dict[str, dict[str, Any]]
    quantization: list[dict[str, Any]]

    @property
    def worst(self) -> str | None:
        sev = [f.severity for f in self.findings]
        return min(sev, key=SEVERITY_ORDER.__getitem__) if sev else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoints": [lk.as_dict() for lk in self.looks],
            "reference": {
                "kind": self.reference.kind,
                "description": self.reference.describe(),
                "withheld": self.reference.withheld,
            },
            "findings": [f.as_dict() for f in self.findings],
            "one_d": self.one_d,
            "quantization": self.quantization,
        }


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _cond_met(cond: Any, value: float | None) -> bool | None:
    if value is None or not math.isfinite(value):
        return None
    if cond.above is not None:
        return bool(value > cond.above)
    return bool(value < cond.below)


def judge(looks: list[Look], reference: Reference) -> Audit:
    """The findings of ``looks`` (in step order) against ``reference``."""
    findings: list[Finding] = []
    rules = _rules()
    last = looks[-1]
    with_opt = [lk for lk in looks if lk.has_optimizer]
    last_opt = with_opt[-1] if with_opt else None

    # Relative gradient RMS (from Adam's second moment), at the last checkpoint with it.
    rel_grad: dict[str, float] = {}
    if last_opt is not None:
        rms = {n: a.grad_rms for n, a in last_opt.adam.items() if a.grad_rms is not None and math.isfinite(a.grad_rms)}
        if rms:
            ordered = sorted(rms.values())
            median = ordered[(len(ordered) - 1) // 2]
            rel_grad = {n: (r / median if median > 0 else math.nan) for n, r in rms.items()}

    # -- 1D drift -------------------------------------------------------------------
    one_d: dict[str, dict[str, Any]] = {}
    names = [n for n in last.one_d if n in reference.values or n in reference.withheld]
    names += [n for n in last.one_d if n not in names]
    refs: dict[str, torch.Tensor] = {}
    for name in names:
        ref = reference.values.get(name)
        if ref is None:
            continue
        if ref.numel() and float(ref.abs().amax()) == 0.0:
            # all zeros (a zero-initialised bias): its first non-zero values, as the live signal
            ref = next(
                (lk.one_d[name] for lk in looks if name in lk.one_d and float(lk.one_d[name].abs().amax()) > 0), ref
            )
        refs[name] = ref
    ref_names = list(refs)
    judged = dict(
        zip(
            ref_names,
            judged_scales([float(refs[n].abs().amax()) if refs[n].numel() else 0.0 for n in ref_names]),
            strict=True,
        )
    )
    drift_rule = rules["ParamDrift"]
    wd_known = last_opt is not None and bool(last_opt.weight_decay)
    for name in names:
        entry: dict[str, Any] = {"reference": None, "walk": [], "steps": [lk.step for lk in looks]}
        one_d[name] = entry
        if name in reference.withheld or name not in refs:
            entry["withheld"] = reference.withheld.get(name, "no reference value")
            continue
        ref = refs[name]
        entry["reference"] = float(ref.abs().amax()) if ref.numel() else 0.0
        entry["judged_scale"] = judged[name]
        chain = [] if reference.look is not None else [ref]  # the changes start at the reference
        walk: list[float | None] = []
        for lk in looks:
            v = lk.one_d.get(name)
            if v is None or v.shape != ref.shape:
                walk.append(None)
                continue
            if reference.look is None or lk.index >= reference.look:
                chain.append(v)
            moved = float((v - ref).abs().amax()) if v.numel() else 0.0
            walk.append(_num(drift_log2(moved, judged[name])))
        entry["walk"] = walk
        signs = (
            torch.stack([torch.sign(b - a) for a, b in itertools.pairwise(chain)])
            if len(chain) > 1
            else torch.zeros(0, ref.numel())
        )
        changes = int(signs.shape[0])
        consistency = sign_consistency(signs) if changes else math.nan
        entry["consistency"] = _num(consistency)
        entry["changes"] = changes
        known = [w for w in walk if w is not None]
        entry["monotone"] = bool(known) and all(b >= a for a, b in itertools.pairwise(known))
        wd = last_opt.weight_decay.get(name) if last_opt is not None else None
        entry["weight_decay"] = wd
        entry["grad_relative_rms"] = _num(rel_grad.get(name))
        if last_opt is not None and name in last_opt.adam:
            a = last_opt.adam[name]
            entry["adam_eps_dominated_ratio"] = _num(a.eps_ratio)
            entry["adam_normalized_update_rms"] = _num(a.update_rms)
        bits = walk[-1]
        if bits is None or not _cond_met(drift_rule, bits):
            continue
        values = {
            "param_drift_consistency_ratio": consistency if changes >= 2 else None,
            "param_weight_decay": wd,
            "param_grad_relative_rms": rel_grad.get(name),
        }
        why_unknown = {
            "param_drift_consistency_ratio": "one change only (give three or more checkpoints)",
            "param_weight_decay": "no optimizer state names this parameter" if not wd_known else "not in a param group",
            "param_grad_relative_rms": "no Adam second moment for it",
        }
        met, failed, unknown = [], [], []
        for cond in drift_rule.and_:
            ok = _cond_met(cond, values.get(cond.metric))
            bound = cond.above if cond.above is not None else cond.below
            text = f"{cond.metric} {'>' if cond.above is not None else '<'} {bound:g}"
            if ok is None:
                unknown.append(f"{text}: not checked, {why_unknown[cond.metric]}")
            elif ok:
                met.append(f"{text} ({values[cond.metric]:.3g})")
            else:
                failed.append(f"{text} is false ({values[cond.metric]:.3g})")
        walk_text = " -> ".join("-" if w is None else f"{w:.2f}" for w in walk)
        where = f"{looks[0].label} .. {last.label}" if len(looks) > 1 else last.label
        if failed:
            severity, what = "info", "drifted, but not Adam's eps walk: " + "; ".join(failed)
        elif unknown:
            severity, what = "warning", "drifted; " + "; ".join(unknown)
        else:
            severity, what = drift_rule.severity, "in one direction, tiny gradient, no weight decay: Adam's eps walk"
        action, runbook = _action("ParamDrift")
        findings.append(
            Finding(
                "ParamDrift",
                severity,
                name,
                bits,
                "bits",
                where,
                f"{name} drifted {bits:.1f} bits from {reference.describe()} (walk {walk_text}; "
                f"{'monotone' if entry['monotone'] else 'not monotone'}): {what}",
                action,
                runbook,
                "param_drift_log2",
                {"walk": walk, "met": met, "failed": failed, "not_checked": unknown},
            )
        )

    # -- Adam: eps-dominated --------------------------------------------------------
    eps_rule = rules["AdamEpsilonDominated"]
    for name in sorted({n for lk in with_opt for n in lk.adam}):
        held = []
        for lk in with_opt:
            fig = lk.adam.get(name)
            if fig is None or fig.eps_ratio is None or not _cond_met(eps_rule, fig.eps_ratio):
                continue
            wd = lk.weight_decay.get(name)
            vals = {"adam_normalized_update_rms": fig.update_rms, "param_weight_decay": wd}
            checks = [_cond_met(c, vals.get(c.metric)) for c in eps_rule.and_]
            if all(c is not False for c in checks):
                held.append((lk, fig, None in checks))
        if not held:
            continue
        lk, a, partly = max(held, key=lambda h: (h[1].eps_ratio or 0.0, h[0].index))
        action, runbook = _action("AdamEpsilonDominated")
        where = held[0][0].label if len(held) == 1 else f"{held[0][0].label} .. {held[-1][0].label}"
        findings.append(
            Finding(
                "AdamEpsilonDominated",
                "warning" if not partly else "info",
                name,
                a.eps_ratio,
                "ratio",
                where,
                f"Adam's eps dominates {a.eps_ratio:.0%} of {name} (sqrt(v_hat) < eps at step count {a.step:g}; "
                f"normalized update RMS {a.update_rms:.2g}) in {len(held)} of {len(with_opt)} checkpoint(s)"
                + ("; its weight decay is not known (unnamed optimizer parameter)" if partly else ""),
                action,
                runbook,
                "adam_eps_dominated_ratio",
                {"checkpoints": [h[0].index + 1 for h in held]},
            )
        )

    # -- optimizer state resets -----------------------------------------------------
    action, runbook = _action("OptimizerStateReset")
    reset_sev = rules["OptimizerStateReset"].severity
    for a_look, b_look in itertools.pairwise(with_opt):
        elapsed = b_look.step - a_look.step if a_look.step is not None and b_look.step is not None else None
        reasons: dict[str, str] = {}
        for name, fa in a_look.adam.items():
            fb = b_look.adam.get(name)
            why = reset_between(fa.step, None if fb is None else fb.step, elapsed) if fa.step is not None else None
            if why:
                reasons[name] = why
        regrouped = ""
        if a_look.groups != b_look.groups:  # the live detector's first reason, between checkpoints
            before = {p for g in a_look.groups for p in g}
            after = {p for g in b_look.groups for p in g}
            regrouped = (
                f"param groups changed ({len(a_look.groups)} -> {len(b_look.groups)} groups, "
                f"{len(after - before)} parameters added, {len(before - after)} removed); "
            )
        if reasons or regrouped:
            shown = sorted(reasons)[:3]
            more = f" and {len(reasons) - 3} more" if len(reasons) > 3 else ""
            findings.append(
                Finding(
                    "OptimizerStateReset",
                    reset_sev,
                    None,
                    float(len(reasons)),
                    "parameters",
                    f"between {a_look.label} and {b_look.label}",
                    f"optimizer state reset between checkpoints {a_look.index + 1} and {b_look.index + 1}: "
                    + regrouped
                    + f"{len(reasons)} parameter(s) reset"
                    + (": " + "; ".join(f"{n}: {reasons[n]}" for n in shown) + more if reasons else ""),
                    action,
                    runbook,
                    None,
                    {"between": [a_look.index + 1, b_look.index + 1], "params": reasons, "groups": regrouped or None},
                )
            )
    for lk in with_opt:
        counts: dict[float, int] = {}
        for f in lk.adam.values():
            if f.step is not None:
                counts[f.step] = counts.get(f.step, 0) + 1
        if len(counts) > 1:
            spread = ", ".join(f"{n} at {s:g}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))
            findings.append(
                Finding(
                    "OptimizerStateReset",
                    reset_sev,
                    None,
                    float(len(counts)),
                    "step counts",
                    lk.label,
                    f"step counts differ across parameters ({spread}): part of the state was rebuilt, "
                    "or parameters were added later",
                    action,
                    runbook,
                    None,
                    {"step_counts": {f"{s:g}": n for s, n in counts.items()}},
                )
            )

    # -- weight-decay coverage ------------------------------------------------------
    if last_opt is not None and last_opt.weight_decay:
        pairs = [(n, decays(wd)) for n, wd in last_opt.weight_decay.items() if n in last.one_d]
        none, msg = weight_decay_message(pairs)
        if none:
            drifted = [
                n for n in none if one_d.get(n, {}).get("walk") and (one_d[n]["walk"][-1] or 0) > drift_rule.above
            ]
            action, runbook = _action("WeightDecayCoverage")
            findings.append(
                Finding(
                    "WeightDecayCoverage",
                    "info",
                    None,
                    float(len(none)),
                    "parameters",
                    last_opt.label,
                    msg.replace(
                        " (under Adam",
                        f"; drifted over {drift_rule.above:g} bit: {', '.join(drifted) or 'none'} (under Adam",
                    ),
                    action,
                    runbook,
                    "param_weight_decay",
                    {"no_weight_decay": none, "drifted": drifted},
                )
            )
    elif last_opt is not None:
        last_opt.notes.append(f"weight decay per parameter unknown: {last_opt.naming}")

    # -- non-finite -----------------------------------------------------------------
    action, runbook = _action("NonFiniteTensor")
    for lk in looks:
        bad = {n: f.nonfinite for n, f in lk.tensors.items() if f.nonfinite}
        for n, a in lk.adam.items():
            for m, k in a.nonfinite.items():
                bad[f"{n} ({m})"] = k
        for n, k in bad.items():
            findings.append(
                Finding(
                    "NonFiniteTensor",
                    "page",
                    n,
                    float(k),
                    "elements",
                    lk.label,
                    f"{n} holds {k} NaN or infinite element(s) at {lk.label}",
                    action,
                    runbook,
                )
            )

    # -- quantization readiness (the last checkpoint: the one exported) ---------------
    quant: list[dict[str, Any]] = []
    for n, tfig in last.tensors.items():
        bits = tfig.range_bits
        quant.append(
            {
                "tensor": n,
                "numel": tfig.numel,
                "absmax": tfig.absmax,
                "rms": tfig.rms,
                "range_bits": _num(bits),
                "int8_bulk_bits": _num(INT8_BITS - bits),
                "e4m3_headroom_bits": _num(E4M3_BITS - bits),
            }
        )
    quant.sort(key=lambda q: -(q["range_bits"] if q["range_bits"] is not None else math.inf))
    action, runbook = _action("QuantizationRange")
    for q in quant:
        if q["range_bits"] is not None and q["range_bits"] > QUANT_WARN_BITS:
            findings.append(
                Finding(
                    "QuantizationRange",
                    "warning",
                    q["tensor"],
                    q["range_bits"],
                    "bits",
                    last.label,
                    f"{q['tensor']}: absmax is {2 ** q['range_bits']:.3g}x its RMS: a per-tensor INT8 scale leaves "
                    f"values of the RMS {q['int8_bulk_bits']:.1f} bits ({INT8_LEVELS * 2 ** -q['range_bits']:.1f} "
                    f"levels), FP8 E4M3 {q['e4m3_headroom_bits']:.1f} bits above its subnormals",
                    action,
                    runbook,
                )
            )
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.alert, -(f.value or 0.0)))
    return Audit(looks, reference, findings, one_d, quant)
