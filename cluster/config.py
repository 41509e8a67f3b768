"""The one typed configuration tree (pydantic v2, frozen, extra="forbid"), loaded from YAML.

Each component receives only its own sub-config: the model loader gets `ModelConfig`, the
speculation policy `SpeculationConfig`, the KV cache `CacheConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from cluster.config_file import ConfigError, describe, read_yaml
from cluster.disagg import DisaggConfig
from cluster.fleet_config import MOVED_TO_FLEET, FleetConfig
from cluster.migration_policy import MigrationPolicyConfig


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    """The model pair an instance serves.

    `target` and `draft` are each a catalog name (see deploy/model_store.py), a GGUF file, a local
    Hugging Face folder (safetensors), or a hub id. `draft: null` decodes without speculation;
    `draft_layers` instead makes a self-speculative draft out of those layers of the target
    (layer skipping, as in SWIFT arXiv 2410.06916 and Kangaroo arXiv 2404.18911), sharing its weights.
    """

    target: str
    draft: str | None = None
    draft_layers: tuple[int, ...] | None = None
    # "auto" is resolved where the app is built, for the hardware it runs on (actors/model/device.py choose_dtype): bf16
    # on GPUs and on CPUs where our kernels or bf16 arithmetic run, fp32 elsewhere; the start-up line says which
    dtype: Literal["auto", "fp32", "bf16"] = "fp32"
    # where weights, KV cache and sampling live: "auto" is the GPU Ray assigned to the process if any (outside
    # Ray: any visible GPU), else the CPU; "cuda" requires one (actors/model/device.py)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # how linear maps compute (docs/weights.md): "stored" on a GGUF file's quantized blocks as stored (int4
    # kernels, exact; Q6_K on int8; a safetensors model's weights as they are), "dequantized" on the weights
    # expanded to `dtype`, "int8" / "int4" quantized at load (round to nearest, gpt-fast style). Applies to the
    # target and to a draft model. "stored" is measured faster in bf16, plain and speculative, batch 1 and 8 (docs/benchmarks.md).
    weights: Literal["stored", "dequantized", "int8", "int4"] = "stored"
    # how our CPU int4 kernel (bf16 on AVX512-BF16/VNNI CPUs) takes a linear map's input rows: "int8" rounds each
    # row per group of 32 (llama.cpp's Q8_0 dot products, measured 1.2-1.5x faster per step: docs/benchmarks.md;
    # speculation stays lossless against plain decoding on the same path), "bf16" takes them as given (the exact
    # result of the stored weights, rounded once). Elsewhere (fp32, CUDA, other CPUs) it changes nothing.
    activations: Literal["int8", "bf16"] = "int8"
    # which path runs the model (actors/model/backends.py, docs/models.md): "auto" the hand-written layers for the
    # families they cover (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma3_text) and
    # transformers' own decoder layers on our paged cache (the generic path) for any other decoder-only model;
    # "native" / "generic" force one
    backend: Literal["auto", "native", "generic"] = "auto"
    # the draft re-quantized at load, whatever `weights` is (gpt-fast style); cheaper drafting, the output stays
    # the target's
    draft_quantization: Literal["none", "int8", "int4"] = "none"
    max_model_len: int | None = Field(default=None, ge=2)
    name: str | None = None  # the name clients use for the model; defaults to the target's
    # how the model writes tool calls and reasoning (deploy/serve/tool_parsers.py, reasoning.py; vLLM's
    # --tool-call-parser and --reasoning-parser): a format's name, "auto" (detected from the chat template) or "none"
    tool_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral"] = "auto"
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3"] = "auto"

    @model_validator(mode="after")
    def _one_draft(self) -> "ModelConfig":
        if self.draft is not None and self.draft_layers is not None:
            raise ValueError("set either draft or draft_layers, not both")
        if self.draft_layers is not None and len(self.draft_layers) == 0:
            raise ValueError("draft_layers must name at least one layer")
        return self

    @property
    def served_name(self) -> str:
        return self.name or Path(self.target).stem


class NgramConfig(_Frozen):
    """Prompt lookup (actors/speculation/lookup.py): match the last n tokens, max_n down to min_n, earlier in the
    request."""

    min_n: int = Field(default=2, ge=1, le=16)
    max_n: int = Field(default=4, ge=1, le=16)

    @model_validator(mode="after")
    def _ordered(self) -> "NgramConfig":
        if self.min_n > self.max_n:
            raise ValueError("ngram.min_n must not exceed ngram.max_n")
        return self


class SuffixConfig(_Frozen):
    """Suffix-tree lookup (SuffixDecoding): trie depth, the least path probability drafted, and the tree of recent
    outputs: at most `cache_tokens` tokens of them per instance (0: the request's own prompt and output only),
    kept per tenant (`scope: tenant`, one tree per API key: no key drafts from another's outputs) or in one tree
    for every request (`scope: shared`, for a single-tenant deployment)."""

    depth: int = Field(default=24, ge=2, le=64)
    min_prob: float = Field(default=0.1, ge=0.0, le=1.0)
    cache_tokens: int = Field(default=32_768, ge=0, le=10_000_000)
    scope: Literal["tenant", "shared"] = "tenant"


class DraftParallelConfig(_Frozen):
    """EasySpec layer-parallel drafting (arXiv 2502.02493; actors/speculation/easyspec.py).

    The draft's first `sequential_head` and last `sequential_tail` layers run in order; the layers between run
    in groups of `group_size` (1: plain sequential drafting). `mode: attention`: a group's members run their
    attention on the same input, then their MLPs in order on the accumulated residual (the paper's best
    variant); `mode: layer`: members run whole layers on the same input and their residual updates are summed.
    `calibrate` (bonus calibration): after each verification the draft's KV is cut back to its exactly computed
    prefix and the next round's first forward re-runs the accepted tokens in true layer order; off only to
    show what it prevents (tests, benchmarks).
    """

    group_size: int = Field(default=1, ge=1, le=8)
    sequential_head: int = Field(default=2, ge=0)
    sequential_tail: int = Field(default=2, ge=0)
    mode: Literal["attention", "layer"] = "attention"
    calibrate: bool = True

    @property
    def enabled(self) -> bool:
        return self.group_size > 1


class GuardConfig(_Frozen):
    """The goodput policy's measured guard (actors/speculation/guard.py): per batch size, drafting stops while steps
    that draft measure fewer tokens per second than steps that do not; one step in `explore_every` tries again."""

    enabled: bool = True
    explore_every: int = Field(default=8, ge=2, le=100_000)
    decay: float = Field(default=0.8, gt=0.0, le=1.0)  # of the decayed tokens and seconds, per observed step
    min_samples: int = Field(default=3, ge=1, le=1000)  # steps of each kind before the guard judges
    # an open batch size re-measures plain steps only while drafting is within this share of plain's rate
    recheck_margin: float = Field(default=0.25, ge=0.0, le=10.0)


class SpeculationConfig(_Frozen):
    """How drafts are made (`method`) and how many tokens the draft proposes per round (actors/speculation/policy.py).

    `method`: `model` drafts with the draft model (`model.draft` or `model.draft_layers`); `ngram` and
    `suffix` draft without a model from the request's own tokens (actors/speculation/lookup.py).
    `fixed`: k tokens for every request; `off`: plain decoding; `goodput`: per request 0..k, chosen each
    step for the most expected tokens per second (SmartSpec), from each request's acceptance estimate
    (starting at `prior_acceptance`, decayed by `acceptance_decay` per round) and the fitted step-time model.
    """

    method: Literal["model", "ngram", "suffix"] = "model"
    ngram: NgramConfig = NgramConfig()
    suffix: SuffixConfig = SuffixConfig()
    policy: Literal["fixed", "off", "goodput"] = "fixed"
    k: int = Field(default=4, ge=0, le=16)
    prior_acceptance: float = Field(default=0.7, ge=0.0, le=1.0)
    acceptance_decay: float = Field(default=0.9, gt=0.0, le=1.0)
    draft_parallel: DraftParallelConfig = DraftParallelConfig()  # EasySpec, for `method: model`
    guard: GuardConfig = GuardConfig()  # `goodput` only: drafting must measure at least as fast as plain steps


class CacheConfig(_Frozen):
    """KV cache size in fixed-size blocks of `block_size` tokens, per shard."""

    block_size: int = Field(default=16, ge=1, le=1024)
    num_blocks: int = Field(default=2048, ge=2)
    # automatic prefix caching (actors/kv/cache.py BlockPool): full blocks named by their tokens are shared between
    # requests and kept after they end, so a prompt that starts like an earlier one skips that part of its prefill.
    # On by default, as measured to pay (`specfleet bench prefix`, docs/benchmarks.md): a single request of the
    # default app is no slower with it, and a chat's prompts share at least the chat template's header
    prefix_caching: bool = True
    # whether requests of different tenants (API keys) share cached blocks: off by default, so no key can learn by
    # its own hits what another key's prompts began with (cluster/prefix.py, docs/security.md); on for a
    # single-tenant fleet, where one system prompt shared by every key is worth caching once
    share_across_tenants: bool = False

    @property
    def capacity_tokens(self) -> int:
        """The tokens one request may hold: every usable block (actors/kv/cache.py keeps the last as scratch)."""
        return (self.num_blocks - 1) * self.block_size


class GrammarConfig(_Frozen):
    """Structured outputs' and tool calls' grammars at an instance (actors/serving/grammar_pool.py): compiled off the engine's
    loop on `compile_workers` threads, one tenant on at most all but one of them, at most `compile_queue` waiting
    (refused beyond); a grammar that takes longer than `compile_timeout_s` to compile is refused (a 400), and the
    compiled grammars kept for reuse hold at most `cache_bytes` of grammar text."""

    compile_workers: int = Field(default=2, ge=1, le=64)
    compile_queue: int = Field(default=256, ge=0, le=100_000)
    compile_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    cache_bytes: int = Field(default=64 * 2**20, ge=0, le=2**40)


class SchedulerConfig(_Frozen):
    """Continuous batching limits per step: running requests, and target tokens (chunked prefill, Sarathi)."""

    max_batch_size: int = Field(default=8, ge=1)
    # decodes' tokens (1 + k each) come first; prefill chunks fill the rest of the budget
    max_num_batched_tokens: int = Field(default=256, ge=1)
    # tokens a request's stream gathers before the instance sends them on (vLLM's and SGLang's `stream_interval`;
    # cluster/coalesce.py): 1 sends each step's tokens at once; more sends fewer, larger chunks (less work per token
    # in the served path, a lumpier stream). The first tokens and the last are never held. Whatever waits to be sent
    # goes as one chunk whatever this is.
    stream_interval: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _room_for_decodes(self) -> "SchedulerConfig":
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError("max_num_batched_tokens must be at least max_batch_size (one token per running request)")
        return self


class ExpertParallelConfig(_Frozen):
    """Expert parallelism for a MoE target (actors/moe/ep.py, Speculative MoE arXiv 2503.04398).

    With `ranks` > 1 the instance's target runs as that many rank actors, one per slot of its layout, each
    with every layer's attention and a slice of every MoE layer's experts; a request's KV lives on one rank.
    `plan` (an ExpertPlan JSON, `specfleet experts plan`) groups co-activated experts on one rank (default:
    contiguous slices); `stats` (routing statistics, `specfleet experts profile`) places each new request on
    the rank its predicted experts favour, among ranks within `slack` requests of the lightest (default: the
    lightest rank).

    `attention: tensor` splits every layer's attention heads over the ranks instead (each rank holds its heads'
    KV of every request, actors/moe/shuffle.py): then `stats` pre-schedules single tokens rather than requests,
    landing each token's attention output on the rank its predicted experts favour where the prediction's
    share of the mass is at least `confidence` (Speculative MoE's token shuffling; below it, and without
    `stats`, tokens land on a balanced split).
    """

    ranks: int = Field(default=1, ge=1)
    plan: str | None = None
    stats: str | None = None
    slack: int = Field(default=2, ge=0)
    attention: Literal["data", "tensor"] = "data"
    confidence: float = Field(default=0.0, ge=0.0, le=1.0)

    @property
    def enabled(self) -> bool:
        return self.ranks > 1


class EngineConfig(_Frozen):
    """One instance's engine: its model pair, speculation, scheduler, cache and expert parallelism."""

    model: ModelConfig
    speculation: SpeculationConfig = SpeculationConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    experts: ExpertParallelConfig = ExpertParallelConfig()
    grammar: GrammarConfig = GrammarConfig()
    # batch-invariant target forward (actors/model/deterministic.py, docs/determinism.md): a token's logits do not
    # depend on its batch, so speculation in bf16 equals plain decoding token for token and runs repeat exactly
    deterministic: bool = False

    @property
    def prefix_identity(self) -> str:
        """What names the target's KV content in the prefix cache (the root of cluster/prefix.py's chains): the
        checkpoint as configured, its dtype, how its linear maps compute and deterministic mode. Every instance and
        API replica of one app computes the same names from it, wherever the checkpoint resolves on its node."""
        m = self.model
        mode = "deterministic" if self.deterministic else "batched"
        return f"{m.target}|{m.dtype}|{m.weights}|{m.activations}|{mode}"


class KeyLimits(_Frozen):
    """What one API key may use (deploy/serve/admission.py), checked before any work is done for a request.

    `max_concurrent`: choices (a request with `n: 4` counts 4) admitted and not yet finished, per API replica;
    `tokens_per_minute`: prompt + n * max_tokens of the requests admitted, a token bucket of that size refilled
    over a minute (None: no limit); `max_priority`: the highest `priority` a request may ask for (the scheduler
    preempts the lowest first, so a key that could ask for any priority could starve every other).
    """

    max_concurrent: int = Field(default=64, ge=1, le=1_000_000)
    tokens_per_minute: int | None = Field(default=None, ge=1, le=10**12)
    max_priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)


