"""``trainvitals run``: watch every optimizer a job steps, with no change to its code.

The start-up shim (``_sitecustomize/sitecustomize.py``, first on the job's
``PYTHONPATH``) registers one global optimizer pre-step hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) as soon as torch is
imported; that hook calls :func:`on_step`. At an optimizer's first step:

- its model is found (:func:`find_model`): the module that holds all of the
  optimizer's parameters and the fewest trainable parameters besides, the
  outermost of equals (``Net`` rather than its only ``Sequential``; the student
  rather than a wrapper that also trains a teacher the optimizer does not hold);
  DDP and ``torch.compile`` wrappers are looked through as by ``attach``. Parameter
  names are then the ones ``model.named_parameters()`` gives. Parameters spread
  over modules that no single module holds are watched under a stand-in root whose
  children are named after their classes;
- :func:`~trainvitals.hooks.attach.attach` hooks both, configured by the
  ``TRAINVITALS_*`` environment (docs/configuration.md). The monitor's own hooks
  take over from this step on;
- zero-code loss accounting is on where the model's logits can be found
  (``loss_from_logits=True`` finds an LM head) unless ``TRAINVITALS_LOSS_FROM_LOGITS``
  says otherwise; a ``GradScaler`` is passed along when the job has exactly one.

Runs: the first optimizer reports as ``$TRAINVITALS_RUN``, each further one as
``<run>:opt2``, ``<run>:opt3`` (a GAN's two optimizers would otherwise write the same
series). An optimizer that shares parameters with one already watched is either
stepped inside that one's step (a wrapper around an inner optimizer: not watched
twice), or holds all of its parameters and replaces it (a learning-rate finder's
optimizer, then the real one; a new optimizer after unfreezing layers): the run then
goes on with the new optimizer, its step count, counters and drift references carried
over. One that shares only some (stepped in turn with the other) is a run of its own.

Ranks: under a process group (``torchrun`` + ``init_process_group``) each rank
gets a monitor; they combine their figures and rank 0 sends, as with ``attach``.
Processes that ``torchrun`` starts but that never form a group train apart: each
sends its own reports, labelled with the rank from ``$RANK``.

``optimizer.step(closure)`` (LBFGS, Lightning): the closure runs the backward
inside the step, so the monitor takes the gradients as final after the
closure's first call (``step_boundary="manual"``).

Nothing here raises into the job: a failure is logged and that optimizer goes
unwatched.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainvitals.hooks import distributed, integrations_rl
from trainvitals.hooks.attach import build_monitor
from trainvitals.hooks.config import ATTACH_ENV, default_run_name, env_name
from trainvitals.hooks.integrations_distill import distillation_watch, find_trainer
from trainvitals.hooks.job_monitor import Monitor, monitor_of
from trainvitals.hooks.logits_finder import AUTO, find_head
from trainvitals.hooks.naming import unwrap
from trainvitals.hooks.summary import visible_logs
from trainvitals.wire.runs import MAX_RUN

__all__ = ["find_model", "install", "on_step", "watched"]

log = logging.getLogger("trainvitals")

_lock = threading.Lock()
_watched: weakref.WeakKeyDictionary[Any, _Watch] = weakref.WeakKeyDictionary()
_attached = 0  # optimizers watched in this process (names the runs after the first)
_MAX_ROOTS = 16  # modules a stand-in root gathers at most


@dataclass
class _Watch:
    monitor: Monitor | None  # None: not watched (shares parameters, or attach failed)
    params: frozenset[int] = field(default_factory=frozenset)


def install() -> Any:
    """Register the global pre-step hook in this process (what the shim does after
    torch is imported); returns its handle (``.remove()``)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(on_step)


_stepping: set[int] = set()  # ids of the watched optimizers inside their step() now
_post_hook: Any = None


STOP_ENV = "TRAINVITALS_CHECK_STEPS"
"""Set by ``trainvitals check --steps N``: the job stops cleanly after N optimizer steps."""


