"""Measured time to first token: what each API replica records, reports, and what the autoscaler makes of it (pure).

The autoscaler's TTFT signal is the latency clients see, measured where they see it (the API replicas), as Ray Serve
LLM's TTFT autoscaling and Dynamo's SLA planner scale on observed TTFT rather than on a model of it. Each replica keeps
a bounded record: the first-token latencies of its recent requests, and the requests still waiting for their first
token with their arrival. A waiting request counts at its age so far (a lower bound on its TTFT): a queue that grows
with no first token out yet shows at once, not only when it drains.

    record = FirstTokenRecord()
    record.begin("cmpl-1", arrival=t0)             # routed: waiting for its first token from its arrival
    record.first("cmpl-1", ttft_s=0.4, now=t1)     # its first token: one sample
    report = record.report("replica-a", now=t2)    # what the replica sends the autoscaler every round
    reports = TtftReports(window_s=30, stale_s=5); reports.put(report, now=t3)
    reports.prune(now=t4)                          # each round: replicas gone quiet dropped (and logged, once)
    reports.measured(now=t4)                       # MeasuredTtft over the fresh reports, None if there is none
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

log = logging.getLogger(__name__)
MAX_SAMPLES = 1000  # per replica and report: the p99 of the latest 1,000 first tokens at most
MAX_WAITING = 10_000  # requests waiting for their first token one replica tracks (the oldest give way)


@dataclass(frozen=True)
class TtftReport:
    """One API replica's record as of when it was sent: each recent first token's (age, TTFT), and the age of each
    request still waiting for its first token (seconds; ages relative to the report, so no clock is shared)."""

    replica: str
    samples: tuple[tuple[float, float], ...]  # (seconds since the first token, time to first token)
    waiting: tuple[float, ...]  # seconds each waiting request has waited so far


@dataclass(frozen=True)
class MeasuredTtft:
    """The fleet's measured first-token latencies over the window: `samples` (first tokens out) and `waiting` (ages
    of requests without one yet), from `replicas` replicas that reported in time."""

    samples: tuple[float, ...]
    waiting: tuple[float, ...]
    replicas: int

    @property
    def values(self) -> tuple[float, ...]:
        """What the p99 is taken over: every sample and every waiting request's age so far."""
        return self.samples + self.waiting


class FirstTokenRecord:
    """One replica's recent first-token latencies (those of the last `keep_s`, `max_samples` at most) and its requests
    waiting for their first token (`max_waiting` at most, by arrival)."""

    def __init__(self, keep_s: float = 60.0, max_samples: int = MAX_SAMPLES, max_waiting: int = MAX_WAITING) -> None:
        self.keep_s = keep_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (when, ttft)
        self._waiting: OrderedDict[str, float] = OrderedDict()  # request -> arrival, oldest first
        self.max_waiting = max_waiting

    def begin(self, key: str, arrival: float) -> None:
        """`key` waits for its first token since `arrival` (the replica's monotonic clock)."""
        self._waiting[key] = arrival
        while len(self._waiting) > self.max_waiting:
            self._waiting.popitem(last=False)

    def first(self, key: str, ttft_s: float, now: float) -> None:
        """`key`'s first token came at `now`, `ttft_s` after its arrival: a sample, and it waits no more."""
        self._waiting.pop(key, None)
        self._samples.append((now, ttft_s))

    def end(self, key: str) -> None:
        """`key` ended (or failed to start) without a first token, or already had one: it waits no more."""
        self._waiting.pop(key, None)

    def report(self, replica: str, now: float) -> TtftReport:
        while self._samples and self._samples[0][0] < now - self.keep_s:
            self._samples.popleft()
        return TtftReport(replica, tuple((now - t, v) for t, v in self._samples),
                          tuple(now - a for a in self._waiting.values()))


class TtftReports:
    """The latest report of each API replica, as the autoscaler holds them. A replica whose latest report is older
    than `stale_s` (it stopped reporting: gone, or its calls time out) is left out of the measurement, and dropped
    (logged once) by the round's `prune`, until it reports again; a sample older than `window_s` is left out of the
    measurement. `measured` only reads, so a status read changes nothing."""

    def __init__(self, window_s: float, stale_s: float) -> None:
        self.window_s, self.stale_s = window_s, stale_s
        self._latest: dict[str, tuple[float, TtftReport]] = {}  # replica -> (received, report)

    def put(self, report: TtftReport, now: float) -> None:
        self._latest[report.replica] = (now, report)

    def prune(self, now: float) -> None:
        """Drop the replicas whose latest report is older than `stale_s`, with a warning each (once: one is back
        with its next report)."""
        for replica, (received, _) in list(self._latest.items()):
            if now - received > self.stale_s:
                log.warning("API replica %s sent no TTFT report for %.1f s (more than %g s): left out",
                            replica, now - received, self.stale_s)
                del self._latest[replica]

    def measured(self, now: float) -> MeasuredTtft | None:
        """The fresh reports' samples within the window (each aged by the report's own age) and their waiting
        requests' ages as reported (not aged further: one may have had its first token since, and its age so far is
        a lower bound on its TTFT only as of the report); None when no replica reported within `stale_s`."""
        fresh = [(now - received, report) for received, report in self._latest.values()
                 if now - received <= self.stale_s]
        if not fresh:
            return None
        samples = tuple(v for late, r in fresh for age, v in r.samples if age + late <= self.window_s)
        waiting = tuple(age for _, r in fresh for age in r.waiting)
        return MeasuredTtft(samples, waiting, len(fresh))
