"""Options of ``attach()`` beyond the core arguments, validated where they are set.

Every option can also come from the environment (``docs/configuration.md``):
``TRAINVITALS_<FIELD>`` for each :class:`Config` field (``TRAINVITALS_EVERY=1``),
and :data:`ATTACH_ENV` for the core arguments. An argument passed to ``attach()``
wins over the environment, which wins over the default.

This module imports the standard library and the wire contract only: ``trainvitals
run`` loads it to check the variables before starting the job, without importing torch.
"""

from __future__ import annotations

import os
import re
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Union

from trainvitals.wire.errors import ConfigurationError
from trainvitals.wire.live_settings import BUILTIN_SIGNALS
from trainvitals.wire.runs import RUN_RULE

ENV_PREFIX = "TRAINVITALS_"

ATTACH_ENV = {
    "run": "TRAINVITALS_RUN",
    "collector": "TRAINVITALS_COLLECTOR",
    "modalities": "TRAINVITALS_MODALITIES",
    # Not TRAINVITALS_RULES: that is the collector's setting (its rule files).
    "rules": "TRAINVITALS_LOCAL_RULES",
}
"""The environment variable of each core ``attach()`` argument (``sink``: use
``TRAINVITALS_COLLECTOR=file:PATH``; ``scaler`` is an object: none)."""

CHECK_ENV = "TRAINVITALS_CHECK_SINK"
"""Set by ``trainvitals check -- CMD`` to where the check reads the reports
(``file:PATH``): a monitor the job attaches itself then reports there, at the check's
``--every``, whatever the job passes (each override logged)."""

