"""``trainvitals audit PATH...``: a health verdict from the checkpoints a job left behind.

Prints the findings as a table (``--json``: everything as JSON), writes the report page
(``--html``), and exits for CI as ``trainvitals check`` does: 1 when a finding at
``--fail-on`` severity or worse was made (default ``warning``: a warning or a page;
``page``: pages only), 0 when none was, 2 for a usage error or an unreadable
checkpoint (the message names the file).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from trainvitals.monitor.cli_check import EXIT_PAGE, EXIT_USAGE

__all__ = ["audit"]


class _UsageError(click.ClickException):
    exit_code = EXIT_USAGE


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--reference",
    default=None,
    metavar="PATH|init",
    help="What 1D drift is measured from: a checkpoint, or 'init' (1.0 for norm scales).  "
    "[default: the earliest checkpoint; 'init' for a single one]",
)
@click.option("--json", "as_json", is_flag=True, help="Print the audit as JSON.")
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the report page of the audit to this file.",
)
@click.option(
    "--fail-on",
    type=click.Choice(["page", "warning"]),
    default="warning",
    show_default=True,
    help="Exit 1 when a finding of this severity or worse was made (as for check).",
)
@click.option("--all", "show_all", is_flag=True, help="List every tensor in the quantization table.")
def audit(
    paths: tuple[Path, ...],
    reference: str | None,
    as_json: bool,
    html_path: Path | None,
    fail_on: str,
    show_all: bool,
) -> None:
    """Audit checkpoints offline: 1D parameter drift, Adam's eps and state resets,
    weight-decay coverage, quantization range, non-finite values.

    \b
      trainvitals audit runs/job/                  (every checkpoint in the folder, in step order)
      trainvitals audit ckpt-1000.pt ckpt-2000.pt  (torch.save, Lightning .ckpt, safetensors,
                                                    HF checkpoint-N/, distributed checkpoints)

    Exit status: 1 if a finding of --fail-on severity (default warning) or worse was
    made, 0 if none was (info findings never fail), 2 for a usage error or an
    unreadable checkpoint.
    """
    from trainvitals.audit.analysis import SEVERITY_ORDER, init_reference, judge, look
    from trainvitals.audit.sources import CheckpointError, discover, open_checkpoint

    try:
        found = discover(list(paths))
        opened = [open_checkpoint(p) for p in found]
        ref_ck = None
        if reference not in (None, "init"):
            ref_ck = open_checkpoint(Path(str(reference)))
    except CheckpointError as exc:
        raise _UsageError(str(exc)) from None
    if all(ck.step is not None for ck in opened):
        opened.sort(key=lambda ck: ck.step or 0)
        steps = [ck.step for ck in opened]
        if len(set(steps)) != len(steps):
            raise _UsageError(f"two checkpoints at the same step: {', '.join(str(ck.path) for ck in opened)}")
        order = "in step order"
    else:
        unknown = [str(ck.path) for ck in opened if ck.step is None]
        order = f"in the order given (no step known for {', '.join(unknown[:3])})"
    total = sum(ck.nbytes for ck in opened) + (ref_ck.nbytes if ref_ck is not None else 0)
    looks = []
    try:
        with click.progressbar(
            length=total, label="reading checkpoints", file=sys.stderr, show_pos=False, show_percent=True
        ) as bar:
            ref_look = look(ref_ck, -1, bar.update, one_d_only=True) if ref_ck is not None else None
            for i, ck in enumerate(opened):
                looks.append(look(ck, i, bar.update))
    except CheckpointError as exc:
        raise _UsageError(str(exc)) from None
    from trainvitals.audit.analysis import Reference

    same = [lk.index for lk in looks if ref_ck is not None and Path(lk.path).resolve() == ref_ck.path.resolve()]
    if ref_look is not None:
        ref = Reference(
            "checkpoint", f"the reference {ref_look.label}", dict(ref_look.one_d), look=same[0] if same else None
        )
    elif reference == "init" or len(looks) == 1:
        ref = init_reference(looks)
    else:
        ref = Reference("checkpoint", f"the earliest checkpoint {looks[0].label}", dict(looks[0].one_d), look=0)
    result = judge(looks, ref)
    if html_path is not None:
        from trainvitals.monitor.audit_page import render_audit

        page = render_audit(result)
        tmp = html_path.with_name(html_path.name + ".tmp")
        try:
            tmp.write_text(page, encoding="utf-8")
            os.replace(tmp, html_path)
        except OSError as exc:
            raise _UsageError(f"cannot write {html_path}: {exc.strerror or exc}") from None
        click.echo(f"audit page written to {html_path}", err=True)
    if as_json:
        out = result.as_dict()
        out["order"] = order
        click.echo(json.dumps(_finite(out), indent=2, allow_nan=False))
    else:
        click.echo(text(result, order, show_all))
    worst = result.worst
    failing = worst is not None and SEVERITY_ORDER[worst] <= SEVERITY_ORDER[fail_on]
    sys.exit(EXIT_PAGE if failing else 0)


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinity as None (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    s = f"{v:.3g}"
    return f"{s} {unit}" if unit and unit not in ("ratio",) else s


def _table(rows: Sequence[tuple[str, ...]], last_free: bool = True) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - (1 if last_free else 0))]
    out = []
    for r in rows:
        cells = [cell.ljust(w) for cell, w in zip(r, widths, strict=False)]
        out.append("  ".join(cells + ([r[-1]] if last_free else [])).rstrip())
    return out


def text(result: Any, order: str, show_all: bool = False) -> str:
    """The audit as ``trainvitals check`` prints a verdict: the checkpoints, the
    findings, the 1D parameters and the quantization ranking."""
    lines = [f"{len(result.looks)} checkpoint(s), {order}:"]
    for lk in result.looks:
        step = f"step {lk.step} (from {lk.step_from})" if lk.step is not None else "step unknown"
        opt = "optimizer state" if lk.has_optimizer else "no optimizer state"
        lines.append(f"  {lk.index + 1}. {lk.path}  [{lk.format}, {step}, {opt}]")
        lines.extend(f"     note: {n}" for n in lk.notes)
        if lk.has_optimizer and lk.naming:
            lines.append(f"     optimizer parameters: {lk.naming}")
    lines.append(f"1D drift measured from {result.reference.describe()}")
    lines.append("")
    if result.findings:
        rows: list[tuple[str, ...]] = [("SEVERITY", "FINDING", "PARAM/TENSOR", "VALUE", "WHERE", "WHAT TO DO")]
        for f in result.findings:
            rows.append((f.severity, f.alert, f.subject or "-", _fmt(f.value, f.unit), f.where, f.action))
        lines += _table(rows)
        lines.append("")
        lines += [f"- {f.alert}{' ' + f.subject if f.subject else ''}: {f.summary}" for f in result.findings]
    else:
        lines.append("no finding")
    if result.one_d:
        lines.append("")
        rows = [("1D PARAMETER", "DRIFT BITS (WALK)", "CONSISTENCY", "WEIGHT DECAY", "EPS-DOMINATED", "GRAD REL RMS")]
        for name, e in sorted(result.one_d.items(), key=lambda kv: -((kv[1].get("walk") or [None])[-1] or 0.0)):
            walk = e.get("walk") or []
            shown = " -> ".join("-" if w is None else f"{w:.2f}" for w in walk) if walk else "withheld"
            rows.append(
                (
                    name,
                    shown,
                    _fmt(e.get("consistency")),
                    _fmt(e.get("weight_decay")),
                    _fmt(e.get("adam_eps_dominated_ratio")),
                    _fmt(e.get("grad_relative_rms")),
                )
            )
        lines += _table(rows, last_free=False)
        withheld = {n: e["withheld"] for n, e in result.one_d.items() if "withheld" in e}
        lines += [f"  {n}: no drift figure: {why}" for n, why in sorted(withheld.items())]
    if result.quantization:
        lines.append("")
        shown_q = result.quantization if show_all else result.quantization[:10]
        rows = [("TENSOR (worst first)", "ABSMAX/RMS BITS", "INT8 BULK BITS", "E4M3 HEADROOM BITS")]
        for q in shown_q:
            rows.append((q["tensor"], _fmt(q["range_bits"]), _fmt(q["int8_bulk_bits"]), _fmt(q["e4m3_headroom_bits"])))
        lines += _table(rows, last_free=False)
        if len(shown_q) < len(result.quantization):
            lines.append(f"  ... {len(result.quantization) - len(shown_q)} more (--all, --json)")
    return "\n".join(lines)