class APIKey(KeyLimits):
    """One API key with its own limits: the key is read from the environment variable `key_env` or the file
    `key_file` (never written in the config); `name` stands for it in logs and as its tenant (suffix cache)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    key_env: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "APIKey":
        if (self.key_env is None) == (self.key_file is None):
            raise ValueError(f"key {self.name!r}: give exactly one of key_env or key_file")
        return self


class AuthConfig(_Frozen):
    """API keys: `/v1` and gRPC take any of `api_keys` and `keys`, `/admin` any of `admin_keys` (Authorization:
    Bearer).

    Each set is the union of keys written here, the comma-separated keys in the environment variable named
    by `*_env` (a Kubernetes Secret), and the lines of the file named by `*_file`. With `required` (the
    default) a set that comes out empty refuses every request to its routes rather than leaving them open.
    Keys of `api_keys`, `api_keys_env` and `api_keys_file` have the `limits`; each entry of `keys` has its own.
    """

    keys: tuple[APIKey, ...] = ()
    limits: KeyLimits = KeyLimits()
    api_keys: tuple[SecretStr, ...] = ()
    admin_keys: tuple[SecretStr, ...] = ()
    api_keys_env: str = "SPECFLEET_API_KEYS"
    admin_keys_env: str = "SPECFLEET_ADMIN_KEYS"
    api_keys_file: str | None = None
    admin_keys_file: str | None = None
    required: bool = True

    @model_validator(mode="after")
    def _unique_names(self) -> "AuthConfig":
        names = [k.name for k in self.keys]
        if len(set(names)) < len(names):
            raise ValueError(f"serve.auth.keys: names must be unique, got {names}")
        return self


class EdgeConfig(_Frozen):
    """Bounds on what one request may ask for and on the work done before it is admitted (deploy/serve/edge.py).

    A body must arrive within `body_timeout_s` (408 after). Tokenization (and the chat template) runs on
    `tokenizer_workers` threads, each with its own copy of the tokenizer; one API key holds at most all but one
    of them, and at most `tokenizer_queue` requests wait for one (429 beyond). `max_generated_tokens` bounds
    n * max_tokens of one request (max_tokens as resolved: the rest of the context when not given), and
    `max_messages` a chat's messages.
    """

    body_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    tokenizer_workers: int = Field(default=2, ge=1, le=64)
    tokenizer_queue: int = Field(default=64, ge=0, le=100_000)
    max_generated_tokens: int = Field(default=65_536, ge=1, le=10**9)
    max_messages: int = Field(default=512, ge=1, le=100_000)


class ServeConfig(_Frozen):
    """The Ray Serve application (deploy/serve/app.py): where it listens, backpressure, bounds and keys.

    `http_host` is where Serve's HTTP proxy (and, on a cluster `specfleet serve` starts Serve on, its gRPC proxy)
    listens: 127.0.0.1 by default, this machine only; `0.0.0.0` exposes it, behind the API keys.
    """

    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8000, ge=1, le=65535)
    grpc_port: int = Field(default=9000, ge=1, le=65535)
    # requests admitted but not yet finished, over all instances; beyond it: HTTP 429 / RESOURCE_EXHAUSTED
    max_pending_requests: int = Field(default=256, ge=1)
    retry_after_s: int = Field(default=1, ge=1)
    # a request body (HTTP) or message (gRPC) larger than this is refused: HTTP 413 / RESOURCE_EXHAUSTED
    max_request_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    edge: EdgeConfig = EdgeConfig()
    auth: AuthConfig = AuthConfig()
    # custom Ray resources each API replica needs: pins the replicas (which read the key files) to the nodes that
    # hold them (on Kubernetes the head, which alone mounts the keys: deploy/infra/k8s_render.py)
    api_resources: dict[str, float] = {}

    def __hash__(self) -> int:  # frozen, but a dict field is unhashable: hash the canonical JSON instead
        return hash(self.model_dump_json())


class MigrationConfig(_Frozen):
    """Live migration (cluster/migration.py): at most `max_stages` KV copies while the source keeps decoding (0:
    stop and copy at once), stopping early once at most `stop_copy_tokens` are left to copy. The router runs
    the named `policies` (cluster/migration_policy.py) every `interval_s` and when an instance joins or drains;
    none by default (a single instance has nowhere to move a request to; the fleet config turns them on)."""

    max_stages: int = Field(default=4, ge=0, le=64)
    stop_copy_tokens: int = Field(default=16, ge=0)
    # a stage copies in chunks of at most this many tokens, each between two of the source's steps (a copy
    # stalls the source's loop while it runs: bounded chunks keep each stall short)
    chunk_tokens: int = Field(default=256, ge=1)
    # how the KV travels: "torch", stage to stage over torch.distributed links opened for the migration between
    # each source shard and each destination shard that hold the same layers (NCCL between GPUs, gloo otherwise;
    # the object store if they cannot be opened); "object_store", Ray's object store
    transfer: Literal["torch", "object_store"] = "torch"
    channel_timeout_s: float = Field(default=10.0, gt=0.0)
    # every call of a migration to either instance must answer within this, or the migration aborts (the request
    # carries on at its source, or fails over if its source died); the instances also let go on their own of what
    # a migration left behind (a reservation, a stopped request, a copy nobody follows) after twice this
    step_timeout_s: float = Field(default=30.0, gt=0.0)
    # the draft model's KV: "move" copies it (as it stands between two steps) before the stop, so the draft at the
    # destination catches up only on the tokens since; "rebuild" lets it catch up on the whole request there
    draft_kv: Literal["move", "rebuild"] = "move"
    policies: tuple[Literal["drain", "queue", "defrag", "balance"], ...] = ()
    interval_s: float = Field(default=1.0, gt=0.0)
    thresholds: MigrationPolicyConfig = MigrationPolicyConfig()


class FailoverConfig(_Frozen):
    """A request whose instance fails resumes from its tokens on another instance (deploy/serve/frontend.py); with
    none left it waits for one to join (the replacement Serve starts), and gives up after `max_attempts` failovers
    of one request.

    The wait is learned (cluster/start_times.py): `start_multiple` times the slowest of the router's recent starts
    and replacements, at least `wait_s` (the floor) and at most `max_wait_s` (the ceiling)."""

    wait_s: float = Field(default=60.0, ge=0.0)
    max_wait_s: float = Field(default=600.0, ge=0.0)
    start_multiple: float = Field(default=2.0, ge=1.0)
    max_attempts: int = Field(default=3, ge=0)

    @model_validator(mode="after")
    def _floor_below_ceiling(self) -> "FailoverConfig":
        if self.wait_s > self.max_wait_s:
            raise ValueError(f"failover.wait_s ({self.wait_s}) is the wait's floor: it must not exceed "
                             f"failover.max_wait_s ({self.max_wait_s})")
        return self


class CacheAwareConfig(_Frozen):
    """`cache_aware` dispatch (cluster/dispatch.py) and the router's prefix index (cluster/prefix_index.py).

    A request goes to the instance holding most of its prompt's leading KV blocks, if they are at least
    `min_match` of the prompt's blocks (SGLang's cache_threshold), unless that instance's virtual usage is more
    than `max_load_gap` (a fraction of its KV) above the least loaded instance's, or it has more than
    `max_request_gap` requests more in flight; then least load decides. The router counts a routed request's blocks at
    its instance for `provisional_s` until that instance's cache events confirm them, and keeps at most
    `max_entries` (instance, block) pairs (about 260 bytes each), forgetting the least recently used."""

    max_load_gap: float = Field(default=0.25, ge=0.0)
    max_request_gap: int = Field(default=2, ge=0)
    min_match: float = Field(default=0.5, ge=0.0, le=1.0)
    provisional_s: float = Field(default=10.0, gt=0.0)
    max_entries: int = Field(default=1_000_000, ge=1)


class RouterConfig(_Frozen):
    """The router actor (cluster/router.py): how it dispatches, polls, migrates, fails over and splits prefill from
    decode. The instances it dispatches to are the fleet's (`FleetConfig`)."""

    # least_load: Llumnix's virtual usage; round_robin; cache_aware: where the prompt's prefix is cached (with
    # engine.cache.prefix_caching on), within `cache_aware`'s margins of the least loaded (docs/prefix_caching.md)
    dispatch: Literal["least_load", "round_robin", "cache_aware"] = "least_load"
    cache_aware: CacheAwareConfig = CacheAwareConfig()
    stats_interval_s: float = Field(default=0.5, gt=0.0)  # how often the router polls each instance
    # a request routed this long ago that its instance has never received is closed as aborted (its caller went
    # away between routing and sending it); younger ones may still be on their way (Registry.reconcile)
    orphan_grace_s: float = Field(default=30.0, gt=0.0)
    migration: MigrationConfig = MigrationConfig()
    failover: FailoverConfig = FailoverConfig()
    # prefill/decode disaggregation: each instance's role (docs/disaggregation.md); none: every instance does both
    disaggregation: DisaggConfig = DisaggConfig()
    # API replicas and instances find a router that died again by its name (a restarted or new one), retrying
    # for at most this long before a call fails
    reconnect_s: float = Field(default=20.0, gt=0.0)

    @model_validator(mode="after")
    def _some_instance_decodes(self) -> "RouterConfig":
        roles = self.disaggregation.roles
        if roles and all(r == "prefill" for r in roles):
            raise ValueError("router.disaggregation.roles: every instance is `prefill`, so none decodes; make at "
                             "least one `decode` or `both`")
        return self


