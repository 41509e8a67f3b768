"""Prometheus metrics of the API, named as vLLM names them with a `specfleet:` prefix.

Latencies are observed where requests pass (the API replica): time to first token, inter-token latency (the
gap between consecutive token-bearing deltas: one engine step, which may carry several accepted tokens),
end-to-end latency, and queue time (submission to first scheduling, as the engine reports it). Gauges of
load come from the router's latest stats of each instance when /metrics is scraped, beside the router's own
request table (its pending count and each instance's requests in flight), so a divergence between what the
router counts and what the instances run shows. Migration and failover counts are the router's own
(cluster-wide, since the router started), exposed as counters and a downtime histogram; so are the rounds of its
background loops (migration planning, handoffs, health polling) and of the autoscaler that raised, each loop going on
with its next round: `specfleet:router_failed_rounds_total{loop}` and `specfleet:autoscaling_failed_rounds_total`
rising is a defect or a dependency down, worth an alert (`increase(...[10m]) > 0`).

/metrics needs no key (Prometheus scrapes it without one), so it publishes no per-instance prefix cache figure
(queries, hits, cached blocks): a tenant reading an instance's hits before and after a guessed prompt would learn
what the cache held. Those figures are behind the admin key: `/admin/instances` and `specfleet status`
(docs/security.md).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.autoscale import AutoscaleStatus
from cluster.first_token import FirstTokenRecord
from cluster.instances import InstanceRow
from cluster.request import SpecStats, StreamItem
from cluster.stats import DOWNTIME_BUCKETS, ROUTER_LOOPS, MigrationStats, RoutingStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """One registry per API replica."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model = model
        self.ttft = Histogram("specfleet:time_to_first_token_seconds", "Time to first token", m, registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("specfleet:inter_token_latency_seconds", "Time between token-bearing deltas", m,
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("specfleet:e2e_request_latency_seconds", "End-to-end request latency", m, registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queue = Histogram("specfleet:request_queue_time_seconds", "Time waiting before first scheduled", m,
                               registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("specfleet:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("specfleet:generation_tokens", "Tokens generated", m, registry=r)
        self.success = Counter("specfleet:request_success", "Finished requests", m + ["finished_reason"], registry=r)
        self.drafts = Counter("specfleet:spec_decode_num_drafts", "Verification rounds with drafts", m, registry=r)
        self.draft_tokens = Counter("specfleet:spec_decode_num_draft_tokens", "Draft tokens proposed", m, registry=r)
        self.accepted_tokens = Counter("specfleet:spec_decode_num_accepted_tokens", "Draft tokens accepted", m,
                                       registry=r)
        self.accepted_per_pos = Counter("specfleet:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", m + ["position"], registry=r)
        inst = ["model_name", "instance"]
        self.running = Gauge("specfleet:num_requests_running", "Requests running", inst, registry=r)
        self.waiting = Gauge("specfleet:num_requests_waiting", "Requests waiting", inst, registry=r)
        self.kv_usage = Gauge("specfleet:kv_cache_usage_perc", "Target KV cache usage (1 = full)", inst, registry=r)
        self.preemptions = Gauge("specfleet:num_preemptions", "Preemptions since the instance started", inst,
                                 registry=r)
        self.router_in_flight = Gauge("specfleet:router_requests_in_flight",
                                      "Requests the router counts as routed to the instance and not ended", inst,
                                      registry=r)
        self.router_pending = Gauge("specfleet:router_requests_pending",
                                    "Requests the router counts as pending over all instances (the 429 limit's count)",
                                    m, registry=r)
        self.draft_s_per_token = Gauge("specfleet:spec_decode_draft_seconds_per_token",
                                       "Draft-stage seconds per drafted token since the instance started", inst,
                                       registry=r)
        self.calibration_tokens = Gauge("specfleet:spec_decode_calibration_tokens",
                                        "Tokens EasySpec bonus calibration re-ran in true layer order", inst, registry=r)
        self.calibration_s = Gauge("specfleet:spec_decode_calibration_seconds",
                                   "Seconds of the calibrating draft forwards (each round's first)", inst, registry=r)
        self.moe_local_rate = Gauge("specfleet:moe_local_activation_rate",
                                    "Share of (token, expert) pairs served on the token's own expert-parallel rank",
                                    inst, registry=r)
        self.moe_bytes = Gauge("specfleet:moe_alltoall_bytes_per_token",
                               "Expert all-to-all bytes per token (over every MoE layer) since the instance started",
                               inst, registry=r)
        self.moe_s = Gauge("specfleet:moe_layer_seconds_per_token",
                           "MoE-layer seconds per token (over every MoE layer, all-to-all included)", inst, registry=r)
        self.healthy_instances = Gauge("specfleet:healthy_instances", "Instances the router dispatches to", m,
                                       registry=r)
        # prefill/decode disaggregation (docs/disaggregation.md): each instance's role as an info gauge (1), and the
        # running and waiting requests summed per role
        self.instance_role = Gauge("specfleet:instance_role", "An instance's role (prefill, decode or both): 1",
                                   inst + ["role"], registry=r)
        self.role_running = Gauge("specfleet:num_requests_running_by_role", "Requests running, per instance role",
                                  m + ["role"], registry=r)
        self.role_waiting = Gauge("specfleet:num_requests_waiting_by_role", "Requests waiting, per instance role",
                                  m + ["role"], registry=r)
        # requests that did not end as asked, by outcome: `failure` (a non-streamed request that failed: a 503),
        # `partial_failure` (one some of whose choices failed: a 503 too, not a 200 with holes), `stream_error` (an
        # error event in a stream), `client_stopped_reading` (a stream cut after the client read nothing for
        # SEND_TIMEOUT_S: no [DONE] can reach it)
        self.failures = Counter("specfleet:request_failures", "Requests that ended in a failure, by outcome",
                                ["model_name", "outcome"], registry=r)
        self.migration_figures: MigrationStats | None = None  # the router's, as of the last scrape
        self.routing_figures: RoutingStats | None = None  # the router's, as of the last scrape
        self.instance_rows: list[InstanceRow] = []  # the router's rows, as of the last scrape
        self.autoscale_figures: AutoscaleStatus | None = None  # the autoscaler's, as of the last scrape
        r.register(_MigrationCollector(self))
        r.register(_AutoscaleCollector(self))
        r.register(_RoutingCollector(self))

    def failed(self, outcome: str) -> None:
        """A request ended in a failure (see `failures` for the outcomes)."""
        self.failures.labels(self.model, outcome).inc()

    def finished(self, reason: str, prompt_tokens: int, stats: SpecStats | None) -> None:
        """A choice ended (its generated tokens were counted as they streamed, by its RequestTimer)."""
        m = self.model
        self.success.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        if stats is not None and stats.proposed:
            self.drafts.labels(m).inc(stats.rounds)
            self.draft_tokens.labels(m).inc(stats.proposed)
            self.accepted_tokens.labels(m).inc(stats.accepted)
            for pos, n in enumerate(stats.accepted_per_position):
                self.accepted_per_pos.labels(m, str(pos)).inc(n)

    def set_instances(self, instances: list[InstanceRow]) -> None:
        """Refresh the load gauges from the router's `instances()` rows."""
        for g in (self.running, self.waiting, self.kv_usage, self.preemptions, self.router_in_flight,
                  self.draft_s_per_token, self.calibration_tokens, self.calibration_s, self.moe_local_rate,
                  self.moe_bytes, self.moe_s, self.instance_role, self.role_running, self.role_waiting):
            g.clear()
        self.instance_rows = list(instances)
        healthy = 0
        for row in instances:
            healthy += row.accepting
            self.router_in_flight.labels(row.model, row.instance_id).set(row.in_flight)
            self.instance_role.labels(row.model, row.instance_id, row.role).set(1)
            s = row.stats
            if s is None:
                continue
            labels = (row.model, row.instance_id)
            self.role_running.labels(row.model, row.role).inc(s.load.running)
            self.role_waiting.labels(row.model, row.role).inc(s.load.waiting)
            self.running.labels(*labels).set(s.load.running)
            self.waiting.labels(*labels).set(s.load.waiting)
            total = s.load.kv_blocks_used + s.load.kv_blocks_free
            self.kv_usage.labels(*labels).set(s.load.kv_blocks_used / total if total else 0.0)
            self.preemptions.labels(*labels).set(s.load.num_preemptions)
            self.draft_s_per_token.labels(*labels).set(s.spec.draft_s_per_token)
            self.calibration_tokens.labels(*labels).set(s.spec.calibration_tokens)
            self.calibration_s.labels(*labels).set(s.spec.calibration_s)
            if s.moe.active:  # an expert-parallel instance
                self.moe_local_rate.labels(*labels).set(s.moe.local_rate)
                self.moe_bytes.labels(*labels).set(s.moe.alltoall_bytes_per_token)
                self.moe_s.labels(*labels).set(s.moe.s_per_token)
        self.healthy_instances.labels(self.model).set(healthy)
        self.router_pending.labels(self.model).set(sum(row.in_flight for row in instances))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds the latency histograms, and the record of first tokens the autoscaler reads, from one request's items."""

    def __init__(self, metrics: Metrics, arrival: float, first_tokens: FirstTokenRecord, request_id: str) -> None:
        self.m, self.arrival = metrics, arrival
        self.first_tokens, self.request_id = first_tokens, request_id
        self.first: float | None = None
        self.last: dict[int, float] = {}

    def observe(self, index: int, item: StreamItem) -> None:
        now, model = time.monotonic(), self.m.model
        if item.queue_s is not None:
            self.m.queue.labels(model).observe(item.queue_s)
        if item.delta.token_ids:
            self.m.generation_tokens.labels(model).inc(len(item.delta.token_ids))
            if self.first is None:
                self.first = now
                self.m.ttft.labels(model).observe(now - self.arrival)
                self.first_tokens.first(self.request_id, now - self.arrival, now)
            if index in self.last:
                self.m.itl.labels(model).observe(now - self.last[index])
            self.last[index] = now
        if item.delta.finished:
            self.m.e2e.labels(model).observe(now - self.arrival)


class _ScrapeCollector:
    """A collector of figures the last scrape read from the router (nothing to describe ahead)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # collected at scrape time only


class _MigrationCollector(_ScrapeCollector):
    """specfleet:migrations_total{status}, specfleet:failovers_total and specfleet:migration_downtime_seconds,
    from the router's MigrationStats (cumulative at the router, so they are counters for every replica)."""

    def collect(self):
        s = self.metrics.migration_figures
        if s is None:
            return
        migrations = CounterMetricFamily("specfleet:migrations", "Live migrations by outcome", labels=["status"])
        for status, n in sorted(s.by_status.items()):
            migrations.add_metric([status], n)
        yield migrations
        yield CounterMetricFamily("specfleet:failovers", "Requests resumed on another instance after theirs failed",
                                  value=s.failovers)
        buckets = [(str(le), n) for le, n in zip(DOWNTIME_BUCKETS, s.downtime_buckets)] + [("+Inf", s.downtime_count)]
        yield HistogramMetricFamily("specfleet:migration_downtime_seconds",
                                    "A finished migration's downtime: the request stopped at its source until its "
                                    "commit at the destination", buckets=buckets, sum_value=s.downtime_sum_s)


class _RoutingCollector(_ScrapeCollector):
    """specfleet:router_dispatch_decisions{reason} (the router's own count since it started: `prefix`, sent where
    part of its prompt was cached; `load_over_prefix`, a holder was too loaded; `load`, none held any), the
    size of its prefix index, the disaggregation figures, and specfleet:router_failed_rounds{loop}."""

    def collect(self):
        s = self.metrics.routing_figures
        if s is None:
            return
        decisions = CounterMetricFamily("specfleet:router_dispatch_decisions",
                                        "Requests routed (and failed over) by the reason of the choice",
                                        labels=["policy", "reason"])
        for reason in ("prefix", "load_over_prefix", "load"):
            decisions.add_metric([s.policy, reason], s.decisions.get(reason, 0))
        yield decisions
        yield GaugeMetricFamily("specfleet:router_prefix_index_entries",
                                "(instance, KV block) pairs the router's prefix index holds", value=s.index_entries)
        failed = CounterMetricFamily("specfleet:router_failed_rounds", "Rounds of the router's background loops that "
                                     "raised (each loop goes on with its next round; the error is logged)",
                                     labels=["loop"])
        for loop in sorted(set(ROUTER_LOOPS) | set(s.failed_rounds)):
            failed.add_metric([loop], s.failed_rounds.get(loop, 0))
        yield failed
        if s.disaggregation or s.handoffs or s.handoffs_pending:  # instances with a prefill or decode role
            placed = CounterMetricFamily("specfleet:disagg_placements", "New requests placed by the prefill/decode "
                                         "pair policy, by reason (cluster/disagg.py)", labels=["reason"])
            for reason, n in sorted(s.disaggregation.items()):
                placed.add_metric([reason], n)
            yield placed
            handoffs = CounterMetricFamily("specfleet:disagg_handoffs", "Prefilled requests moved to their decode "
                                           "instance, by the migration's outcome", labels=["status"])
            for status, n in sorted(s.handoffs.items()):
                handoffs.add_metric([status], n)
            yield handoffs
            yield GaugeMetricFamily("specfleet:disagg_handoffs_pending",
                                    "Requests waiting for their first token at a prefill instance",
                                    value=s.handoffs_pending)


class _AutoscaleCollector(_ScrapeCollector):
    """The autoscaler's figures (fleet.autoscaling; nothing for a fixed fleet), after Ray Serve's
    `serve_autoscaling_*` gauges: its bounds, the fleet's size and the size it decided on, the p99 latencies it
    sees, its last decision with its reason, and `specfleet:autoscaling_scale_events_total{action,outcome,cause}`."""

    def collect(self):
        s = self.metrics.autoscale_figures
        if s is None:
            return
        desired = s.last.desired if s.last is not None else s.instances
        for name, doc, value in (("min_instances", "The autoscaler's lower bound", s.min_instances),
                                 ("max_instances", "The autoscaler's upper bound", s.max_instances),
                                 ("current_instances", "Instances serving or starting, as the autoscaler counts",
                                  s.instances),
                                 ("desired_instances", "Instances the autoscaler's last decision asks for", desired)):
            yield GaugeMetricFamily(f"specfleet:autoscaling_{name}", doc, value=value)
        for name, value in (("ttft", s.ttft_p99_s), ("itl", s.itl_p99_s)):
            if value is not None:
                yield GaugeMetricFamily(f"specfleet:autoscaling_{name}_p99_seconds",
                                        f"The {name} p99 the autoscaler compares with its target (recent window)",
                                        value=value)
        if s.ttft_source is not None:  # which TTFT that p99 is: measured by the API replicas, or predicted (fallback)
            source = GaugeMetricFamily("specfleet:autoscaling_ttft_source_info", "Where the autoscaler's TTFT p99 "
                                       "comes from: measured by the API replicas, or predicted from the queue "
                                       "(while none reports)", labels=["source"])
            source.add_metric([s.ttft_source], 1)
            yield source
        yield CounterMetricFamily("specfleet:autoscaling_failed_rounds", "Autoscaling rounds that raised (reading "
                                  "the router, deciding or acting; the loop goes on with its next round)",
                                  value=s.failed_rounds)
        steps = CounterMetricFamily("specfleet:autoscaling_scale_events", "Scale steps by action, outcome and cause",
                                    labels=["action", "outcome", "cause"])
        for action, outcome, cause, n in s.counts:
            steps.add_metric([action, outcome, cause], n)
        yield steps
        if s.last is not None:
            last = GaugeMetricFamily("specfleet:autoscaling_last_decision_info", "The autoscaler's last decision",
                                     labels=["action", "cause", "reason"])
            last.add_metric([s.last.action, s.last.cause, s.last.reason], 1)
            yield last
