"""The signals, one package per family, each holding its maths apart from its hook wiring.

- ``base``: the lifecycle every signal follows and what it may use of the monitor;
- ``registry``: ``register(SignalClass)``, the one line that adds a signal (its
  declaration, a torch-free :class:`~trainvitals.wire.signals.SignalSpec`, is what
  coverage, live settings, the collector and the generators read); ``builtin``: the
  built-in signals' lines;
- ``optimizer/``: update and gradient statistics (``stats``), Adam's state (``adam``,
  with ``state``, ``resets`` and ``adam_moments``);
- ``params/``: 1D parameter drift (``signal``, ``drift``, the ``weight_decay`` audit);
- ``grad_norm/``: gradient norms measured during the backward pass;
- ``loss/``: loss accounting (``signal`` places the hooks; the binning, the step's sums,
  the report's figures and its index plan in modules of their own);
- ``softmax/``: saturation and distillation (``signal``, ``positions``, ``maths``);
- ``param_series``: the per-parameter series and group keys several families share.
"""