class SpecfleetConfig(_Frozen):
    """The root of the tree, as read from a YAML file. The rules that relate two sections are checked here."""

    engine: EngineConfig
    fleet: FleetConfig = FleetConfig()
    router: RouterConfig = RouterConfig()
    serve: ServeConfig = ServeConfig()

    @model_validator(mode="after")
    def _expert_ranks_have_slots(self) -> "SpecfleetConfig":
        ranks = self.engine.experts.ranks
        if ranks > 1 and self.fleet.pipeline_stages != ranks:
            raise ValueError(f"engine.experts.ranks is {ranks}: the fleet plan places one expert-parallel rank per "
                             f"planned slot, so set fleet.pipeline_stages to {ranks} too "
                             f"(it is {self.fleet.pipeline_stages})")
        return self

    @model_validator(mode="after")
    def _one_role_per_instance(self) -> "SpecfleetConfig":
        roles = self.router.disaggregation.roles
        if roles and len(roles) != self.fleet.instances:
            raise ValueError(f"router.disaggregation.roles names {len(roles)} roles for fleet.instances = "
                             f"{self.fleet.instances}: give one role per instance")
        return self


def load_config(path: str | Path) -> SpecfleetConfig:
    """Read and validate a YAML config; errors name the file and the offending key."""
    return parse_config(read_yaml(path, "config"), source=str(path))


def parse_config(raw: object, source: str = "<config>") -> SpecfleetConfig:
    """Validate an already-parsed mapping; `source` names where it came from in errors (a key of an older config
    that moved, such as `router.instances`, is named with its new place)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        return SpecfleetConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(describe(e, source, moved=MOVED_TO_FLEET)) from None

