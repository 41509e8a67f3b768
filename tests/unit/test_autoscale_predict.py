"""The predictive step up on plain data: a queue growing below its target steps the fleet up one learned start ahead,
a steady load's jitter does not, a rise the fleet can serve (its slots filling) does not, and with no start learned the policy is reactive alone (cluster/autoscale.py,
cluster/load_trend.py, cluster/start_times.py)."""

from __future__ import annotations

import random

import pytest

from cluster.autoscale import AutoscalePolicy, AutoscaleTarget, AutoscalingConfig, FleetSignal, InstanceSignal
from cluster.load_trend import DemandTrend
from cluster.start_times import StartHistory

SLOTS = 4


def cfg(**kw) -> AutoscalingConfig:
    base = dict(min_instances=1, max_instances=4, up_after_s=2.0, down_after_s=20.0, cooldown_s=5.0,
                target=AutoscaleTarget(queue_per_instance=2.0))
    return AutoscalingConfig(**{**base, **kw})


def spread(demand: int, n: int, start_s: float | None, step_s: float | None = None) -> FleetSignal:
    """`demand` requests over `n` instances of SLOTS slots, balanced: each runs up to SLOTS, the rest wait."""
    per = [demand // n + (i < demand % n) for i in range(n)]
    return FleetSignal(tuple(InstanceSignal(f"i{i}", max(0, d - SLOTS), min(d, SLOTS)) for i, d in enumerate(per)),
                       None, None, 0, start_s, step_s)


def queued(waiting: int, n: int, start_s: float | None, step_s: float | None = None) -> FleetSignal:
    """`n` instances running SLOTS requests each, `waiting` more queued over them, balanced."""
    return spread(waiting + n * SLOTS, n, start_s, step_s)


def first_up(policy: AutoscalePolicy, queues: list[int], n: int, start_s: float | None,
             step_s: float | None = None) -> tuple[float, str, str] | None:
    """(time, cause, reason) of the first step up over one-second ticks of the fleet's `queues`, None if none."""
    for t, waiting in enumerate(queues):
        d = policy.decide(queued(waiting, n, start_s, step_s), float(t))
        if d.action == "up":
            return float(t), d.cause, d.reason
    return None


def test_a_queue_growing_below_target_steps_up_one_learned_start_ahead() -> None:
    """Two busy instances, queue target 4 each: over it once 9 requests wait. The queue climbs one request a second
    from 0; an instance takes 10 s to start. Reactive, the fleet steps up at 9 s + up_after_s; predictive, once the
    queue one start ahead would be over the target (3 waiting at 3 s, 13 projected), held up_after_s: the new
    instance serves about when the queue would have crossed the target, not 10 s after."""
    c = cfg(target=AutoscaleTarget(queue_per_instance=4.0))
    climb = list(range(30))
    up = first_up(AutoscalePolicy(c, SLOTS), climb, n=2, start_s=10.0)
    assert up is not None
    t, cause, reason = up
    assert t == 5.0 and cause == "queue", up
    assert "queue projected 7.50/instance" in reason and "in 10.0 s (the learned start; 5 waiting, rising 1.00/s" \
        in reason, reason
    reactive = first_up(AutoscalePolicy(c, SLOTS), climb, n=2, start_s=None)  # no start seen yet
    assert reactive is not None and reactive[0] == 11.0 and "projected" not in reactive[2], reactive
    off = first_up(AutoscalePolicy(c.model_copy(update={"predict": False}), SLOTS), climb, n=2, start_s=10.0)
    assert off == reactive  # `predict: false`: reactive alone, as before
    # a start of one tick projects one request ahead: the step comes later than with 10 s, still before reactive
    quick = first_up(AutoscalePolicy(c, SLOTS), climb, n=2, start_s=1.0)
    assert quick is not None and t < quick[0] < reactive[0], quick


def test_a_rise_the_fleet_can_serve_fills_its_slots_and_takes_no_step() -> None:
    """The requests in the fleet climb from 1 to 7 on 2 instances of 4 slots (a new, higher rate it can serve), then
    stay: none waits, so nothing is projected, though a line through the requests in the fleet would climb."""
    p = AutoscalePolicy(cfg(up_after_s=0.0), SLOTS)
    for t, demand in enumerate([1, 2, 3, 4, 5, 6, 7] + [7] * 20):
        d = p.decide(spread(demand, 2, start_s=10.0), float(t))
        assert d.action != "up", (t, d.reason)


def test_a_time_to_first_token_projected_over_its_target_steps_up() -> None:
    """Only a TTFT target (1 s) and no sample of it yet: the queue projected one start ahead predicts it (as the
    signal reader does: a step of 0.5 s times 1 + waiting / slots) over the target, and a prefill-free fleet adds
    an instance for `ttft`."""
    c = cfg(target=AutoscaleTarget(ttft_p99_s=1.0, queue_per_instance=None))
    up = first_up(AutoscalePolicy(c, SLOTS), [2 * t for t in range(20)], n=1, start_s=10.0, step_s=0.5)
    assert up is not None and up[1] == "ttft" and "ttft projected 4.250 s" in up[2] and up[0] == 5.0, up
    assert first_up(AutoscalePolicy(c, SLOTS), [2 * t for t in range(20)], n=1, start_s=10.0, step_s=None) is None


def test_after_a_step_the_old_fleets_climb_is_forgotten_and_a_flat_load_projects_flat() -> None:
    c = cfg(trend_window_s=5.0, up_after_s=0.0)
    p = AutoscalePolicy(c, SLOTS)
    assert first_up(p, list(range(10)), n=2, start_s=10.0)[0] == 3.0  # 3 waiting now, 13 projected
    p.done(6.0)  # the step carried out: the growth measured on the old fleet is forgotten
    assert p.trend.trend() is None
    for t in range(7, 30):
        d = p.decide(queued(6, 3, 10.0), float(t))  # 2 waiting on each: at the target, not over it
        assert d.action != "up", (t, d.reason)


def queue_run(policy: AutoscalePolicy, rate: float, seed: int, start_s: float | None, seconds: float = 300.0,
              duration_s: float = 2.0, tick_s: float = 0.5) -> list[str]:
    """A fleet of one instance fed Poisson arrivals at `rate` (requests/s), each request running about
    `duration_s` on one of SLOTS slots, the rest queued: the decisions' actions other than hold. The queue's
    length wanders as a queue fed at random does, which is what a projection must not read as a climb."""
    rng = random.Random(seed)
    t, waiting, running, steps = 0.0, 0, [], []
    arrival = rng.expovariate(rate)
    while t < seconds:
        t += tick_s
        while arrival < t:
            waiting, arrival = waiting + 1, arrival + rng.expovariate(rate)
        running = [end for end in running if end > t]
        while waiting and len(running) < SLOTS:
            waiting -= 1
            running.append(t + duration_s * rng.uniform(0.8, 1.2))
        d = policy.decide(FleetSignal((InstanceSignal("i0", waiting, len(running)),), None, None, 0, start_s), t)
        if d.action != "hold":
            steps.append(d.action)
            policy.done(t)
    return steps


STEADY = cfg(max_instances=2, target=AutoscaleTarget(queue_per_instance=6.0), up_after_s=1.0, interval_s=0.5)


@pytest.mark.parametrize("rate", [0.5, 1.2])
@pytest.mark.parametrize("seed", range(20))
def test_a_steady_load_takes_no_step_from_its_jitter_that_reactive_would_not(rate: float, seed: int) -> None:
    """0.5 and 1.2 requests/s on one instance that serves about 2 a second, queue target 6: the queue wanders (at 1.2
    it crosses 6 now and then, and the reactive policy steps up for it on a few seeds). With a learned start of
    6 s the projection at its lower confidence bound reads none of the wandering as a climb: every seed steps
    exactly as the reactive policy does."""
    predictive = queue_run(AutoscalePolicy(STEADY, SLOTS), rate, seed, start_s=6.0)
    assert predictive == queue_run(AutoscalePolicy(STEADY, SLOTS), rate, seed, start_s=None)
    if rate == 0.5:
        assert predictive == []


def test_without_its_confidence_bound_the_projection_would_step_up_on_jitter() -> None:
    """The same 1.2 requests/s with z = 0 (the growth rate itself): more seeds step up than reactive ones do, so
    the test above can fail."""
    naive = STEADY.model_copy(update={"trend_z": 0.0})
    steps = sum(bool(queue_run(AutoscalePolicy(naive, SLOTS), 1.2, seed, start_s=6.0)) for seed in range(20))
    reactive = sum(bool(queue_run(AutoscalePolicy(STEADY, SLOTS), 1.2, seed, start_s=None)) for seed in range(20))
    assert steps > reactive + 5, (steps, reactive)


@pytest.mark.parametrize("seed", range(10))
def test_a_load_jittering_at_the_target_does_not_flap_with_prediction_on(seed: int) -> None:
    """A demand at the queue target on 4 instances (2 waiting each), jittering by a request or two each tick, with a
    learned start: at most one step, up, never back down (at the target it is never "well below" it)."""
    rng = random.Random(seed)
    c = cfg(min_instances=1, max_instances=10, up_after_s=2.0, down_after_s=4.0, cooldown_s=2.0)
    p, n, steps = AutoscalePolicy(c, SLOTS), 4, []
    for tick in range(1000):
        demand = 4 * (2 + SLOTS) + rng.randint(-2, 2)
        d = p.decide(spread(demand, n, start_s=8.0), tick * 0.5)
        if d.action != "hold":
            steps.append(d.action)
            n = d.desired
            p.done(tick * 0.5)
    assert steps in ([], ["up"]), steps


# ---- the trend and the learned start ------------------------------------------------------------------------
def test_the_trend_is_the_growth_rate_with_a_random_walks_error() -> None:
    tr = DemandTrend(window_s=4.0)
    for t in range(3):
        tr.add(float(t), 1.0)
    assert tr.trend() is None  # fewer than 4 samples
    tr.add(3.0, 1.0)
    assert (tr.trend().slope, tr.trend().stderr) == (0.0, 0.0)
    for t, y in zip(range(4, 9), (2, 3, 4, 5, 6)):
        tr.add(float(t), float(y))
    got = tr.trend()  # the window holds t = 4..8: a straight climb of 1/s
    assert (got.slope, got.stderr, got.samples) == (1.0, 0.0, 5) and got.lower(2.0) == 1.0
    wander = DemandTrend(window_s=100.0)
    for t, y in enumerate((3, 5, 2, 6, 3, 7, 4, 8)):  # up 5 over 7 s, but by jumps of 2 to 4 either way
        wander.add(float(t), float(y))
    w = wander.trend()
    assert w.slope == pytest.approx(5 / 7) and w.lower(2.0) == 0.0  # not told from noise: projects flat


def test_the_expected_start_is_the_median_of_the_starts_without_the_replacements() -> None:
    h = StartHistory(floor_s=5.0, ceiling_s=300.0, window=3)
    assert h.wait().expected_start_s is None
    h.registered("i0", "a", now=0.0, start_s=6.0)
    h.lost("i0", now=10.0)
    h.registered("i0", "b", now=100.0, start_s=8.0)  # replaced 90 s after the loss: the failover wait's, not ours
    assert h.wait().slowest_s == 90.0 and h.wait().expected_start_s == 7.0
    for n, s in enumerate((20.0, 7.0, 7.5)):  # the window keeps the last 3 starts
        h.registered(f"j{n}", "x", now=200.0, start_s=s)
    assert h.wait().expected_start_s == 7.5
