"""SLO autoscaling policy: from the load the router sees, scale the fleet up, down, or hold (pure, no Ray).

The signals are the ones the systems we are compared with scale on: p99 time to first token (Ray Serve LLM's
`TTFTAutoscalingPolicy`, Dynamo's planner in SLA mode), p99 inter-token latency (Dynamo), and requests queued per
instance (llm-d's KEDA scaler, Ray Serve's `target_ongoing_requests`). A fleet scales up when any signal is above
its target, and down when every signal would stay below `scale_in_below` of its target on one instance fewer: the
band between the two is the hysteresis that keeps a load at a threshold from flapping. A condition must hold for
`up_after_s` (or `down_after_s`) before it acts, as Ray Serve's `upscale_delay_s` / `downscale_delay_s`; it takes
no step while one is still under way, and none within `cooldown_s` of the last. Bounds come first: below
`min_instances` it scales up at once, above `max_instances` down.

A step's size is proportional to the load, as Ray Serve's autoscaler sizes its replicas (desired = current x
metric / target): a queue over its target asks for the instances that hold the fleet's requests at `slots` running
and the target queued each, a latency over its target for n x p99 / target; a step down removes as many instances as
the fleet could lose with every signal still below `scale_in_below` of its target. `max_step` caps it (None: the
bounds alone): at 1,000 instances, simulated, a load step from 0.4 to 0.9 of capacity took 4 steps where one
instance a step had taken 25 and not caught up when the load fell (docs/benchmarks.md).

A step up is also **predictive**: a new instance serves only after its start (a Ray worker and a model load), so the
policy steps up when the queue, or the time to first token predicted from it, would be over its target one start
from now, projected from the trend of the fleet's waiting requests (cluster/load_trend.py: their growth rate at a lower
confidence bound, so a queue that only wanders projects flat) over the start time the router has learned
(cluster/start_times.py), as Dynamo's SLA planner scales on its load predictor's forecast for the next interval
rather than on the load now. With no start seen yet, or `predict` off, it is reactive alone.

Scaling in removes an instance by draining it through live migration (Llumnix, OSDI '24: its running requests move
to the others, its queue too), so the policy names which instance leaves: the one with the least to move.

With prefill/decode disaggregation (instances of role `prefill` or `decode`, cluster/disagg.py) the ratio of the two
follows the load, as Dynamo's planner sizes its prefill and decode pools apart: a step up adds a prefill instance when
time to first token is what is over its target (prefill's work), a decode instance when it is the inter-token
latency, and for a queue the role whose instances queue more each; a step down never removes the last instance of
a role. Without roles every instance is `both`, as before.

    policy = AutoscalePolicy(AutoscalingConfig(min_instances=1, max_instances=4), slots_per_instance=8)
    decision = policy.decide(FleetSignal(instances=(...), ttft_p99_s=0.4, itl_p99_s=0.05), now=12.0)
    decision.action, decision.reason  # "up", "ttft p99 0.400 s > target 0.250 s for 10.0 s"
"""

from __future__ import annotations

import collections
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.disagg import Role
from cluster.first_token import MeasuredTtft
from cluster.instances import InstanceRow
from cluster.load_trend import DemandTrend

# why the policy decided as it did, a label with few values (metrics): ttft, itl, queue (over a target), min_instances,
# max_instances (a bound), low_load (well below every target), and for a hold within_targets, cooldown or
# step_under_way; manual for a step an operator or a test asked for
Cause = Literal["ttft", "itl", "queue", "min_instances", "max_instances", "low_load", "within_targets", "cooldown",
                "step_under_way", "manual"]
