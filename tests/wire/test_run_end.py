"""The run end has one meaning on every side (docs/wire.md, "The run end"): a run has
ended while its latest report carries run_end; a later report means it goes on. The
collector's store, the alert engine and a verdict are fed the same reports and read."""

from __future__ import annotations

from tests.reports import wire_report
from trainvitals.alerts.verdict import VerdictBuilder
from trainvitals.monitor.decode import decode_batch
from trainvitals.monitor.store import SeriesStore
from trainvitals.wire import ReportBatch, encode_body, encode_report, ends_run

# rank 0 ends, rank 1 reports after it, then both end; (reports, ended after them)
_SEQUENCE = [
    ([wire_report(1, [("loss", {}, 1.0)])], False),
    ([wire_report(2, [("loss", {}, 1.0)], events=["run_end"])], True),
    ([wire_report(3, [("loss", {}, 1.0)], rank=1)], False),
    ([wire_report(4, events=["run_end"]), wire_report(4, events=["run_end"], rank=1)], True),
]


def test_store_engine_and_verdict_agree_on_the_run_end():
    store = SeriesStore()
    builder = VerdictBuilder("default")
    engine = builder.engine
    for reports, ended in _SEQUENCE:
        body = encode_body(encode_report(r) for r in reports)
        store.apply(decode_batch(body), 1000.0)
        for report in ReportBatch.model_validate_json(body).reports:
            builder.observe(report, 1000.0)
        truth = ends_run(reports[-1])  # the latest report decides
        assert truth is ended
        assert store.runs(1000.0)[0].ended is ended
        ((run, _seen, _step, engine_ended),) = engine.export_runs()
        assert (run, engine_ended) == ("r1", ended)
        assert builder.verdict("r1").ended is ended
