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
says so once on stderr and the job runs unmonitored.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _LoaderAfter:
    """Wraps torch's loader: runs ``then(module)`` once torch is fully imported."""

    def __init__(self, loader, then):
        self._loader = loader
        self._then = then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        # Torch's own loader from here on, for anything that asks the module.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._then(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _WhenTorchImported:
    """A meta path finder that only watches for ``torch`` (then steps aside)."""

    def __init__(self, then):
        self._then = then
        self._busy = False

    def find_spec(self, name, path=None, target=None):
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
        spec.loader = _LoaderAfter(spec.loader, self._then)
        return spec

    def invalidate_caches(self):
        pass


_impl = None


def _pre_step(optimizer, args, kwargs):
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


def _off(optimizer, args, kwargs):
    return None


def _torch_imported(torch):
    try:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_pre_step)
    except Exception as exc:  # noqa: BLE001 - an old torch without global hooks
        sys.stderr.write(
            f"trainvitals run: cannot hook torch {getattr(torch, '__version__', '?')}'s "
            f"optimizers ({type(exc).__name__}: {exc}); this job runs unmonitored\n"
        )


def _chain():
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


if "torch" in sys.modules:  # pragma: no cover - nothing imports torch before site runs
    _torch_imported(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _WhenTorchImported(_torch_imported))
_chain()