# where the TTFT p99 came from: measured by the API replicas (cluster/first_token.py), or predicted from the queue
# (the fallback while no replica reports a measurement)
TtftSource = Literal["measured", "predicted"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AutoscaleTarget(_Frozen):
    """The service level the fleet sizes itself to; a target left out (null) is not scaled on."""

    ttft_p99_s: float | None = Field(default=None, gt=0.0)
    itl_p99_s: float | None = Field(default=None, gt=0.0)
    # requests waiting (admitted, not yet scheduled) per instance; Ray Serve's default target_ongoing_requests is 2
    queue_per_instance: float | None = Field(default=2.0, gt=0.0)

    @model_validator(mode="after")
    def _one_target(self) -> "AutoscaleTarget":
        if self.ttft_p99_s is None and self.itl_p99_s is None and self.queue_per_instance is None:
            raise ValueError("set at least one of ttft_p99_s, itl_p99_s, queue_per_instance")
        return self


class AutoscalingConfig(_Frozen):
    """`fleet.autoscaling` (docs/autoscaling.md): the fleet's bounds, its targets, and how long a condition must hold.

    Defaults follow Ray Serve's autoscaling (`upscale_delay_s` 30 s, `downscale_delay_s` 600 s, metrics looked at
    every few seconds). `window_s`: the latency samples a p99 is taken over; `drain_timeout_s`: how long scaling in
    may take to move an instance's requests away before it is given up (the instance is then put back in service,
    never stopped with a stream on it)."""

    min_instances: int = Field(default=1, ge=1)
    max_instances: int = Field(default=1, ge=1)
    target: AutoscaleTarget = AutoscaleTarget()
    up_after_s: float = Field(default=30.0, ge=0.0)
    down_after_s: float = Field(default=600.0, ge=0.0)
    cooldown_s: float = Field(default=30.0, ge=0.0)
    scale_in_below: float = Field(default=0.5, gt=0.0, lt=1.0)
    interval_s: float = Field(default=1.0, gt=0.0)
    window_s: float = Field(default=30.0, gt=0.0)
    drain_timeout_s: float = Field(default=300.0, gt=0.0)
    # the predictive step up: project the queue's trend over `trend_window_s` one learned start ahead, its growth taken
    # at its lower `trend_z`-sigma confidence bound (cluster/load_trend.py)
    predict: bool = True
    trend_window_s: float = Field(default=10.0, gt=0.0)
    trend_z: float = Field(default=2.0, ge=0.0)
    # instances one step adds or removes at most (None: as many as the load asks for, within the bounds)
    max_step: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances ({self.min_instances}) must not exceed max_instances "
                             f"({self.max_instances})")
        return self


@dataclass(frozen=True)
class InstanceSignal:
    """One instance as the autoscaler sees it: what it queues and runs, and whether the autoscaler may remove it."""

    instance_id: str
    waiting: int
    running: int
    draining: bool = False
    removable: bool = True  # started by the autoscaler (the deployed floor is Serve's, replaced when it fails)
    role: Role = "both"  # its disaggregation role (cluster/disagg.py)


@dataclass(frozen=True)
class FleetSignal:
    """The fleet's load at one moment: each registered healthy instance, the latency percentiles over the recent
    window (None: no sample, not scaled on), and scale steps under way (instances starting or draining)."""

    instances: tuple[InstanceSignal, ...]
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    starting: int = 0
    start_s: float | None = None  # how long a new instance takes to serve, as learned (None: no start seen yet)
    step_s: float | None = None  # the serving instances' mean engine step (seconds), to predict TTFT from a queue
    ttft_source: TtftSource | None = None  # where ttft_p99_s came from (None: not said, e.g. a test's plain data)

    @property
    def serving(self) -> list[InstanceSignal]:
        return [i for i in self.instances if not i.draining]

    @property
    def size(self) -> int:
        """Instances the fleet counts: serving ones and those starting (a draining one is already leaving)."""
        return len(self.serving) + self.starting

    @property
    def waiting(self) -> int:
        """Requests waiting (admitted, not yet scheduled) on the serving instances."""
        return sum(i.waiting for i in self.serving)

    @property
    def draining(self) -> int:
        return sum(i.draining for i in self.instances)

    @property
    def disaggregated(self) -> bool:
        """Whether any serving instance has a role other than `both` (then steps pick a role)."""
        return any(i.role != "both" for i in self.serving)

    def of_role(self, role: Role) -> list[InstanceSignal]:
        return [i for i in self.serving if i.role == role]


