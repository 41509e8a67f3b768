"""What the unauthenticated /metrics view (deploy/serve/metrics.py) publishes, and what it keeps to `/admin`."""

from __future__ import annotations

from cluster.instances import InstanceRow
from cluster.stats import EngineStats
from deploy.serve.metrics import Metrics


def _stats(**kw) -> EngineStats:
    base = dict(running=1, waiting=0, kv_blocks_used=3, kv_blocks_free=5, draft_kv_blocks_used=0,
                draft_kv_blocks_free=0, num_steps=4, step_time_s=0.01, step_time_ema_s=0.01, batch_size=1,
                batch_tokens=1, prefill_tokens=0, mean_k=0.0, acceptance=0.0, tokens_emitted=9, num_preemptions=0,
                policy="off")
    return EngineStats.from_dict({**base, **kw})  # the flat form the admin API sends


def test_no_per_instance_prefix_cache_figure_is_published() -> None:
    """A tenant that could read an instance's prefix hits before and after a guessed prompt would learn what was
    cached: the hits, queries and cached blocks per instance stay behind the admin key (`/admin/instances`,
    `specfleet status`); load figures stay on /metrics."""
    m = Metrics("tiny")
    m.set_instances([InstanceRow(instance_id="i0", model="tiny", node="n", healthy=True, in_flight=1,
                                 stats=_stats(prefix_cache_queries=40, prefix_cache_hits=36, kv_blocks_cached=9))])
    text = m.render().decode()
    assert 'specfleet:num_requests_running{instance="i0",model_name="tiny"} 1.0' in text
    for name in ("prefix_cache_hits", "prefix_cache_queries", "kv_cache_cached_blocks"):
        assert name not in text, name


def test_failures_are_counted_by_outcome_and_clients_get_no_internal_detail() -> None:
    from deploy.serve.frontend import public_error

    m = Metrics("tiny")
    for outcome in ("partial_failure", "stream_error", "client_stopped_reading", "stream_error"):
        m.failed(outcome)
    text = m.render().decode()
    assert 'specfleet:request_failures_total{model_name="tiny",outcome="stream_error"} 2.0' in text
    assert 'specfleet:request_failures_total{model_name="tiny",outcome="client_stopped_reading"} 1.0' in text
    message = public_error("cmpl-1")
    assert "cmpl-1" in message and "log" in message


def test_scale_events_are_published_with_their_cause_and_the_last_decision_with_its_reason() -> None:
    from cluster.autoscale import AutoscaleStatus, ScaleDecision, ScaleEvent

    m = Metrics("tiny")
    assert "autoscaling" not in m.render().decode()  # a fixed fleet: nothing
    up = ScaleEvent(1.0, "up", "auto-0", "queue 3.00/instance > target 2 for 30.0 s", "done", duration_s=4.0,
                    cause="queue")
    down = ScaleEvent(9.0, "down", "auto-0", "queue on 1 instances 0.00/instance below 0.5 x target for 600.0 s",
                      "done", duration_s=2.5, migrated=3, cause="low_load")
    m.autoscale_figures = AutoscaleStatus(1, 4, 2, ScaleDecision("hold", "within targets", 2, cause="within_targets"), (up, down),
                                          (("down", "done", "low_load", 1), ("up", "done", "queue", 1)),
                                          ttft_p99_s=0.25, itl_p99_s=None, ttft_source="measured", ttft_replicas=2)
    text = m.render().decode()
    assert 'specfleet:autoscaling_scale_events_total{action="up",cause="queue",outcome="done"} 1.0' in text
    assert 'specfleet:autoscaling_scale_events_total{action="down",cause="low_load",outcome="done"} 1.0' in text
    for line in ("specfleet:autoscaling_min_instances 1.0", "specfleet:autoscaling_max_instances 4.0",
                 "specfleet:autoscaling_current_instances 2.0", "specfleet:autoscaling_desired_instances 2.0",
                 "specfleet:autoscaling_ttft_p99_seconds 0.25",
                 'specfleet:autoscaling_last_decision_info{action="hold",cause="within_targets",reason="within targets"} 1.0'):
        assert line in text, line
    assert "autoscaling_itl_p99_seconds" not in text  # no sample: no figure
    assert 'specfleet:autoscaling_ttft_source_info{source="measured"} 1.0' in text  # measured, not predicted
