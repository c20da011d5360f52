"""SeriesStore: ingest, atomic refusal, TTL expiry, the series cap, run_end, callbacks."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from tests.reports import make_batch, make_report, make_sample
from trainvitals.monitor.store import IngestRefused, SeriesLimitExceeded, SeriesStore
from trainvitals.wire import Report, ReportBatch, Sample

T0 = 1_000_000.0


def series(store: SeriesStore, now: float = T0) -> dict[tuple[str, int, str], list]:
    """(run, rank, wire name) -> [(label items, value)], everything the store holds."""
    return {
        (run, rank, name): sorted(items)
        for run, _, _, _, per_rank in store.copy_runs(now)
        for rank, fams in per_rank
        for name, items in fams
    }


def test_ingest_keeps_latest_value_per_series_and_run_state():
    store = SeriesStore()
    store.ingest(make_batch(make_report("a", 10, [make_sample("loss", 2.0, modality="text")])), T0)
    store.ingest(make_batch(make_report("a", 20, [make_sample("loss", 1.5, modality="text")])), T0 + 1)

    assert store.get("a", "loss", {"modality": "text"}) == 1.5
    [run] = store.runs(T0 + 1)
    assert (run.run, run.step, run.last_report_time, run.ranks) == ("a", 20, T0 + 1, (0,))
    assert len(store) == 3  # loss + step + last_report_timestamp_seconds


def test_label_order_does_not_make_a_new_series():
    store = SeriesStore()
    s1 = make_sample("softmax_saturated_ratio", 0.1, task="ie", role="teacher", threshold="0.99")
    s2 = {"name": s1["name"], "labels": dict(reversed(list(s1["labels"].items()))), "value": 0.2}
    store.ingest(make_batch(make_report("a", 1, [s1])), T0)
    store.ingest(make_batch(make_report("a", 2, [s2])), T0)
    assert len(store) == 3
    assert store.get("a", s1["name"], s1["labels"]) == 0.2


def test_ranks_keep_distinct_series():
    store = SeriesStore()
    store.ingest(
        make_batch(
            make_report("a", 5, [make_sample("grad_norm", 3.0, group="all")]),
            make_report("a", 5, [make_sample("grad_norm", 4.0, group="all")], rank=2),
        ),
        T0,
    )
    assert series(store) == {
        ("a", 0, "grad_norm"): [((("group", "all"),), 3.0)],
        ("a", 2, "grad_norm"): [((("group", "all"),), 4.0)],
    }
    assert store.get("a", "grad_norm", {"group": "all"}, rank=2) == 4.0
    assert store.runs(T0)[0].ranks == (0, 2)
    assert len(store) == 4


def test_counters_store_the_latest_cumulative_value():
    store = SeriesStore()
    for step, total in [(1, 1.0), (2, 3.0)]:
        store.ingest(make_batch(make_report("a", step, [make_sample("nonfinite_total", total, what="loss")])), T0)
    assert series(store) == {("a", 0, "nonfinite_total"): [((("what", "loss"),), 3.0)]}


def test_nonfinite_values_are_kept():
    store = SeriesStore()
    store.ingest(make_batch(make_report("a", 1, [make_sample("grad_norm", math.inf, group="all")])), T0)
    assert store.get("a", "grad_norm", {"group": "all"}) == math.inf


def test_series_limit_refuses_the_whole_batch_and_changes_nothing():
    store = SeriesStore(max_series=6)
    store.ingest(make_batch(make_report("a", 1, [make_sample("loss", 1.0, modality="text")])), T0)
    before = series(store)

    too_many = make_batch(
        make_report("a", 2, [make_sample("loss", 9.0, modality="text"), make_sample("loss", 9.0, modality="x")]),
        make_report("b", 2, [make_sample("loss", 9.0, modality="text")]),  # +3 with step/timestamp
    )
    with pytest.raises(SeriesLimitExceeded, match="series limit"):
        store.ingest(too_many, T0 + 5)

    assert series(store) == before
    assert store.runs(T0)[0].step == 1
    assert len(store) == 3


def test_series_limit_counts_updates_as_free():
    store = SeriesStore(max_series=3)
    for step in range(5):
        store.ingest(make_batch(make_report("a", step, [make_sample("loss", step, modality="text")])), T0)
    assert len(store) == 3
    with pytest.raises(SeriesLimitExceeded):
        store.ingest(make_batch(make_report("a", 9, [make_sample("loss", 1.0, modality="image")])), T0)


def test_duplicate_series_within_a_batch_count_once():
    store = SeriesStore(max_series=3)
    s = [make_sample("loss", 1.0, modality="text"), make_sample("loss", 2.0, modality="text")]
    store.ingest(make_batch(make_report("a", 1, s), make_report("a", 2, s[:1])), T0)
    assert store.get("a", "loss", {"modality": "text"}) == 1.0  # later report wins
    assert store.runs(T0)[0].step == 2


@pytest.mark.parametrize("name", ["step", "last_report_timestamp_seconds", "alerts_firing"])
def test_collector_owned_names_are_refused(name):
    # The wire schema refuses them; a batch built in process without it meets the store's check.
    with pytest.raises(ValueError, match="produced by the collector"):
        make_batch(make_report("a", 1, [make_sample(name, 1.0)]))
    store = SeriesStore()
    report = Report.model_construct(
        run="a",
        step=1,
        time=T0,
        rank=0,
        events=[],
        sender=None,
        seq=None,
        samples=[Sample.model_construct(name=name, labels={}, value=1.0)],
    )
    with pytest.raises(IngestRefused, match="produced by the collector"):
        store.ingest(ReportBatch.model_construct(schema_version=1, reports=[report]), T0)
    assert store.runs(T0) == [] and len(store) == 0


def test_gauge_counter_name_clash_is_refused_atomically():
    store = SeriesStore()
    store.ingest(make_batch(make_report("a", 1, [make_sample("widgets", 1.0)])), T0)
    with pytest.raises(IngestRefused, match="both be exposed as trainvitals_widgets"):
        store.ingest(make_batch(make_report("a", 2, [make_sample("widgets_total", 1.0)])), T0)
    assert store.runs(T0)[0].step == 1
    with pytest.raises(IngestRefused):
        store.ingest(make_batch(make_report("b", 1, [make_sample("x", 1.0), make_sample("x_total", 1.0)])), T0)
    assert [r.run for r in store.runs(T0)] == ["a"]


def test_runs_expire_after_ttl_with_all_their_series():
    store = SeriesStore(ttl_seconds=60)
    store.ingest(make_batch(make_report("old", 1)), T0)
    store.ingest(make_batch(make_report("new", 1)), T0 + 50)
    assert [r.run for r in store.runs(T0 + 59)] == ["new", "old"]

    assert store.expire(T0 + 60) == ["old"]
    assert [r.run for r in store.runs(T0 + 60)] == ["new"]
    assert len(store) == 3
    assert store.get("old", "loss", {"modality": "text"}) is None


def test_copy_and_ingest_expire_silent_runs():
    store = SeriesStore(ttl_seconds=10)
    store.ingest(make_batch(make_report("old", 1)), T0)
    assert store.copy_runs(T0 + 10) == []
    store.ingest(make_batch(make_report("old", 1)), T0)
    store.ingest(make_batch(make_report("new", 1)), T0 + 11)
    assert [r.run for r in store.runs(T0 + 11)] == ["new"]


RUN_END = {"kind": "run_end", "detail": "Monitor.close() after 5 optimizer steps"}


def test_run_end_marks_the_run_ended_until_a_later_report_without_it():
    store = SeriesStore()
    store.ingest(make_batch(make_report("a", 4)), T0)
    assert store.runs(T0)[0].ended is False
    assert len(store) == 3

    store.ingest(make_batch(make_report("a", 5, events=[RUN_END])), T0 + 1)
    [run] = store.runs(T0 + 1)
    assert (run.step, run.ended) == (5, True)
    assert store.copy_runs(T0 + 1)[0][3] is True
    assert len(store) == 4  # trainvitals_run_ended{run} is one more series

    other = {"kind": "optimizer_state_reset", "detail": ""}
    store.ingest(make_batch(make_report("a", 6, events=[other])), T0 + 2)  # the same run resumed
    assert store.runs(T0 + 2)[0].ended is False
    assert len(store) == 3


def test_run_end_counts_against_the_series_cap():
    store = SeriesStore(max_series=3)
    store.ingest(make_batch(make_report("a", 1)), T0)
    with pytest.raises(SeriesLimitExceeded, match="would add 1 series"):
        store.ingest(make_batch(make_report("a", 2, events=[RUN_END])), T0)
    assert store.runs(T0)[0].ended is False

    roomy = SeriesStore(max_series=4)
    roomy.ingest(make_batch(make_report("a", 1), make_report("a", 2, events=[RUN_END])), T0)
    # Already ended, and a batch whose last report ends it again: no new series.
    roomy.ingest(make_batch(make_report("a", 3), make_report("a", 4, events=[RUN_END])), T0)
    assert roomy.runs(T0)[0].ended is True and len(roomy) == 4


def test_on_ingest_callbacks_see_the_batch_and_cannot_break_ingest(caplog):
    store = SeriesStore()
    seen = []

    def bad(b, now):
        raise RuntimeError("boom")

    store.on_ingest(bad)
    handle = store.on_ingest(lambda b, now: seen.append((b.reports[0].step, now)))
    with caplog.at_level(logging.ERROR, logger="trainvitals.monitor.store"):
        assert store.ingest(make_batch(make_report("a", 7)), T0) == 1
    assert seen == [(7, T0)]
    assert "on_ingest callback" in caplog.text
    assert store.runs(T0)[0].step == 7

    handle.remove()
    handle.remove()
    store.ingest(make_batch(make_report("a", 8)), T0)
    assert seen == [(7, T0)]


def test_refused_batch_does_not_call_callbacks():
    store = SeriesStore(max_series=1)
    seen = []
    store.on_ingest(lambda b, now: seen.append(b))
    with pytest.raises(SeriesLimitExceeded):
        store.ingest(make_batch(make_report("a", 1)), T0)
    assert seen == []


def test_concurrent_ingest_keeps_counts_consistent():
    store = SeriesStore()

    def worker(i: int) -> None:
        for step in range(50):
            samples = [make_sample("param_absmax", float(step), param=f"p{j}") for j in range(20)]
            store.ingest(make_batch(make_report(f"run{i}", step, samples)), T0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 4 * 22
    assert sum(len(items) for items in series(store).values()) == 4 * 20


def test_constructor_rejects_bad_limits():
    with pytest.raises(ValueError, match="ttl_seconds"):
        SeriesStore(ttl_seconds=0)
    with pytest.raises(ValueError, match="max_series"):
        SeriesStore(max_series=0)
