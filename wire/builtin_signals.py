"""The built-in signals' declarations, in the order coverage lists them: GENERATED from
the ``spec`` of each class in ``trainvitals.hooks.signals.builtin.BUILTIN``; do not edit.
Change the class's spec, then run ``python -m trainvitals.hooks.signals.catalogue --write``.

Plain data, no torch: the collector, the alert engine and the generators read the
built-in signals here without importing the hooks.
"""

from __future__ import annotations

from trainvitals.wire.signal_spec import SignalSpec

__all__ = ["BUILTIN_SPECS"]

BUILTIN_SPECS: tuple[SignalSpec, ...] = (
    SignalSpec(
        name="optimizer",
        covers="gradient and parameter norms, update ratios",
        how_to_ask="signals= leaves out 'optimizer'",
        group="optimizer",
        title="Optimizer step",
        selectable=True,
        per_parameter_sums=True,
    ),
    SignalSpec(
        name="params",
        covers="1D parameter drift (I4)",
        how_to_ask="signals= leaves out 'params'",
        group="params",
        title="1D parameters (I4)",
        dashboard="trainvitals-params.json",
        selectable=True,
        per_parameter_sums=True,
        per_param_series=True,
    ),
    SignalSpec(
        name="adam",
        covers="Adam moments (I4)",
        how_to_ask="signals= leaves out 'adam'",
        group="adam",
        title="Adam state (I4)",
        dashboard="trainvitals-params.json",
        selectable=True,
        per_parameter_sums=True,
        per_param_series=True,
    ),
    SignalSpec(
        name="loss",
        covers="loss accounting, I1-I3: track_loss or zero-code from the logits",
        how_to_ask="no track_loss() call and no attach(loss_from_logits=...)",
        group="loss",
        title="Loss accounting (I1-I3)",
        dashboard="trainvitals-loss.json",
        first_call="track_loss()",
    ),
    SignalSpec(
        name="probe",
        covers="the per-modality gradient probe, probe_every",
        how_to_ask="attach(probe_every=N) is off",
    ),
    SignalSpec(
        name="softmax",
        covers="saturation and distillation (I5)",
        how_to_ask="no observe_logits() or observe_distillation() call",
        group="softmax",
        title="Softmax saturation and distillation (I5)",
        dashboard="trainvitals-softmax.json",
        first_call="observe_logits()",
    ),
    SignalSpec(
        name="packing",
        covers="packed sequences: samples of one row that see each other",
        how_to_ask="signals= leaves out 'packing'",
        group="packing",
        title="Packed sequences: samples leaking into each other",
        selectable=True,
    ),
)
