"""The autoscaler's measured TTFT on plain data: each API replica's bounded record of first tokens and of requests
still waiting for one, the reports the autoscaler keeps (a stale replica left out, and logged), the signal reader's
p99 from them (a measured TTFT over target steps up where the queue's prediction is low; waiting requests count at
their age; the prediction is the fallback without a measurement), and the reporter's push with its deadline
(cluster/first_token.py, cluster/autoscale.py, deploy/serve/ttft_reporter.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from cluster.autoscale import AutoscalePolicy, AutoscaleTarget, AutoscalingConfig, SignalReader
from cluster.dispatch import make_dispatch
from cluster.first_token import FirstTokenRecord, MeasuredTtft, TtftReport, TtftReports
from cluster.instances import InstanceRow
from cluster.registry import Registry
from cluster.stats import EngineStats, LoadStats, StepStats
from deploy.serve.ttft_reporter import TtftReporter

SLOTS = 4
STEP_S = 0.05


def rows(*loads: tuple[int, int]) -> list[InstanceRow]:
    """The router's rows of instances i0, i1, ... each (waiting, running), their engine steps STEP_S."""
    registry = Registry(make_dispatch("least_load"), keep_finished=0)
    for n, (waiting, running) in enumerate(loads):
        registry.register(f"i{n}", "m", "node", 0.0)
        registry.update(f"i{n}", EngineStats(LoadStats(running=running, waiting=waiting, kv_blocks_used=running,
                                                       kv_blocks_free=SLOTS - running),
                                             StepStats(step_time_s=STEP_S, step_time_ema_s=STEP_S,
                                                       batch_size=running, batch_tokens=running)), True, None, 0.0)
    return [e.row() for e in registry.instances.values()]


def ttft_policy(**kw) -> AutoscalePolicy:
    return AutoscalePolicy(AutoscalingConfig(min_instances=1, max_instances=4, up_after_s=0.0, cooldown_s=0.0,
                                             predict=False, **kw, target=AutoscaleTarget(ttft_p99_s=1.0,
                                                                                         queue_per_instance=None)),
                           SLOTS)


# ---- one replica's record -----------------------------------------------------------------------------------
def test_the_record_keeps_recent_first_tokens_and_the_requests_still_waiting_at_their_age() -> None:
    r = FirstTokenRecord(keep_s=10.0)
    r.begin("a", arrival=100.0)
    r.begin("b", arrival=101.0)
    r.begin("c", arrival=102.0)
    r.first("a", ttft_s=0.5, now=100.5)
    r.end("c")  # ended (aborted, refused) without a first token: no sample, no longer waiting
    r.end("a")  # already had its first token: a no-op
    report = r.report("api-1", now=104.0)
    assert report == TtftReport("api-1", ((3.5, 0.5),), (3.0,))
    r.first("b", ttft_s=4.0, now=105.0)
    assert r.report("api-1", now=111.0) == TtftReport("api-1", ((1.0 + 5.0, 4.0),), ())  # a's sample aged out


def test_the_record_is_bounded() -> None:
    r = FirstTokenRecord(max_samples=3, max_waiting=2)
    for n in range(5):
        r.begin(f"r{n}", arrival=float(n))
        r.first(f"s{n}", ttft_s=float(n), now=float(n))
    report = r.report("api-1", now=5.0)
    assert [v for _, v in report.samples] == [2.0, 3.0, 4.0]  # the latest
    assert report.waiting == (2.0, 1.0)  # the two latest arrivals (r3, r4); the oldest gave way


# ---- the reports the autoscaler keeps -----------------------------------------------------------------------
def test_reports_within_the_window_count_and_a_stale_replica_is_left_out_and_logged(caplog) -> None:
    reports = TtftReports(window_s=10.0, stale_s=3.0)
    assert reports.measured(now=0.0) is None  # no replica reported: no measurement
    reports.put(TtftReport("a", ((1.0, 0.2), (9.5, 5.0)), (0.4,)), now=100.0)
    reports.put(TtftReport("b", ((2.0, 0.3),), ()), now=101.0)
    got = reports.measured(now=101.0)
    # a's report is 1 s old: its 9.5 s-old sample is 10.5 s old now, out of the window; its waiting request counts
    # at its age as reported (it may have had its first token since)
    assert got == MeasuredTtft((0.2, 0.3), (0.4,), 2)
    with caplog.at_level(logging.WARNING, logger="cluster.first_token"):
        assert reports.measured(now=103.5) == MeasuredTtft((0.3,), (), 1)  # a's is 3.5 s old: left out
        assert caplog.messages == []  # a read (a status call) neither drops nor logs
        for now in (103.5, 103.6):  # two rounds
            reports.prune(now)
            assert reports.measured(now) == MeasuredTtft((0.3,), (), 1)
    assert [m for m in caplog.messages if "API replica a" in m and "left out" in m] != []
    assert len([m for m in caplog.messages if "API replica a" in m]) == 1  # logged once, not every round
    reports.put(TtftReport("a", ((0.0, 0.7),), ()), now=104.0)  # back with its next report
    assert reports.measured(now=104.0) == MeasuredTtft((0.3, 0.7), (), 2)