@dataclass(frozen=True)
class ScaleDecision:
    """What the policy decided, and why, in words an operator reads in `specfleet status` and the logs."""

    action: Literal["up", "down", "hold"]
    reason: str
    instances: int  # the fleet's size when decided
    remove: tuple[str, ...] = ()  # the instances to drain (action "down"), least to move first
    role: Role = "both"  # the role of the instances to start (action "up"; `both` without disaggregation)
    cause: Cause = "manual"  # the signal or bound behind it (the metrics' label)
    count: int = 1  # instances the step adds (up) or removes (down: len(remove))

    @property
    def desired(self) -> int:
        return self.instances + {"up": self.count, "down": -self.count, "hold": 0}[self.action]


class AutoscalePolicy:
    """Hysteresis over the signals, bounds, one step at a time, cooldown. `slots_per_instance`: requests one instance
    runs at once (engine.scheduler.max_batch_size), to project the queue on one instance fewer."""

    def __init__(self, cfg: AutoscalingConfig, slots_per_instance: int) -> None:
        if slots_per_instance < 1:
            raise ValueError(f"slots_per_instance must be at least 1, got {slots_per_instance}")
        self.cfg = cfg
        self.slots = slots_per_instance
        self._up_since: float | None = None  # when the scale-up condition began to hold without a break
        self._down_since: float | None = None
        self._last_step: float | None = None
        self.trend = DemandTrend(cfg.trend_window_s)

    def decide(self, signal: FleetSignal, now: float) -> ScaleDecision:
        """The decision at `now` (seconds, monotonic); "up" or "down" starts the cooldown: the caller acts on it."""
        cfg, n = self.cfg, signal.size
        if not signal.starting and not signal.draining:
            self.trend.add(now, signal.waiting)
        cause, over, need = self._over(signal)
        if not over:
            cause, over, need = self._projected(signal)
        fewer, under = self._fewer(signal)
        self._up_since = (self._up_since if self._up_since is not None else now) if over else None
        self._down_since = (self._down_since if self._down_since is not None else now) if under else None
        if signal.starting or signal.draining:
            return self._hold(n, f"a scale step is under way ({signal.starting} starting, {signal.draining} draining)",
                              "step_under_way")
        if n < cfg.min_instances:
            return self._up(signal, f"{n} instances < min_instances {cfg.min_instances}", now, "min_instances",
                            cfg.min_instances - n)
        if n > cfg.max_instances:
            return self._down(signal, f"{n} instances > max_instances {cfg.max_instances}", now, "max_instances",
                              n - cfg.max_instances)
        if self._last_step is not None and now - self._last_step < cfg.cooldown_s:
            return self._hold(n, f"cooling down ({now - self._last_step:.1f} s of {cfg.cooldown_s:g} s since the "
                                 "last step)", "cooldown")
        if over:
            if n >= cfg.max_instances:
                return self._hold(n, f"{over}, but at max_instances {cfg.max_instances}", "max_instances")
            held = now - self._up_since
            if held >= cfg.up_after_s:
                return self._up(signal, f"{over} for {held:.1f} s", now, cause,
                                self._capped(min(need, cfg.max_instances) - n))
            return self._hold(n, f"{over} for {held:.1f} s of {cfg.up_after_s:g} s", cause)
        if under:
            if n <= cfg.min_instances:
                return self._hold(n, f"at min_instances {cfg.min_instances}", "min_instances")
            held = now - self._down_since
            if held >= cfg.down_after_s:
                return self._down(signal, f"{under} for {held:.1f} s", now, "low_load",
                                  min(fewer, n - cfg.min_instances))
            return self._hold(n, f"{under} for {held:.1f} s of {cfg.down_after_s:g} s", "low_load")
        return self._hold(n, "within targets", "within_targets")

    def done(self, now: float) -> None:
        """The step decided last has been carried out (an instance started or stopped, or the step failed): the
        cooldown and the conditions' clocks start from here, not from the decision (a start may take minutes)."""
        self._last_step, self._up_since, self._down_since = now, None, None
        self.trend.clear()  # the queue's growth on the old fleet says little about the new one

    # ---- the conditions ---------------------------------------------------------------------------------------
    def _over(self, s: FleetSignal) -> tuple[Cause, str, int]:
        """The signal above its target now (ttft, itl or queue), why in words, and the instances it asks for;
        ("manual", "", 0) if none is."""
        t, serving = self.cfg.target, s.serving
        n = len(serving)
        if t.ttft_p99_s is not None and s.ttft_p99_s is not None and s.ttft_p99_s > t.ttft_p99_s:
            source = f" ({s.ttft_source})" if s.ttft_source else ""
            return ("ttft", f"ttft p99 {s.ttft_p99_s:.3f} s > target {t.ttft_p99_s:g} s{source}",
                    _proportional(n, s.ttft_p99_s / t.ttft_p99_s))
        if t.itl_p99_s is not None and s.itl_p99_s is not None and s.itl_p99_s > t.itl_p99_s:
            return ("itl", f"itl p99 {s.itl_p99_s:.3f} s > target {t.itl_p99_s:g} s",
                    _proportional(n, s.itl_p99_s / t.itl_p99_s))
        if t.queue_per_instance is not None and serving:
            queue = sum(i.waiting for i in serving) / n
            if queue > t.queue_per_instance:
                return ("queue", f"queue {queue:.2f}/instance > target {t.queue_per_instance:g}",
                        self._holding(sum(i.waiting + i.running for i in serving)))
        return "manual", "", 0

    def _projected(self, s: FleetSignal) -> tuple[Cause, str, int]:
        """The signal that would be over its target one learned start from now, projected from the queue's trend at
        its lower confidence bound, why in words, and the instances it asks for; ("manual", "", 0) if none would (or
        nothing to project with)."""
        cfg, t, serving = self.cfg, self.cfg.target, s.serving
        trend = self.trend.trend() if cfg.predict and s.start_s is not None and serving else None
        rise = trend.lower(cfg.trend_z) if trend is not None else 0.0
        if trend is None or rise * s.start_s < 1.0:  # less than one more request by then: nothing to act on
            return "manual", "", 0
        queue = (s.waiting + rise * s.start_s) / len(serving)  # balanced over the serving instances (the queue policy)
        why = f"in {s.start_s:.1f} s (the learned start; {s.waiting} waiting, rising {rise:.2f}/s)"
        if t.ttft_p99_s is not None and s.step_s is not None:
            ttft = s.step_s * (1.0 + queue / self.slots)  # as SignalReader predicts TTFT from a queue
            if ttft > t.ttft_p99_s:
                return ("ttft", f"ttft projected {ttft:.3f} s > target {t.ttft_p99_s:g} s {why}",
                        _proportional(len(serving), ttft / t.ttft_p99_s))
        if t.queue_per_instance is not None and queue > t.queue_per_instance:
            demand = sum(i.waiting + i.running for i in serving) + rise * s.start_s
            return ("queue", f"queue projected {queue:.2f}/instance > target {t.queue_per_instance:g} {why}",
                    self._holding(demand))
        return "manual", "", 0

    def _holding(self, demand: float) -> int:
        """Instances that hold `demand` requests with `slots` running and the queue target waiting on each."""
        return math.ceil(demand / (self.slots + self.cfg.target.queue_per_instance))

    def _capped(self, count: int) -> int:
        """A step of `count` instances, at least one, at most `max_step`."""
        return max(1, min(count, self.cfg.max_step or count))

    def _fewer(self, s: FleetSignal) -> tuple[int, str]:
        """How many instances fewer (up to `max_step`) would still leave every signal well within its target, and
        why in words; (0, "") if not even one fewer would. On k fewer of n, each latency is scaled by n/(n-k) and
        the queue is what the fleet's requests would queue on n-k instances of `slots` each."""
        serving = s.serving
        n = len(serving)
        demand = sum(i.waiting + i.running for i in serving)
        best: tuple[int, str] = (0, "")
        for k in range(1, min(n - 1, self.cfg.max_step or n) + 1):
            why = self._within(s, n - k, n / (n - k), demand)
            if not why:
                break
            best = (k, why)
        return best

    def _within(self, s: FleetSignal, left: int, grow: float, demand: int) -> str:
        """Why `left` instances, each latency grown by `grow`, would be well within every target ("" if not)."""
        t, b = self.cfg.target, self.cfg.scale_in_below
        parts = []
        for name, value, target in (("ttft", s.ttft_p99_s, t.ttft_p99_s), ("itl", s.itl_p99_s, t.itl_p99_s)):
            if target is None:
                continue
            if value is not None and value * grow >= b * target:
                return ""
            parts.append(f"{name} p99 {0.0 if value is None else value:.3f} s")
        if t.queue_per_instance is not None:
            queue = max(0, demand - left * self.slots) / left
            if queue >= b * t.queue_per_instance:
                return ""
            parts.append(f"queue on {left} instances {queue:.2f}/instance")
        return ", ".join(parts) + f" below {b:g} x target"

    # ---- decisions ----------------------------------------------------------------------------------------------
    def _up(self, s: FleetSignal, reason: str, now: float, cause: Cause, count: int) -> ScaleDecision:
        role = role_to_add(s, cause)
        what = f"{count} {'' if role == 'both' else role + ' '}instance{'s' if count > 1 else ''}"
        return self._step("up", s.size, f"{reason}: adds {what}", now, cause, role=role, count=count)

    def _down(self, s: FleetSignal, reason: str, now: float, cause: Cause, count: int) -> ScaleDecision:
        leave: list[str] = []
        roles = collections.Counter(i.role for i in s.serving)
        for i in sorted((i for i in s.serving if i.removable), key=lambda i: (i.waiting + i.running, i.instance_id)):
            if len(leave) == count:
                break
            # never the last instance of a role: its half of every request would have nowhere to run
            if s.disaggregated and i.role != "both" and roles[i.role] <= 1:
                continue
            roles[i.role] -= 1
            leave.append(i.instance_id)  # the least to move first
        if not leave:
            return self._hold(s.size, f"{reason}, but no instance the autoscaler started is left to remove", cause)
        named = ", ".join(leave[:3]) + (f" and {len(leave) - 3} more" if len(leave) > 3 else "")
        return self._step("down", s.size, f"{reason}: removes {named}", now, cause, tuple(leave),
                          count=len(leave))

    def _step(self, action: Literal["up", "down"], n: int, reason: str, now: float, cause: Cause,
              remove: tuple[str, ...] = (), role: Role = "both", count: int = 1) -> ScaleDecision:
        self._last_step, self._up_since, self._down_since = now, None, None
        self.trend.clear()
        return ScaleDecision(action, reason, n, remove, role, cause, count)

    @staticmethod
    def _hold(n: int, reason: str, cause: Cause) -> ScaleDecision:
        return ScaleDecision("hold", reason, n, cause=cause)