def _stop_after() -> int | None:
    raw = os.environ.get(STOP_ENV, "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


_stop_at = _stop_after()


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _stepping.discard(id(optimizer))
    if _stop_at is not None:
        watch = _watched.get(optimizer)
        # ours, or the one the job attached itself: --steps counts the job's steps either way
        monitor = watch.monitor if watch is not None and watch.monitor is not None else monitor_of(optimizer)
        if monitor is not None and monitor.step >= _stop_at:
            _stop_job(monitor.step, monitor)


def _stop_job(step: int, stepped: Monitor) -> None:
    """``trainvitals check --steps N``: close every monitor (their last reports are
    written) and end the job with status 0, as asked; the only place trainvitals
    raises into a job, and only this SystemExit."""
    log.info("trainvitals check: stopping the job after %d optimizer steps, as asked (--steps)", step)
    for monitor in [*watched(), *([stepped] if stepped not in watched() else [])]:
        try:
            monitor.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("trainvitals check: closing the monitor of run %r failed: %s", monitor.run, exc)
    raise SystemExit(0)


def _track_steps() -> None:
    """A global post-step hook, so a first step can tell a wrapper's inner optimizer
    (stepped inside a watched one's step) from a replacement."""
    global _post_hook
    if _post_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _post_hook = register_optimizer_step_post_hook(_after_step)


def watched() -> list[Monitor]:
    """The monitors attached so far in this process."""
    return [w.monitor for w in list(_watched.values()) if w.monitor is not None and not w.monitor.closed]


def on_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The global pre-step hook: attach at an optimizer's first step; for a closure-
    stepped one, mark the gradients final after the closure's first call. Returns
    what a pre-step hook may (None, or new args and kwargs); never raises."""
    try:
        watch = _watched.get(optimizer)
        if watch is None:
            watch = _first_step(optimizer, args, kwargs)
        monitor = watch.monitor
        if monitor is not None:
            _stepping.add(id(optimizer))
        if monitor is not None and monitor.config.step_boundary == "manual":
            return _wrap_closure(monitor, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - never into the training loop
        log.warning("trainvitals run: %s: %s", type(exc).__name__, exc)
    return None


def _first_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Watch:
    global _attached
    with _lock:
        watch = _watched.get(optimizer)
        if watch is not None:
            return watch
        visible_logs()
        _track_steps()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ids = frozenset(id(p) for p in params)
        watch = _Watch(None, ids)
        shared = next(
            ((o, w, w.monitor) for o, w in _watched.items() if w.monitor is not None and w.params & ids), None
        )
        if shared is not None and id(shared[0]) in _stepping:
            log.info(
                "trainvitals run: %s is stepped inside the step of %s (run %r): not watched twice",
                type(optimizer).__name__,
                type(shared[0]).__name__,
                shared[2].run,
            )
        elif shared is not None and ids >= shared[1].params:
            watch.monitor = _replace(shared[0], shared[1], optimizer, params, args, kwargs)
        elif not params:
            log.info("trainvitals run: %s has no parameters; not watched", type(optimizer).__name__)
        elif (own := monitor_of(optimizer)) is not None:
            log.warning(
                "trainvitals run: the job attached a monitor to %s itself (run %r); trainvitals run "
                "does not watch it a second time",
                type(optimizer).__name__,
                own.run,
            )
        else:
            try:
                watch.monitor = _attach(optimizer, params, _attached + 1, _closure_of(args, kwargs) is not None)
                _attached += 1
            except Exception as exc:  # noqa: BLE001
                log.error("trainvitals run: not watching %s: %s", type(optimizer).__name__, exc)
        _watched[optimizer] = watch
        return watch


def _replace(
    old_optimizer: Any,
    old: _Watch,
    optimizer: Any,
    params: list[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Monitor | None:
    """The job replaced a watched optimizer: its run goes on with the new one."""
    previous = old.monitor
    assert previous is not None
    try:
        state = previous.state_dict()
        monitor = _attach(optimizer, params, 0, _closure_of(args, kwargs) is not None, run=previous.run)
        monitor.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001
        log.error(
            "trainvitals run: not watching %s, which replaces %s: %s",
            type(optimizer).__name__,
            type(old_optimizer).__name__,
            exc,
        )
        return None
    previous.ends_run = False  # the run goes on: no run_end for the collector
    previous.close()
    old.monitor = None
    log.info(
        "trainvitals run: %s replaces %s (all its parameters): run %r goes on with it from step %d",
        type(optimizer).__name__,
        type(old_optimizer).__name__,
        monitor.run,
        monitor.step,
    )
    return monitor


def _attach(optimizer: Any, params: list[torch.Tensor], index: int, closure: bool, run: str | None = None) -> Monitor:
    model, scaler = _find_objects(params)
    if run is None:
        base = os.environ.get(ATTACH_ENV["run"], "").strip() or default_run_name(sys.argv)
        suffix = "" if index == 1 else f":opt{index}"
        run = base[: MAX_RUN - len(suffix)] + suffix
    options: dict[str, Any] = {}
    if closure and not os.environ.get(env_name("step_boundary"), "").strip():
        options["step_boundary"] = "manual"
    # A TRL RL or preference trainer stepping this optimizer: its objective is read for
    # what it is (integrations_rl), never from the head's gradient as a cross-entropy.
    off = os.environ.get(env_name("loss_from_logits"), "").strip().lower() in ("0", "false", "no", "off")
    trainer = None if off else integrations_rl.find_trainer()
    objective = integrations_rl.identify(trainer) if trainer is not None else None
    # TRL's distillation trainers: a divergence, not a cross-entropy (withheld, said why).
    distill = distillation_watch(find_trainer(model, depth=32)) if objective is None else None
    if objective is not None or distill is not None:
        options["loss_from_logits"] = False
    elif not os.environ.get(env_name("loss_from_logits"), "").strip():
        head = find_head(unwrap(model)).head  # none: the monitor says why loss accounting is off
        options["loss_from_logits"] = head if head is not None else AUTO
    monitor = build_monitor(model, optimizer, run=run, scaler=scaler, **options)
    if objective is not None:
        integrations_rl.install(monitor, trainer, objective)
    if distill is not None:
        distill.install(monitor)
    monitor.automatic = True
    where = ""
    if distributed.world_size() > 1:
        where = f", rank {monitor.rank} of {monitor.world_size}"
    else:
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if world > 1:  # started by torchrun, but no process group: this rank trains alone
            monitor.rank = rank
            where = f", rank {rank} of {world} (no process group: it reports on its own)"
    log.info(
        "trainvitals run: watching %s (%d parameter tensors of %s) as run %r%s%s; %s",
        type(optimizer).__name__,
        len(params),
        type(unwrap(model)).__name__,
        run,
        where,
        "; loss accounting from the logits of " + _name_in(model, options["loss_from_logits"])
        if isinstance(options.get("loss_from_logits"), nn.Module)
        else "",
        monitor.start_line(),
    )
    return monitor


def _closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    # args[0] is the optimizer itself (torch passes the bound call's args).
    closure: Callable[[], Any] | None = kwargs.get("closure")
    if callable(closure):
        return closure
    if len(args) > 1 and callable(args[1]):
        given: Callable[[], Any] = args[1]
        return given
    return None


def _wrap_closure(monitor: Monitor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    closure = _closure_of(args, kwargs)
    if closure is None:
        return None  # no closure this step: the post-step hook marks the gradients final
    called = False

    def wrapped() -> Any:
        nonlocal called
        out = closure()
        if not called:
            called = True
            try:
                monitor.gradients_ready()
            except Exception as exc:  # noqa: BLE001
                monitor.warn_once("autoattach_closure", "gradients_ready failed: %s", exc)
        return out

    if callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": wrapped}
    return (args[0], wrapped, *args[2:]), kwargs


# -- finding the model ---------------------------------------------------------------
def find_model(params: Iterable[torch.Tensor]) -> nn.Module:
    """The module whose parameters the optimizer trains (see the module's docstring)."""
    return _find_objects(list(params))[0]


def _find_objects(params: list[torch.Tensor]) -> tuple[nn.Module, Any]:
    """The model of ``params`` and the job's GradScaler (None unless exactly one is
    enabled), from one pass over the objects the garbage collector tracks (once per
    optimizer, at its first step)."""
    modules: list[nn.Module] = []
    scalers = []
    scaler_type = getattr(torch.amp, "GradScaler", None)
    # type(obj), not isinstance(obj, ...): isinstance reads obj.__class__, which some
    # objects answer with a deprecation warning (torch.distributed.reduce_op).
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, nn.Module):
            modules.append(obj)
        elif scaler_type is not None and issubclass(kind, scaler_type):
            scalers.append(obj)
    enabled = [s for s in scalers if s.is_enabled()]
    return _choose_model(modules, params), enabled[0] if len(enabled) == 1 else None


def _choose_model(modules: list[nn.Module], params: list[torch.Tensor]) -> nn.Module:
    want = {id(p) for p in params}
    children = {id(c) for m in modules for c in m.children()}
    tops = [m for m in modules if id(m) not in children]
    best = _best_cover(tops, want)
    if best is not None:
        return best
    # No single module holds them all: gather the modules that hold most of them.
    picked: list[nn.Module] = []
    left = set(want)
    while left and len(picked) < _MAX_ROOTS:
        found = _best_partial(tops, left)
        if found is None:
            break
        picked.append(found)
        left -= {id(p) for p in found.parameters()}
    if not picked:
        raise ValueError("none of its parameters belongs to a torch.nn.Module; use attach() with the model")
    root = nn.Module()
    taken: dict[str, int] = {}
    for m in picked:
        name = _snake(type(unwrap(m)).__name__)
        taken[name] = taken.get(name, 0) + 1
        root.add_module(name if taken[name] == 1 else f"{name}_{taken[name]}", m)
    log.info(
        "trainvitals run: the optimizer's parameters belong to %d separate modules; they are named under %s",
        len(picked),
        ", ".join(name for name, _ in root.named_children()),
    )
    return root


def _best_cover(tops: list[nn.Module], want: set[int]) -> nn.Module | None:
    """Among the modules holding every wanted parameter: the fewest trainable extras,
    then the outermost."""
    best: tuple[int, int] | None = None
    found = None
    stack = [(m, 0) for m in tops]
    while stack:
        m, depth = stack.pop()
        held = {id(p): p for p in m.parameters()}
        if not want <= held.keys():
            continue
        extra = sum(1 for i, p in held.items() if i not in want and p.requires_grad)
        if best is None or (extra, depth) < best:
            best, found = (extra, depth), m
        stack.extend((c, depth + 1) for c in m.children())
    return found


def _best_partial(tops: list[nn.Module], left: set[int]) -> nn.Module | None:
    """The module holding the most of ``left`` (outermost first), narrowed to a child
    that holds as many."""

    def held(m: nn.Module) -> int:
        return sum(1 for p in m.parameters() if id(p) in left)

    scored = [(held(m), m) for m in tops]
    count, best = max(scored, key=lambda x: x[0], default=(0, None))
    if not count or best is None:
        return None
    while True:
        inner = next((c for c in best.children() if held(c) == count), None)
        extras = sum(1 for p in best.parameters() if id(p) not in left and p.requires_grad)
        if inner is None or extras == 0:
            return best
        best = inner


def _name_in(model: nn.Module, module: Any) -> str:
    for name, m in unwrap(model).named_modules():
        if m is module:
            return repr(name)
    return type(module).__name__


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower() or "module"


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return 0