# ---- the signal reader and the policy -------------------------------------------------------------------------
def test_a_measured_ttft_over_target_steps_up_where_the_prediction_is_low() -> None:
    """One instance, 2 waiting on 4 slots: the prediction is STEP_S * 1.5 = 0.075 s, far below the 1 s target; the
    clients measured 8 s (the bench's figure: a queued request waits for a running one to finish)."""
    fleet = rows((2, 4))
    predicted = SignalReader(30.0, SLOTS).read(fleet, now=1.0)
    assert predicted.ttft_source == "predicted" and predicted.ttft_p99_s == pytest.approx(STEP_S * 1.5)
    assert ttft_policy().decide(predicted, now=1.0).action == "hold"

    measured = SignalReader(30.0, SLOTS).read(fleet, now=1.0, measured=MeasuredTtft((0.4, 8.0, 0.6), (), 1))
    assert measured.ttft_source == "measured" and measured.ttft_p99_s == 8.0
    d = ttft_policy().decide(measured, now=1.0)
    assert (d.action, d.cause) == ("up", "ttft"), d
    assert "ttft p99 8.000 s > target 1 s (measured)" in d.reason


def test_requests_waiting_for_their_first_token_count_at_their_age() -> None:
    """A queue building with no first token out yet: no sample, but a request waiting 3 s is a TTFT of 3 s at least."""
    fleet = rows((2, 4))
    signal = SignalReader(30.0, SLOTS).read(fleet, now=1.0, measured=MeasuredTtft((), (0.5, 3.0), 1))
    assert (signal.ttft_p99_s, signal.ttft_source) == (3.0, "measured")
    assert ttft_policy().decide(signal, now=1.0).action == "up"
    # the same through a replica's record and the autoscaler's reports
    record = FirstTokenRecord()
    record.begin("slow", arrival=10.0)
    reports = TtftReports(window_s=30.0, stale_s=5.0)
    reports.put(record.report("api-1", now=13.0), now=50.0)
    got = reports.measured(now=51.0)
    assert got is not None and got.values == (3.0,)  # its age as reported


def test_without_a_measurement_the_prediction_is_the_fallback() -> None:
    fleet = rows((2, 4))
    reader = SignalReader(30.0, SLOTS)
    for measured in (None, MeasuredTtft((), (), 2)):  # no replica reported; or they did, with nothing in the window
        s = reader.read(fleet, now=1.0, measured=measured)
        assert (s.ttft_p99_s, s.ttft_source) == (pytest.approx(STEP_S * 1.5), "predicted")
    idle = SignalReader(30.0, SLOTS).read(rows((0, 0)), now=1.0, measured=MeasuredTtft((), (), 1))
    assert (idle.ttft_p99_s, idle.ttft_source) == (None, None)  # nothing measured, nothing to predict from


# ---- the replica's push ---------------------------------------------------------------------------------------
def test_the_reporter_pushes_the_whole_record_and_a_push_past_its_deadline_is_logged_not_fatal(caplog) -> None:
    record = FirstTokenRecord()
    record.begin("a", arrival=0.0)
    reports = TtftReports(window_s=30.0, stale_s=5.0)
    hang = asyncio.Event()

    async def send(report: TtftReport) -> None:
        if not hang.is_set():
            reports.put(report, now=1.0)
            return
        await asyncio.Event().wait()  # the autoscaler never answers

    async def main() -> list[bool]:
        reporter = TtftReporter(record, "api-1", send, interval_s=0.01, clock=lambda: 1.0, timeout_s=0.05)
        ok = [await reporter.push()]
        hang.set()
        ok += [await reporter.push(), await reporter.push()]
        hang.clear()
        return ok + [await reporter.push()]

    with caplog.at_level(logging.WARNING, logger="deploy.serve.ttft_reporter"):
        assert asyncio.run(main()) == [True, False, False, True]
    assert reports.measured(now=1.0) == MeasuredTtft((), (1.0,), 1)
    failed = [m for m in caplog.messages if "failed (TimeoutError" in m]
    assert len(failed) == 1, caplog.messages  # logged once while it keeps failing
    assert any("reach the autoscaler again" in m for m in caplog.messages)


def test_specfleet_status_says_whether_the_ttft_p99_is_measured_or_predicted() -> None:
    from deploy.cli.admin_client import Autoscaling
    from deploy.cli.admin_cmd import _autoscaling_line

    base = dict(enabled=True, min_instances=1, max_instances=4, instances=2)
    measured = _autoscaling_line(Autoscaling(**base, ttft_p99_s=0.4123, ttft_source="measured", ttft_replicas=2))
    assert measured == "autoscaling: 2 instance(s) within 1-4; 0 step(s); ttft p99 0.412 s (measured from 2 API " \
                       "replica(s))", measured
    predicted = _autoscaling_line(Autoscaling(**base, ttft_p99_s=0.075, ttft_source="predicted"))
    assert predicted.endswith("; ttft p99 0.075 s (predicted)"), predicted
    assert "ttft" not in _autoscaling_line(Autoscaling(**base))  # no sample: no figure
