"""Engine-level load and speed figures, the message an instance reports to the router each step."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine after a step (what Llumnix calls an instance's load)."""

    running: int  # requests holding KV and stepping
    waiting: int  # queued or preempted requests
    kv_blocks_used: int  # the target's cache (every target shard has the same block count)
    kv_blocks_free: int
    draft_kv_blocks_used: int
    draft_kv_blocks_free: int
    num_steps: int
    step_time_s: float  # the last step's wall time
    step_time_ema_s: float  # exponentially weighted over steps (weight 0.1 for the newest)
    batch_size: int  # requests in the last step
    batch_tokens: int  # target tokens in the last step (prefill chunks + decodes + drafts)
    prefill_tokens: int  # of which prefill
    mean_k: float  # mean k over the last step's emitting requests
    acceptance: float  # the engine-wide acceptance estimate
    tokens_emitted: int  # generated tokens since start
    num_preemptions: int  # since start
    policy: str
    # drafting (EasySpec figures: actors/speculation/easyspec.py): draft-stage seconds per drafted token since start,
    # acceptance rate at each draft position (1st, 2nd, ...), and bonus calibration's re-run tokens and seconds
    draft_s_per_token: float = 0.0
    acceptance_by_position: tuple[float, ...] = ()
    calibration_tokens: int = 0
    calibration_s: float = 0.0
    # expert parallelism (Speculative MoE figures: actors/moe/ep.py) since start: share of (token, expert) pairs
    # served on the token's own rank, all-to-all bytes and MoE-layer seconds per token; zeros without it
    moe_local_rate: float = 0.0
    moe_alltoall_bytes_per_token: float = 0.0
    moe_s_per_token: float = 0.0
    # automatic prefix caching (the target's cache) since start, in tokens, under vLLM's names: prompt tokens that
    # asked the cache, and those it held; and the blocks it holds that no request uses now (reusable)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RoutingStats:
    """The router's dispatch figures since it started: its policy, its decisions by reason (cluster/registry.py:
    `prefix`, `load_over_prefix`, `load`), and its prefix index: (instance, block) pairs held, and instances whose
    cache events it follows (synchronised by a snapshot, no batch missing)."""

    policy: str
    decisions: dict[str, int]
    index_entries: int
    index_instances: int
    # prefill/decode disaggregation (cluster/disagg.py): new requests' placements by reason, handoffs' migrations by
    # outcome, and requests waiting for their first token at a prefill instance now
    disaggregation: dict[str, int] = field(default_factory=dict)
    handoffs: dict[str, int] = field(default_factory=dict)
    handoffs_pending: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


DOWNTIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # seconds


@dataclass
class MigrationStats:
    """The router's migration figures since it started: migrations by outcome, failovers, and the downtime of
    the finished migrations as a cumulative histogram (`downtime_buckets[i]` counts those <= DOWNTIME_BUCKETS[i])."""

    by_status: dict[str, int]
    failovers: int = 0
    downtime_count: int = 0
    downtime_sum_s: float = 0.0
    downtime_max_s: float = 0.0
    downtime_buckets: list[int] | None = None

    def __post_init__(self) -> None:
        if self.downtime_buckets is None:
            self.downtime_buckets = [0] * len(DOWNTIME_BUCKETS)

    def record(self, status: str, downtime_s: float | None) -> None:
        """One migration ended with `status`; `downtime_s` for a finished one."""
        self.by_status[status] = self.by_status.get(status, 0) + 1
        if downtime_s is None:
            return
        self.downtime_count += 1
        self.downtime_sum_s += downtime_s
        self.downtime_max_s = max(self.downtime_max_s, downtime_s)
        for i, le in enumerate(DOWNTIME_BUCKETS):
            if downtime_s <= le:
                self.downtime_buckets[i] += 1

    @property
    def downtime_mean_s(self) -> float:
        return self.downtime_sum_s / self.downtime_count if self.downtime_count else 0.0

    def as_dict(self) -> dict:
        return asdict(self)
