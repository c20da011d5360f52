"""The alert service's timer thread (trainvitals.alerts.ticker)."""

from __future__ import annotations

import logging
import threading

from trainvitals.alerts.ticker import Ticker


def test_a_failing_tick_is_logged_and_the_next_one_runs(caplog):
    calls: list[int] = []
    second = threading.Event()

    def tick() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the first tick fails")
        second.set()

    ticker = Ticker(tick, 0.01, name="test-alert-ticker")
    with caplog.at_level(logging.ERROR, logger="trainvitals.alerts"):
        ticker.start()
        ticker.start()  # already running: no second thread
        assert len([t for t in threading.enumerate() if t.name == "test-alert-ticker"]) == 1
        assert second.wait(60), "the tick after a failing one never ran"
        ticker.stop()
    assert "alert tick failed" in caplog.text
    assert "the first tick fails" in caplog.text
    assert not ticker.running
    assert not [t for t in threading.enumerate() if t.name == "test-alert-ticker"]


def test_stop_before_start_and_a_restart():
    ran = threading.Event()
    ticker = Ticker(ran.set, 0.01, name="test-alert-ticker-restart")
    ticker.stop()  # never started: nothing to join
    ticker.start()
    assert ran.wait(60)
    ticker.stop()
    ran.clear()
    ticker.start()  # stop() then start() runs again
    assert ran.wait(60)
    ticker.stop()
    assert not ticker.running
