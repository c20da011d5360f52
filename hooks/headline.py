"""The headline figures of a report, for the trackers a job already uses.

A handful of series per signal, not every per-parameter series: what the HF
callback adds to the Trainer's logs (so every ``report_to`` backend shows them), what
the Lightning callback logs through the module's loggers and what
:class:`~trainvitals.hooks.sinks.TensorBoardSink` writes for a plain loop.

Names are the ``/metrics`` names, labels appended as ``/label:value`` (a form every
tracker takes: MLflow refuses braces, quotes and ``=``)::

    trainvitals_grad_norm
    trainvitals_modality_excess_dilution_ratio/modality:image
    trainvitals_alerts_firing/alertname:GradientDilution        (1 while it fires)

Per-parameter metrics (``param_drift_log2``, ``adam_eps_dominated_ratio``) give their
:data:`PER_PARAMETER_SERIES` most extreme parameters only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from trainvitals.wire import PREFIX

__all__ = ["HEADLINE", "PER_PARAMETER_SERIES", "figure_name", "headline_figures"]

HEADLINE: tuple[str, ...] = (
    # optimizer
    "grad_norm",
    "grad_norm_max",
    "update_ratio",
    "param_norm",
    # loss accounting
    "loss",
    "modality_excess_dilution_ratio",
    "modality_grad_share_ratio",
    "loss_weight_mass",
    "loss_accumulation_exponent",
    "token_weight_spread_ratio",
    # 1D parameters and Adam (per parameter: the most extreme only)
    "param_drift_log2",
    "adam_eps_dominated_ratio",
    # softmax
    "softmax_saturated_ratio",
    "softmax_top1_prob_mean",
)
"""The metrics the trackers get."""

PER_PARAMETER_SERIES = 3
"""Series of a per-parameter metric given to the trackers (the highest values)."""


def figure_name(name: str, labels: Mapping[str, str]) -> str:
    """``trainvitals_<metric>`` then ``/label:value`` per label."""
    return PREFIX + name + "".join(f"/{k}:{v}" for k, v in labels.items())


def headline_figures(samples: Iterable[Any], firing: Iterable[str] = ()) -> dict[str, float]:
    """The headline figures of one report's samples (wire samples, or dicts with ``name``,
    ``labels``, ``value``; non-finite values left out) and ``firing``: the names of the
    alerts firing."""
    out: dict[str, float] = {}
    per_param: dict[str, list[tuple[float, str]]] = {}
    wanted = set(HEADLINE)
    for s in samples:
        mapping = isinstance(s, Mapping)
        name = s["name"] if mapping else s.name
        if name not in wanted:
            continue
        value = float(s["value"] if mapping else s.value)
        if not math.isfinite(value):
            continue
        labels = (s.get("labels") if mapping else s.labels) or {}
        key = figure_name(name, labels)
        if "param" in labels:
            per_param.setdefault(name, []).append((value, key))
        else:
            out[key] = value
    for ranked in per_param.values():
        for value, key in sorted(ranked, reverse=True)[:PER_PARAMETER_SERIES]:
            out[key] = value
    for alert in sorted(set(firing)):
        out[figure_name("alerts_firing", {"alertname": alert})] = 1.0
    return out
