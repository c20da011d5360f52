"""Series identity: which labels a run's sample carries on ``/metrics`` and in alerts."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["series_labels"]


def series_labels(run: str, rank: int, labels: Mapping[str, str]) -> dict[str, str]:
    """``run``, then ``rank`` unless it is 0, then the sample's own labels.

    Rank 0 is the run's voice: it sends the values that are global to the job, so
    they carry no rank label. Other ranks send per-rank series only, labelled
    ``rank="N"``.
    """
    out = {"run": run}
    if rank:
        out["rank"] = str(rank)
    out.update(labels)
    return out