def _proportional(n: int, ratio: float) -> int:
    """Instances for a latency `ratio` x its target on `n` (Ray Serve's desired = current x metric / target)."""
    return math.ceil(n * ratio - 1e-9)


def role_to_add(s: FleetSignal, cause: Cause) -> Role:
    """The role of the instance a step up for `cause` (ttft, itl, queue, min_instances) starts: `both` without
    disaggregation; else `prefill` when time to first token is over its target, `decode` for the inter-token latency,
    for a queue the role whose instances queue more requests each, and below the bounds the role with fewer instances
    (decode on a tie)."""
    if not s.disaggregated:
        return "both"
    if cause in ("ttft", "itl"):
        return "prefill" if cause == "ttft" else "decode"
    prefill, decode = s.of_role("prefill"), s.of_role("decode")
    if cause == "queue":
        def per_instance(group: list[InstanceSignal]) -> float:
            return sum(i.waiting for i in group) / len(group) if group else math.inf
        return "prefill" if per_instance(prefill) > per_instance(decode) else "decode"
    return "prefill" if len(prefill) < len(decode) else "decode"


class LatencyWindow:
    """Latency samples of the last `window_s` seconds and their p99 (nearest rank), O(1) amortised per sample."""

    def __init__(self, window_s: float, max_samples: int = 100_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time, seconds)

    def add(self, now: float, values: Iterable[float]) -> None:
        self._samples.extend((now, v) for v in values)
        self._expire(now)

    def p99(self, now: float) -> float | None:
        self._expire(now)
        return percentile([v for _, v in self._samples], 0.99)

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values`, None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---- what the autoscaler reads and reports -----------------------------------------------------------------------
AUTOSCALED_PREFIX = "auto-"  # the ids of instances the autoscaler starts (and alone may remove)


class SignalReader:
    """Turns the router's instance rows (polled every `interval_s`) and the API replicas' measured first tokens into
    FleetSignals, keeping the latency windows.

    The router is off the token path, so it measures no request's latency; it sees each instance's engine step.
    Every running request gets one token-bearing delta per step, so an instance's last step time is the inter-token
    gap its running requests see (one sample per instance and poll). Time to first token is measured by the API
    replicas (cluster/first_token.py: each first token's latency, and each request still waiting for one at its age so
    far), as Ray Serve LLM's and Dynamo's TTFT scaling read it; its p99 is taken over those when there are any. Only
    without a measurement is it predicted from the queue, as llm-d scales on predicted latency: a request queued
    behind `waiting` others at an instance whose steps take `step_time_ema_s` waits about (1 + waiting / slots) steps
    of prefill and admission (an underestimate under a queue: a queued request waits for a running one to finish,
    many steps). Both feed `window_s` windows whose p99 the policy compares with its targets."""

    def __init__(self, window_s: float, slots_per_instance: int) -> None:
        self.ttft = LatencyWindow(window_s)
        self.itl = LatencyWindow(window_s)
        self.slots = slots_per_instance

    def read(self, rows: Sequence[InstanceRow], now: float, starting: int = 0,
             start_s: float | None = None, measured: MeasuredTtft | None = None) -> FleetSignal:
        """The fleet's signal at `now`; `start_s`: how long a new instance takes to serve, as the router learned it
        (cluster/start_times.py), for the policy's predictive step up; `measured`: the API replicas' first tokens
        over the window (cluster/first_token.py), None when none reports."""
        instances, steps = [], []
        for r in rows:
            if not r.healthy:
                continue
            running = r.stats.load.running if r.stats is not None else 0
            waiting = max(r.stats.load.waiting if r.stats is not None else 0, r.in_flight - running, 0)
            instances.append(InstanceSignal(r.instance_id, waiting, running, r.draining,
                                            r.instance_id.startswith(AUTOSCALED_PREFIX), r.role))
            if r.stats is not None and not r.draining:
                step = r.stats.step.step_time_ema_s
                steps.append(step)
                if running:
                    self.itl.add(now, [r.stats.step.step_time_s])
                if running or waiting:
                    self.ttft.add(now, [step * (1.0 + waiting / self.slots)])
        ttft, source = self.ttft_p99(now, measured)
        return FleetSignal(tuple(instances), ttft, self.itl.p99(now), starting, start_s,
                           sum(steps) / len(steps) if steps else None, source)

    def ttft_p99(self, now: float, measured: MeasuredTtft | None) -> tuple[float | None, TtftSource | None]:
        """The TTFT p99 the policy compares with its target, and where it came from: the measured first tokens and
        waiting requests when there are any, else the prediction's window (None: neither has a sample)."""
        if measured is not None and measured.values:
            return percentile(measured.values, 0.99), "measured"
        predicted = self.ttft.p99(now)
        return predicted, None if predicted is None else "predicted"


@dataclass(frozen=True)
class ScaleEvent:
    """One scale step as it ended: `outcome` "done", or "failed" / "cancelled" with why (a drain that could not move
    every request puts the instance back in service: no stream is ever cut)."""

    at: float  # wall clock, when it was decided
    action: Literal["up", "down"]
    instance_id: str
    reason: str
    outcome: Literal["done", "failed", "cancelled"]
    detail: str = ""
    duration_s: float = 0.0
    migrated: int = 0  # requests moved off the leaving instance (scale-in)
    cause: Cause = "manual"  # the decision's (ScaleDecision.cause): the metrics' label


@dataclass(frozen=True)
class AutoscaleStatus:
    """What `/admin/autoscaler`, `/metrics` and `specfleet status` show: the bounds, the last decision, the recent
    steps (newest last) and the count of steps by (action, outcome) since the autoscaler started."""

    min_instances: int
    max_instances: int
    instances: int
    last: ScaleDecision | None
    events: tuple[ScaleEvent, ...]
    counts: tuple[tuple[str, str, str, int], ...]  # (action, outcome, cause, steps)
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    failed_rounds: int = 0  # rounds that raised since the autoscaler started (the loop goes on with the next)
    last_failure: str = ""  # the last one's error, "ExceptionType: message"
    ttft_source: TtftSource | None = None  # measured (by the API replicas) or predicted (from the queue)
    ttft_replicas: int = 0  # API replicas whose TTFT reports are fresh (measured from them)

