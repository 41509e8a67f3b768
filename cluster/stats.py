"""Engine-level load and speed figures (the message an instance reports to the router each step), and the router's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LoadStats:
    """What an engine holds now (what Llumnix calls an instance's load; the router's dispatch reads it)."""

    running: int  # requests holding KV and stepping
    waiting: int  # queued or preempted requests
    kv_blocks_used: int  # the target's cache (every target shard has the same block count)
    kv_blocks_free: int
    draft_kv_blocks_used: int = 0
    draft_kv_blocks_free: int = 0
    num_preemptions: int = 0  # since start


@dataclass(frozen=True)
class StepStats:
    """The engine's steps: how many, how long, and the last one's batch."""

    num_steps: int = 0
    step_time_s: float = 0.0  # the last step's wall time
    step_time_ema_s: float = 0.0  # exponentially weighted over steps (weight 0.1 for the newest)
    batch_size: int = 0  # requests in the last step
    batch_tokens: int = 0  # target tokens in the last step (prefill chunks + decodes + drafts)
    prefill_tokens: int = 0  # of which prefill
    tokens_emitted: int = 0  # generated tokens since start


@dataclass(frozen=True)
class SpecDecodingStats:
    """Speculative decoding: the policy, its k and acceptance, and the drafting figures (EasySpec's:
    actors/speculation/easyspec.py): draft-stage seconds per drafted token since start, acceptance rate at each draft
    position (1st, 2nd, ...), and bonus calibration's re-run tokens and seconds."""

    policy: str = "off"
    mean_k: float = 0.0  # mean k over the last step's emitting requests
    acceptance: float = 0.0  # the engine-wide acceptance estimate
    draft_s_per_token: float = 0.0
    acceptance_by_position: tuple[float, ...] = ()
    calibration_tokens: int = 0
    calibration_s: float = 0.0


@dataclass(frozen=True)
class PrefixCacheStats:
    """Automatic prefix caching (the target's cache) since start, in tokens, as vLLM counts them: prompt tokens that
    asked the cache, and those it held; and the blocks it holds that no request uses now (reusable)."""

    queries: int = 0
    hits: int = 0
    cached_blocks: int = 0


@dataclass(frozen=True)
class MoEStats:
    """Expert parallelism (Speculative MoE figures: actors/moe/ep.py) since start: share of (token, expert) pairs
    served on the token's own rank, all-to-all bytes and MoE-layer seconds per token; zeros without it."""

    local_rate: float = 0.0
    alltoall_bytes_per_token: float = 0.0
    s_per_token: float = 0.0

    @property
    def active(self) -> bool:
        """An expert-parallel instance's figures (not the zeros of one without it)."""
        return bool(self.alltoall_bytes_per_token or self.local_rate)


# the flat names the stats travel under (the admin API's JSON, `specfleet status --json`), in their order: each is
# (record, field) of EngineStats; the wire format predates the nested records and stays as it was
WIRE_FIELDS: dict[str, tuple[str, str]] = {
    "running": ("load", "running"), "waiting": ("load", "waiting"),
    "kv_blocks_used": ("load", "kv_blocks_used"), "kv_blocks_free": ("load", "kv_blocks_free"),
    "draft_kv_blocks_used": ("load", "draft_kv_blocks_used"), "draft_kv_blocks_free": ("load", "draft_kv_blocks_free"),
    "num_steps": ("step", "num_steps"), "step_time_s": ("step", "step_time_s"),
    "step_time_ema_s": ("step", "step_time_ema_s"), "batch_size": ("step", "batch_size"),
    "batch_tokens": ("step", "batch_tokens"), "prefill_tokens": ("step", "prefill_tokens"),
    "mean_k": ("spec", "mean_k"), "acceptance": ("spec", "acceptance"), "tokens_emitted": ("step", "tokens_emitted"),
    "num_preemptions": ("load", "num_preemptions"), "policy": ("spec", "policy"),
    "draft_s_per_token": ("spec", "draft_s_per_token"), "acceptance_by_position": ("spec", "acceptance_by_position"),
    "calibration_tokens": ("spec", "calibration_tokens"), "calibration_s": ("spec", "calibration_s"),
    "moe_local_rate": ("moe", "local_rate"), "moe_alltoall_bytes_per_token": ("moe", "alltoall_bytes_per_token"),
    "moe_s_per_token": ("moe", "s_per_token"),
    "prefix_cache_queries": ("prefix_cache", "queries"), "prefix_cache_hits": ("prefix_cache", "hits"),
    "kv_blocks_cached": ("prefix_cache", "cached_blocks"),
}
_RECORDS = {"load": LoadStats, "step": StepStats, "spec": SpecDecodingStats, "prefix_cache": PrefixCacheStats,
            "moe": MoEStats}


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine after a step, as records by concern (as vLLM's `SchedulerStats` nests its
    `PrefixCacheStats` and `SpecDecodingStats`): the message an instance reports to the router each step."""

    load: LoadStats
    step: StepStats = StepStats()
    spec: SpecDecodingStats = SpecDecodingStats()
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    moe: MoEStats = MoEStats()

    def as_dict(self) -> dict:
        """The flat wire form, under WIRE_FIELDS' names."""
        return {name: getattr(getattr(self, record), f) for name, (record, f) in WIRE_FIELDS.items()}

    @classmethod
    def from_dict(cls, flat: dict) -> "EngineStats":
        """Back from `as_dict`'s form; a name this version does not know is ignored (a newer server's)."""
        parts: dict[str, dict] = {record: {} for record in _RECORDS}
        for name, value in flat.items():
            if name in WIRE_FIELDS:
                record, f = WIRE_FIELDS[name]
                parts[record][f] = tuple(value) if name == "acceptance_by_position" else value
        return cls(**{record: _RECORDS[record](**fields) for record, fields in parts.items()})


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
    # rounds of the router's background loops (ROUTER_LOOPS) that raised, and each loop's last error (FailedRounds)
    failed_rounds: dict[str, int] = field(default_factory=dict)
    last_round_error: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


ROUTER_LOOPS = ("migration_plan", "handoff", "health_poll")  # the router's background loops (cluster/router.py)


@dataclass
class FailedRounds:
    """Rounds of background loops that raised, by loop, with each loop's last error. A loop catches a round's error
    so that one bad round does not stop it (the next retries), which also hides a defect that fails every round:
    counted here, it shows in /metrics and `specfleet status`, not only in the logs."""

    counts: dict[str, int] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)  # "ExceptionType: message"

    def record(self, loop: str, error: BaseException) -> None:
        self.counts[loop] = self.counts.get(loop, 0) + 1
        self.last_error[loop] = f"{type(error).__name__}: {error}"[:300]


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
