"""trainvitals' start-up shim for ``trainvitals run`` (docs: README, "Attach without
editing the job").

``trainvitals run`` puts this folder first on the job's ``PYTHONPATH``, so every
Python process of the job (``python train.py``, ``python -m pkg``, each rank that
``torchrun`` starts) imports this file as ``sitecustomize`` at start-up. It:

1. waits for torch: an import hook sees ``import torch`` complete, then registers
   one global optimizer pre-step hook. Nothing is imported before that, so a
   process that never imports torch pays nothing, and one that does pays a
   function call per optimizer step until ``trainvitals.hooks.autoattach`` takes
   over at the first step;
2. runs the ``sitecustomize`` this file hides (the next one on ``sys.path``), if
   any, so the job sees its own start-up code as before.

It never stops the job: if trainvitals cannot be imported by this interpreter, it
says so once on stderr and the job runs unmonitored. A process that imports torch
and exits without stepping an optimizer says so on stderr too (nothing was watched,
nothing was sent): never a silent blind run.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: this runs in every process of the job, typing costs ms to import
if TYPE_CHECKING:
    from collections.abc import Callable
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    Hook = Callable[[Any, Any, Any], Any]

_HERE = os.path.dirname(os.path.abspath(__file__))


class _LoaderAfter:
    """Wraps torch's loader: runs ``then(module)`` once torch is fully imported."""

    def __init__(self, loader: Loader, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # Torch's own loader from here on, for anything that asks the module.
        module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec.loader = self._loader
        self._then(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _WhenTorchImported:
    """A meta path finder that only watches for ``torch`` (then steps aside)."""

    def __init__(self, then: Callable[[ModuleType], None]) -> None:
        self._then = then
        self._busy = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name != "torch" or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec(name)  # the other finders' answer
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once is enough
        spec.loader = _LoaderAfter(spec.loader, self._then)  # type: ignore[assignment]  # a Loader by delegation
        return spec

    def invalidate_caches(self) -> None:
        pass


_impl: Hook | None = None


def _pre_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
    """The global pre-step hook: hands over to trainvitals.hooks.autoattach."""
    global _impl
    if _impl is None:
        try:
            from trainvitals.hooks import autoattach

            _impl = autoattach.on_step
        except Exception as exc:  # noqa: BLE001 - never stop the job
            sys.stderr.write(
                f"trainvitals run: cannot import trainvitals in {sys.executable} "
                f"({type(exc).__name__}: {exc}); this job runs unmonitored\n"
            )
            _impl = _off
    return _impl(optimizer, args, kwargs)


def _off(optimizer: Any, args: Any, kwargs: Any) -> None:
    return None


def _torch_imported(torch: ModuleType) -> None:
    try:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_pre_step)
    except Exception as exc:  # noqa: BLE001 - an old torch without global hooks
        sys.stderr.write(
            f"trainvitals run: cannot hook torch {getattr(torch, '__version__', '?')}'s "
            f"optimizers ({type(exc).__name__}: {exc}); this job runs unmonitored\n"
        )


def _chain() -> None:
    """Import the sitecustomize this one hides, as Python would have."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _job_process() -> bool:
    """Whether this process is one of the job's own (not torchrun's launcher, not a
    multiprocessing worker: those never step an optimizer by design)."""
    if "multiprocessing" in sys.modules:
        try:
            if sys.modules["multiprocessing"].parent_process() is not None:
                return False
        except Exception:  # noqa: BLE001
            return False
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if getattr(spec, "name", "") in ("torch.distributed.run", "torch.distributed.launch"):
        return False
    return os.path.basename(sys.argv[0] if sys.argv else "") not in ("torchrun",)


def _shown(url: str) -> str:
    """The destination without a password (the standard library only)."""
    try:
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        if parts.password is not None:
            host = parts.hostname or ""
            netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
            return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except Exception:  # noqa: BLE001
        pass
    return url


def _at_exit() -> None:
    """No optimizer step ran in a process that imported torch: say that nothing was watched."""
    if _impl is not None or "torch" not in sys.modules or not _job_process():
        return
    run = os.environ.get("TRAINVITALS_RUN", "")
    where = os.environ.get("TRAINVITALS_COLLECTOR") or "./trainvitals-{}.jsonl".format(run.replace("/", "_"))
    sys.stderr.write(
        f"trainvitals run: run {run!r}: the job imported torch but stepped no torch optimizer "
        f"(optimizer.step() never ran): NOTHING was watched and no report was sent to {_shown(where)}\n"
    )


import atexit  # noqa: E402 - after the definitions it registers

atexit.register(_at_exit)

if "torch" in sys.modules:  # pragma: no cover - nothing imports torch before site runs
    _torch_imported(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _WhenTorchImported(_torch_imported))
_chain()
