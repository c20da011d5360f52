"""``attach()``: hook a model and its optimizer, checking every argument at once.

Wrong arguments raise here, before anything is hooked, saying what to pass
instead; past this point nothing trainvitals does raises into the training loop.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from trainvitals.hooks import distributed
from trainvitals.hooks.config import ATTACH_ENV, CHECK_ENV, Config, attach_env
from trainvitals.hooks.job_monitor import Monitor, monitor_of
from trainvitals.hooks.sinks import NullSink, make_sink
from trainvitals.wire.runs import check_run

__all__ = ["attach"]

log = logging.getLogger("trainvitals")

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")


def _check_names(what: str, names: Iterable[Any]) -> tuple[str, ...]:
    out = tuple(names)
    for n in out:
        if not isinstance(n, str) or not _NAME_RE.match(n):
            raise ValueError(f"{what}: {n!r} is not a usable name; use short identifiers like 'text', 'image'")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: names must be unique, got {out!r}")
    return out


def _media_modalities(model: nn.Module) -> tuple[str, ...]:
    """("text", "image"[, "video"]) for a model whose config names an image (video) token
    id: zero-code accounting then classes each sample by its input ids."""
    from trainvitals.hooks.naming import unwrap
    from trainvitals.hooks.signals.loss.modality import model_media_tokens

    tokens = model_media_tokens(unwrap(model))
    if not tokens:
        return ()
    mods = ("text", *(name for name in ("image", "video") if name in tokens))
    log.info(
        "trainvitals: the model's config names %s token ids: samples are classed as %s by their input ids",
        "/".join(mods[1:]),
        ", ".join(mods),
    )
    return mods


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (accelerate, Lightning, Megatron's
    ChainedOptimizer around FP32Optimizer); a TypeError saying what to pass otherwise."""
    from trainvitals.hooks.integration_support import torch_optimizer

    try:
        return torch_optimizer(optimizer)
    except TypeError as exc:
        if "chains" in str(exc):
            raise
        raise TypeError(
            f"attach(optimizer=...) needs a torch.optim.Optimizer (or a wrapper holding one as "
            f".optimizer), got {type(optimizer).__name__}; pass the optimizer whose .step() updates "
            "the parameters (not a scheduler)"
        ) from None


def _framework_defaults(model: nn.Module, options: dict[str, Any], env_options: dict[str, Any]) -> None:
    """Megatron-core's loss convention, where the job has not said otherwise: with
    ``calculate_per_token_loss`` the loss is a sum over tokens that Megatron divides by
    the step's tokens over all ranks after the backward (``loss_reduction="sum"``).
    (Without it, loss accounting takes per-sample weighting as the intent on steps whose
    micro-batches each hold one sample: :mod:`~trainvitals.hooks.signals.loss.signal`.)"""
    from trainvitals.hooks.naming import unwrap

    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if not type(inner).__module__.startswith("megatron.") or config is None:
        return
    given = {**env_options, **options}
    if getattr(config, "calculate_per_token_loss", None) is True and "loss_reduction" not in given:
        options["loss_reduction"] = "sum"


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    run: str | None = None,
    collector: str | None = None,
    sink: Any = None,
    modalities: Sequence[str] | None = None,
    every: int | None = None,
    scaler: Any = None,
    rules: Any = None,
    **options: Any,
) -> Monitor:
    """Hook ``model`` and ``optimizer`` and stream training-health reports.

    ``run``: the run's name (default ``$TRAINVITALS_RUN``; one of them is needed).
    ``collector``: a collector URL (``http://host:9477``); or ``sink``: ``"file:PATH"``,
    ``"null"`` or a sink object; default ``$TRAINVITALS_COLLECTOR``, else
    ``./trainvitals-<run>.jsonl``. ``modalities``: names for integer modality codes.
    ``every``: report every N optimizer steps (default 10). ``scaler``: a ``GradScaler``,
    so loss weights are unscaled. ``rules``: alert rules evaluated in the job, each
    firing and resolution logged with its step and value and a verdict at close
    (``"default"``, rule files, ``"off"``); default: the default rules (with a collector
    too, which evaluates its own; reports it never takes are kept in
    ``./trainvitals-<run>.jsonl``). Further options: see
    :class:`trainvitals.hooks.config.Config`. Options not passed come from the
    ``TRAINVITALS_*`` environment variables where set (docs/configuration.md).

    One monitor per optimizer: attaching to an optimizer that already has one raises
    (close it first); one that ``trainvitals run`` attached is closed, with a warning,
    and this one takes over. Logs one line saying what is watched.
    """
    monitor = build_monitor(
        model,
        optimizer,
        run=run,
        collector=collector,
        sink=sink,
        modalities=modalities,
        every=every,
        scaler=scaler,
        rules=rules,
        **options,
    )
    log.info("trainvitals: %s", monitor.start_line())
    return monitor


