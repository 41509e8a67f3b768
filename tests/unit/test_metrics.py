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
