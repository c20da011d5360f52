"""The generator of the collector's catalogue of built-in signals.

A built-in signal declares its :class:`~trainvitals.wire.signals.SignalSpec` (and the
metrics it adds) on its class in its family's package, and is listed once in
:data:`trainvitals.hooks.signals.builtin.BUILTIN`. The collector, the alert engine and
the generators must know those specs without importing the hooks (nor torch), so they
are written out as plain data into ``wire/builtin_signals.py``::

    python -m trainvitals.hooks.signals.catalogue --write

(or ``python -m trainvitals.hooks.signals.catalogue > wire/builtin_signals.py``);
``tests/hooks/test_catalogue.py`` fails while that file is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from trainvitals.hooks.signals.builtin import BUILTIN, Declared
from trainvitals.wire.metrics import MetricSpec
from trainvitals.wire.signal_spec import SignalSpec

__all__ = ["REGENERATE", "TARGET", "catalogue_source", "declared_specs", "main"]

REGENERATE = "python -m trainvitals.hooks.signals.catalogue --write"
TARGET = Path(__file__).resolve().parents[2] / "wire" / "builtin_signals.py"
"""``wire/builtin_signals.py`` in the source tree."""

_HEADER = f'''"""The built-in signals' declarations, in the order coverage lists them: GENERATED from
the ``spec`` of each class in ``trainvitals.hooks.signals.builtin.BUILTIN``; do not edit.
Change the class's spec, then run ``{REGENERATE}``.

Plain data, no torch: the collector, the alert engine and the generators read the
built-in signals here without importing the hooks.
"""

from __future__ import annotations

'''


def declared_specs(classes: Sequence[Declared] = BUILTIN) -> tuple[SignalSpec, ...]:
    """The specs ``classes`` declare, their metrics' group set to the spec's own (as the
    registry holds them). ValueError naming the class for one without a spec, and for a
    name declared twice."""
    specs: list[SignalSpec] = []
    for cls in classes:
        spec = cls.spec
        if not isinstance(spec, SignalSpec):
            raise ValueError(f"{cls.__name__}: a built-in signal declares its SignalSpec as the class attribute spec")
        if any(s.name == spec.name for s in specs):
            raise ValueError(f"{cls.__name__}: signal {spec.name!r} is declared twice")
        metrics = tuple(dataclasses.replace(m, group=spec.group or "") for m in spec.metrics)
        specs.append(dataclasses.replace(spec, metrics=metrics))
    return tuple(specs)


def _literal(value: object) -> str:
    """``value`` as Python source, in the repository's format (double quotes)."""
    if isinstance(value, str):
        text = repr(value)
        if text.startswith("'") and '"' not in value:
            text = '"' + text[1:-1] + '"'
        return text
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        items = ", ".join(_literal(v) for v in value)
        return f"({items},)" if len(value) == 1 else f"({items})"
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    raise TypeError(f"no literal for {type(value).__name__} in a signal declaration")


def _call(obj: SignalSpec | MetricSpec, indent: str) -> list[str]:
    """``obj``'s constructor call, one keyword a line, fields left at their default left out."""
    inner = indent + "    "
    lines = [f"{indent}{type(obj).__name__}("]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if value == default:
            continue
        if f.name == "metrics":
            lines.append(f"{inner}metrics=(")
            for m in value:
                lines += _call(m, inner + "    ")
            lines.append(f"{inner}),")
        else:
            lines.append(f"{inner}{f.name}={_literal(value)},")
    lines.append(f"{indent}),")
    return lines


def catalogue_source(classes: Sequence[Declared] = BUILTIN) -> str:
    """The text of ``wire/builtin_signals.py`` for ``classes`` (the built-in ones)."""
    specs = declared_specs(classes)
    imports = ["from trainvitals.wire.signal_spec import SignalSpec"]
    if any(s.metrics for s in specs):
        imports.insert(0, "from trainvitals.wire.metrics import MetricSpec")
    body = [*imports, "", '__all__ = ["BUILTIN_SPECS"]', "", "BUILTIN_SPECS: tuple[SignalSpec, ...] = ("]
    for spec in specs:
        body += _call(spec, "    ")
    body += [")", ""]
    return _HEADER + "\n".join(body)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainvitals.hooks.signals.catalogue",
        description="Write the catalogue of built-in signals the collector reads (wire/builtin_signals.py).",
    )
    parser.add_argument("--write", action="store_true", help=f"write {TARGET} instead of printing it")
    args = parser.parse_args(argv)
    text = catalogue_source()
    if args.write:
        TARGET.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