def build_monitor(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    run: str | None = None,
    collector: str | None = None,
    sink: Any = None,
    modalities: Sequence[str] | None = None,
    every: int | None = None,
    scaler: Any = None,
    rules: Any = None,
    **options: Any,
) -> Monitor:
    """:func:`attach` without its start line (``trainvitals run`` writes its own)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach(model=...) needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _inner_optimizer(optimizer)
    # Arguments win over the environment; a bad variable raises naming it.
    env = attach_env()
    env_options = Config.from_env()
    every, collector, sink = _under_check(every, collector, sink, env_options)
    if run is None:
        run = env.get("run")
        if run is None:
            raise TypeError(f"attach() needs run='name' (or {ATTACH_ENV['run']} in the environment)")
        check_run(run, ATTACH_ENV["run"])
    if modalities is None:
        modalities = env.get("modalities", ())
    if rules is None:
        rules = env.get("rules")
    check_run(run)
    if collector is not None and sink is not None:
        raise ValueError("pass either collector=URL or sink=..., not both")
    if collector is not None and not (isinstance(collector, str) and collector.startswith(("http://", "https://"))):
        raise ValueError(f"collector={collector!r} must be an http(s) URL like 'http://127.0.0.1:9477'")
    if isinstance(modalities, str):
        raise TypeError(f"modalities={modalities!r} must be a sequence of names, e.g. ('text', 'image')")
    mods = _check_names("modalities", modalities)
    if scaler is not None and not (hasattr(scaler, "get_scale") and hasattr(scaler, "unscale_")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or None), got {type(scaler).__name__}")
    unknown = sorted(set(options) - set(Config.field_names()))
    if unknown:
        raise TypeError(f"attach() got unknown option(s) {unknown}; known options: {Config.field_names()}")
    if every is not None:
        options["every"] = every
    _framework_defaults(model, options, env_options)
    config = Config(**{**env_options, **options})
    if config.loss_from_logits and not mods:
        mods = _media_modalities(model)
    existing = monitor_of(optimizer)
    if existing is not None:
        if not existing.automatic:
            raise ValueError(
                f"attach(): this {type(optimizer).__name__} already has a monitor (run {existing.run!r}); "
                "one monitor per optimizer: use that one, or close() it before attaching again"
            )
        log.warning(
            "trainvitals: the job attaches a monitor itself (run %r) to the %s that trainvitals run "
            "watches as run %r: the job's own takes over, trainvitals run's is closed (one monitor per optimizer)",
            run,
            type(optimizer).__name__,
            existing.run,
        )
        existing.close()
    # Only rank 0 sends; other ranks compute (and join the collectives) but send nothing.
    resolved = make_sink(collector, sink, run) if distributed.rank() == 0 else NullSink()
    rules = _local_rules(rules)
    return Monitor(model, optimizer, run=run, sink=resolved, modalities=mods, scaler=scaler, config=config, rules=rules)


def _under_check(every: Any, collector: Any, sink: Any, env_options: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Under ``trainvitals check -- CMD``: the check's interval and report file, whatever
    the job passes (said in the log when it passed something else)."""
    check_sink = os.environ.get(CHECK_ENV, "").strip()
    if not check_sink:
        return every, collector, sink
    checked = env_options.get("every")
    if checked is not None and every is not None and every != checked:
        log.warning("trainvitals check: reporting every %d step(s) as the check asks, not every=%d", checked, every)
    if collector is not None or sink is not None:
        log.warning("trainvitals check: reports go to %s for the check, not to %r", check_sink, collector or sink)
    return (checked if checked is not None else every), None, check_sink


_OFF = ("off", "none", "false", "no", "0")


def _local_rules(rules: Any) -> Any:
    """What the job evaluates in-process: ``rules`` as given, nothing when turned off, and
    the default rules when nothing was said (with a collector too: the job's log then says
    each alert as it fires, and keeps judging when the collector cannot be reached)."""
    if rules is False or (isinstance(rules, str) and rules.strip().lower() in _OFF):
        return None
    if isinstance(rules, list | tuple) and len(rules) == 1 and str(rules[0]).strip().lower() in _OFF:
        return None
    if rules is None and distributed.rank() == 0:
        return "default"
    return rules
