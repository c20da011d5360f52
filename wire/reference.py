"""The metric reference (``docs/metrics.md``), generated from the spec table.

Regenerate: ``python -m trainvitals.wire.reference > docs/metrics.md``.
"""

from __future__ import annotations

from trainvitals.wire.metrics import _SPECS, PREFIX

__all__ = ["reference_markdown"]

_GROUP_TITLES = {
    "run": "Per run (set by the collector)",
    "optimizer": "Optimizer step",
    "loss": "Loss accounting (I1-I3)",
    "params": "1D parameters (I4)",
    "adam": "Adam state (I4)",
    "softmax": "Softmax saturation and distillation (I5)",
    "packing": "Packed sequences: samples leaking into each other",
    "client": "The hooks' own health",
    "collector": "The collector's own metrics",
}


def reference_markdown() -> str:
    """The metric reference (``docs/metrics.md``), generated from :data:`METRICS`."""
    lines = [
        "# Metric reference",
        "",
        "<!-- Generated from trainvitals/wire/metrics.py by `python -m trainvitals.wire.reference`;",
        "     tests/test_docs.py fails when this file is out of date. -->",
        "",
        f"Prometheus names carry the `{PREFIX}` prefix; the wire name (in reports and",
        "rules) is the name without it. Every series of a run carries `run`, and `rank`",
        "when it comes from a data-parallel rank other than 0. Counters end in `_total`.",
        "Units: `ratio` is 0..1, `x` a factor (1 = neutral), `norm` an L2 norm in the",
        "tensor's own unit, `value` the tensor's own unit. What each signal means and its",
        "healthy values: [signals.md](signals.md).",
        "",
    ]
    for group, title in _GROUP_TITLES.items():
        specs = [s for s in _SPECS if s.group == group]
        if not specs:
            continue
        lines += [f"## {title}", "", "| metric | type | unit | labels | meaning |", "|---|---|---|---|---|"]
        for s in specs:
            labels = ", ".join(s.labels) if s.labels else "-"
            lines.append(
                f"| `{PREFIX}{s.name}` | {s.type} | {s.unit} | {labels} | {s.help.replace('|', chr(92) + '|')} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - regenerates docs/metrics.md
    print(reference_markdown(), end="")