ATTACH_ENV_HELP = {
    "run": f"The run's name ({RUN_RULE.removeprefix('use ')}); "
    "`trainvitals run` sets it (`--run`, else the script's name and the start time).",
    "collector": "Where reports go: a collector URL (`http://host:9477`), `file:PATH` (JSONL) or `null` (nowhere).",
    "modalities": "Names for the integer modality codes, comma-separated (`text,image`).",
    "rules": "Alert rules evaluated in the job: each firing and resolution logged with its step and "
    "value, a verdict at close: `default` (the shipped rules), rule files/folders, or `off`. On by "
    "default when no collector is configured (a collector evaluates them otherwise).",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null")


class EnvError(ConfigurationError):
    """A ``TRAINVITALS_*`` variable that cannot be used; the message names it."""


def env_name(field: str) -> str:
    """The environment variable of a :class:`Config` field."""
    return ENV_PREFIX + field.upper()


@dataclass(kw_only=True)
class Config:
    """Tuning knobs; every field can be passed to ``attach()`` by name."""

    every: int = 10
    """Report every N optimizer steps (and on the first). 1 = every step."""

    loss_reduction: Literal["mean", "sum"] = "mean"
    """How the job reduces its loss over one optimizer step. "mean": the weights of a
    step should add up to 1 (I2). "sum": deliberately unnormalized (gradients scaled
    later, as in Megatron's per-token path); the weight mass is reported relative to
    ``loss_scale``."""

    loss_normalization: Literal["token", "sqrt", "sample"] | None = None
    """How the job intends to weight samples in its loss: "token" (each label token
    the same: long samples weigh more), "sqrt" (a sample by the square root of its
    tokens, as Qwen3-VL), "sample" (each sample the same, a mean of sample means).
    The dilution alert then judges the measured weighting against this intent.
    ``track_loss(normalization=...)`` overrides it for a step. None: undeclared."""

    loss_scale: float | None = None
    """With loss_reduction="sum": the scale the job divides by later (e.g. the global
    token count). None: the step's label-token count."""

    probe_every: int | None = None
    """Every N optimizer steps, run the exact per-modality gradient probe (one extra
    backward per modality on probe steps). None: off."""

    drift_window: int = 50
    """Reports over which the sign consistency of 1D parameter changes is measured."""

    per_param: bool = False
    """Also report per-parameter statistics for parameters with ndim >= 2."""

    max_param_series: int = 512
    """Cap on parameters reported individually (1D and, with per_param, 2D)."""

    update_sample: int = 4096
    """Elements per tensor sampled for update_ratio and the Adam ratios (evenly spaced runs of
    16 contiguous elements); exact below this size."""

    softmax_target: float = 0.7
    """Mean top-1 probability the recommended temperature aims for (q(1-q) = 0.21)."""

    softmax_max_positions: int = 128
    """Positions per observe call kept (deterministic stride) for softmax statistics.
    The cost is about linear in it (~3.5 ns per logit on one CPU thread, plus ~1 ms a
    call): [4, 128, 8192] logits (103 kept) cost ~3-4 ms a call with the report, 4096
    positions of 8192 classes ~125 ms. The means are over positions: their sampling
    error is the spread over positions over sqrt(kept), e.g. +-0.03 for a mean top-1
    with spread 0.3 from 103 positions (+-0.023 from 171, the old default's)."""

    softmax_chunk_bytes: int = 64 * 1024 * 1024
    """Bound on one chunk of work over the vocabulary (capped at 4 MiB on a CPU, to stay in
    cache; at least one position, 16 bytes per class). The extra peak of an observe call
    is at most about two chunks plus ~4 MiB (measured on [4, 512, 131072] float32 logits:
    2.1-3.6 MiB for 2.5-4 MiB chunks)."""

    loss_from_logits: Any = "auto"
    """Zero-code loss accounting: read every token's loss weight from the gradient that
    reaches the logits during the job's own backward, with no ``track_loss`` call (plain
    cross-entropy losses only; others are detected and reported as such, docs/integrations.md).
    ``"auto"`` (the default): find the LM head as True does; a model without one is
    watched without loss accounting, said in the start line, the verdict and the
    coverage; a ``track_loss`` call takes over from it. False: off.
    True: find the LM head (``get_output_embeddings()``, else the module tied to the token
    embedding, else the last module with a ``[vocabulary, width]`` weight; an error when
    there is none); a name from
    ``model.named_modules()`` or the module itself names it. Tag micro-batches with
    ``Monitor.tag_batch(modality=..., segments=...)``; a model whose config names an image
    or video token id has its samples classed by their input ids."""

    logits_max_positions: int = 256
    """Positions per micro-batch at which zero-code accounting checks that the logits'
    gradient is a plain cross-entropy one (a softmax over the vocabulary at each: the
    cost is linear in it). Weights are read at every position regardless."""

    packing_probe_every: int | None = 1000
    """The boundary-leak probe of packed rows (signal ``packing``): at the first report
    step whose micro-batch holds packed rows, then at the first report step at least N
    optimizer steps after the last try, one micro-batch is forwarded twice more, without
    gradients, in eval mode, its row's first sample's tokens changed the second time; the
    largest change of the row's other samples' logits is the leak (0 with a proper mask).
    Costs two forward passes of one micro-batch per probe (docs/benchmarks.md). None: off
    (the static signs stay)."""

    step_boundary: Literal["pre_step_hook", "manual"] = "pre_step_hook"
    """When a step's gradients are final: at the optimizer's pre-step hook, or
    ``"manual"``: when the job calls ``Monitor.gradients_ready()`` (an optimizer stepped
    with a closure that runs the last backward inside ``step()``, as Lightning does)."""

    signals: tuple[str, ...] | None = None
    """Which built-in signals run: any of "optimizer", "params", "adam", "packing" (the loss and
    softmax signals start with the first track_loss / observe call). None: all."""

    flush_timeout: float = 5.0
    """Seconds ``close()`` waits for the sender to deliver what is queued."""

    queue_bytes: int = 64 * 1024 * 1024
    """Bound on reports waiting to be sent; beyond it the oldest are dropped and counted."""

    def __post_init__(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in (
            "every",
            "drift_window",
            "max_param_series",
            "update_sample",
            "softmax_max_positions",
            "softmax_chunk_bytes",
            "queue_bytes",
            "logits_max_positions",
        ):
            positive_int(name)
        positive_int("probe_every", allow_none=True)
        positive_int("packing_probe_every", allow_none=True)
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.loss_normalization not in (None, "token", "sqrt", "sample"):
            raise ValueError(
                f"loss_normalization must be 'token', 'sqrt', 'sample' or None, got {self.loss_normalization!r}"
            )
        if self.loss_scale is not None and not (isinstance(self.loss_scale, (int, float)) and self.loss_scale > 0):
            raise ValueError(f"loss_scale must be a positive number or None, got {self.loss_scale!r}")
        if self.loss_scale is not None and self.loss_reduction != "sum":
            raise ValueError("loss_scale applies only with loss_reduction='sum'")
        if not (isinstance(self.softmax_target, float) and 0.0 < self.softmax_target < 1.0):
            raise ValueError(f"softmax_target must be a float in (0, 1), got {self.softmax_target!r}")
        if not (isinstance(self.flush_timeout, (int, float)) and self.flush_timeout >= 0):
            raise ValueError(f"flush_timeout must be >= 0 seconds, got {self.flush_timeout!r}")

        if not (
            isinstance(self.loss_from_logits, bool)
            or (isinstance(self.loss_from_logits, str) and self.loss_from_logits)
            or hasattr(self.loss_from_logits, "register_forward_hook")
        ):
            raise ValueError(
                f"loss_from_logits must be True/False, a module name or a module, got {self.loss_from_logits!r}"
            )
        if self.step_boundary not in ("pre_step_hook", "manual"):
            raise ValueError(f"step_boundary must be 'pre_step_hook' or 'manual', got {self.step_boundary!r}")
        if self.signals is not None:
            self.signals = tuple(self.signals)
            bad = sorted(set(self.signals) - set(BUILTIN_SIGNALS))
            if bad:
                raise ValueError(f"signals: unknown {bad}; choose from {list(BUILTIN_SIGNALS)}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The fields set by ``TRAINVITALS_<FIELD>`` variables, parsed with the field's
        type and checked together; raises :class:`EnvError` naming the variable. An
        empty variable counts as unset."""
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        out: dict[str, Any] = {}
        for f in fields(cls):
            var = env_name(f.name)
            raw = env.get(var)
            if raw is None or not raw.strip():
                continue
            try:
                if f.name == "signals" and raw.strip().lower() in ("all", "none"):
                    # None means all built-in signals: spell both ends out.
                    out[f.name] = None if raw.strip().lower() == "all" else ()
                    continue
                out[f.name] = parse_env_value(hints[f.name], raw.strip())
            except ValueError as exc:
                raise EnvError(f"{var}={raw!r}: {exc}") from None
        try:
            cls(**out)
        except ValueError as exc:
            raise EnvError(_name_variables(str(exc), out)) from None
        return out


def parse_env_value(hint: Any, raw: str) -> Any:
    """``raw`` as a value of the type ``hint`` (a Config field's annotation): ints,
    floats, booleans (1/true/yes/on, 0/false/no/off), one of a Literal's choices,
    ``none`` for an optional field, comma-separated tuples; ``Any``: a boolean word
    as a bool, else the text."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw.lower() in _NONE:
            return None
        if len(args) != 1:
            raise ValueError(f"cannot parse a {hint}")
        return parse_env_value(args[0], raw)
    if origin is Literal:
        choices = typing.get_args(hint)
        if raw not in choices:
            raise ValueError(f"choose one of {', '.join(map(str, choices))}")
        return raw
    if origin is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if hint is bool:
        return _bool(raw)
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError("not an integer") from None
    if hint is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError("not a number") from None
    if hint is Any:
        low = raw.lower()
        return _bool(raw) if low in _TRUE + _FALSE else raw
    if hint is str:
        return raw
    raise ValueError(f"cannot parse a {hint}")  # a new field type: teach parse_env_value


def attach_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The core ``attach()`` arguments set in the environment (:data:`ATTACH_ENV`):
    ``run`` and ``collector`` as text, ``modalities`` and ``rules`` split on commas
    (``rules=default`` stays the word). Shapes are checked by ``attach()``."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for arg, var in ATTACH_ENV.items():
        raw = (env.get(var) or "").strip()
        if not raw:
            continue
        if arg == "modalities":
            out[arg] = tuple(p.strip() for p in raw.split(",") if p.strip())
        elif arg == "rules":
            parts = [p.strip() for p in raw.split(",") if p.strip()]
            out[arg] = "default" if parts == ["default"] else parts
        else:
            out[arg] = raw
    return out


def default_run_name(argv: list[str], now: float | None = None) -> str:
    """``<script>-<YYYYmmdd-HHMMSS>``: the script's name (``train`` for ``train.py``,
    the module for ``-m pkg.train``, else the program), then the local time."""
    stem = ""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            stem = argv[i + 1].rsplit(".", 1)[-1]
            break
        if arg.endswith(".py"):
            stem = os.path.splitext(os.path.basename(arg))[0]
            break
    if not stem and argv:
        stem = os.path.basename(argv[0])
    stem = re.sub(r"[^A-Za-z0-9_.\-]+", "-", stem).strip("-.") or "job"
    return f"{stem[:100]}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"not a boolean; use one of {', '.join(_TRUE + _FALSE)}")


def _name_variables(message: str, values: Mapping[str, Any]) -> str:
    """A Config validation message with the variables that set the fields it names."""
    named = [env_name(k) for k in values if re.search(rf"\b{re.escape(k)}\b", message)]
    return f"{', '.join(named) or 'TRAINVITALS_* variables'}: {message}"
