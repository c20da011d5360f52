"""The reference of the hooks' ``TRAINVITALS_*`` variables (``docs/configuration.md``),
generated from :class:`~trainvitals.hooks.config.Config` (each field's annotation,
default and docstring) and :data:`~trainvitals.hooks.config.ATTACH_ENV`.

    python -m trainvitals.hooks.env_reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import inspect
import itertools
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal, Union

from trainvitals.hooks import config as config_module
from trainvitals.hooks.config import ATTACH_ENV, ATTACH_ENV_HELP, Config, env_name
from trainvitals.hooks.live_settings import LIVE_FIELDS

__all__ = ["field_docs", "reference_markdown"]

REGENERATE = "python -m trainvitals.hooks.env_reference > docs/configuration.md"


def field_docs() -> dict[str, str]:
    """Each Config field's docstring (the string under it in the class body), one line."""
    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    out: dict[str, str] = {}
    body = cls.body
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = " ".join(after.value.value.split())
    return out


def _type(hint: Any, name: str) -> str:
    origin = typing.get_origin(hint)
    if name == "signals":
        return "comma-separated list, `all` or `none`"
    if name == "loss_from_logits":
        return "boolean or a module name"
    if origin is Union or (origin is not None and origin.__name__ == "UnionType"):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return f"{_type(inner[0], name)} or `none`"
    if origin is Literal:
        return " \\| ".join(f"`{c}`" for c in typing.get_args(hint))
    if origin is tuple:
        return "comma-separated list"
    return {int: "integer", float: "number", bool: "boolean", str: "text"}.get(hint, str(hint))


def _default(f: Any) -> str:
    value = f.default if f.default is not MISSING else f.default_factory()
    if value is None:
        return "all" if f.name == "signals" else "none"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


_CORE = {  # type and default of the core arguments' variables
    "run": ("text", "required"),
    "collector": ("URL, `file:PATH` or `null`", "`./trainvitals-<run>.jsonl`"),
    "modalities": ("comma-separated list", "none"),
    "rules": ("`default`, comma-separated paths, or `off`", "`default` without a collector, else off"),
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    docs = field_docs()
    hints = typing.get_type_hints(Config)
    lines = [
        "# Configuration by environment variables",
        "",
        "<!-- Generated from trainvitals/hooks/config.py by",
        f"     `{REGENERATE}`;",
        "     tests/run_configure/test_environment.py fails when this file is out of date. -->",
        "",
        "Every option of `attach()` can also come from the job's environment: the only way",
        "to configure a job started with `trainvitals run`, which has no `attach()` call",
        '(README, "Attach without editing the job"). An argument passed to `attach()` wins',
        "over the variable, which wins over the default. An empty variable counts as unset.",
        "A value that cannot be used stops `attach()`, and `trainvitals run` before it starts",
        "the job, with a message that names the variable.",
        "",
        "Values: integers and numbers as Python writes them; booleans `1`, `true`, `yes`,",
        "`on` or `0`, `false`, `no`, `off`; lists comma-separated; `none` for an option",
        "that may be off.",
        "",
        "| variable | `attach()` option | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for arg, var in ATTACH_ENV.items():
        kind, default = _CORE[arg]
        lines.append(f"| `{var}` | `{arg}` | {kind} | {default} | {_cell(ATTACH_ENV_HELP[arg])} |")
    lines.append(
        "| `TRAINVITALS_TOKEN` | - | text | none | The bearer token sent to the collector (its `token` setting). |"
    )
    for f in fields(Config):
        live = " Live: `trainvitals configure` can change it while the job runs." if f.name in LIVE_FIELDS else ""
        lines.append(
            f"| `{env_name(f.name)}` | `{f.name}` | {_type(hints[f.name], f.name)} | {_default(f)} | "
            f"{_cell(docs.get(f.name, ''))}{live} |"
        )
    lines += [
        "",
        "`sink=` has no variable of its own: `TRAINVITALS_COLLECTOR` takes `file:PATH` and",
        "`null` too. `scaler=` is an object; `trainvitals run` passes the job's `GradScaler`",
        "when it has exactly one.",
        "",
        "## Variables of `trainvitals run`",
        "",
        "`trainvitals run --run NAME --collector URL --every N --set OPTION=VALUE` sets the",
        "variables above for the job and nothing else, plus `PYTHONPATH` (the start-up shim",
        "first, then what was there). `--run` defaults to the script's name and the start",
        "time; every rank that `torchrun` starts gets the same name. Two defaults differ",
        "there: `TRAINVITALS_LOSS_FROM_LOGITS` unset turns zero-code loss accounting on",
        "where the model's logits can be found (`false` turns it off), and an optimizer",
        "stepped with a closure gets `step_boundary=manual` unless `TRAINVITALS_STEP_BOUNDARY`",
        "says otherwise.",
        "",
        "## The collector's variables",
        "",
        "The collector reads `TRAINVITALS_<SETTING>` for its own settings",
        "([collector.md](collector.md)); the two sets share only `TRAINVITALS_TOKEN` (what",
        "the jobs send is what the collector checks). The collector's `TRAINVITALS_RULES` is",
        "its rule files; a job's in-process rules are `TRAINVITALS_LOCAL_RULES`.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - regenerates docs/configuration.md
    print(reference_markdown(), end="")
