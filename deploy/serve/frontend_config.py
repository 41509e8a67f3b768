"""The frontend's own sub-config (`FrontendConfig`), assembled from the root config in one place (`frontend_config`).

The Frontend (deploy/serve/frontend.py) tokenizes for one model, checks requests against its context and routes
them; it reads a few fields of four subtrees (engine.model, engine.cache, router, serve). ARCHITECTURE.md's rule is
that a component receives only its own sub-config, so the app (deploy/serve/app.py) assembles exactly what the
frontend reads here, and the frontend never sees the root. A benchmark or test that builds a Frontend of its own
assembles it the same way.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cluster.config import FailoverConfig, ModelConfig, SpecfleetConfig


class FrontendConfig(BaseModel):
    """What the frontend of one served model reads: its model, its context and cache naming, routing and limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig  # the served model: its tokenizer, chat template, context and parsers
    cache_tokens: int | None = None  # the KV cache's usable tokens (engine.cache.capacity_tokens): caps the context
    block_size: int = Field(default=16, ge=1)  # KV block size (engine.cache.block_size)
    # the router is told the names of a prompt's full KV blocks (prefix caching with cache-aware dispatch, or
    # disaggregation): cluster/prefix.py, docs/prefix_caching.md
    route_by_blocks: bool = False
    prefix_identity: str = ""  # the root of the blocks' names (EngineConfig.prefix_identity)
    share_across_tenants: bool = False  # engine.cache.share_across_tenants: as the engine names the blocks
    disaggregated: bool = False  # the router places requests on prefill/decode pairs: it gets the prompt's shape
    reconnect_s: float = Field(default=20.0, gt=0.0)  # router.reconnect_s: finding a router that died again
    failover: FailoverConfig = FailoverConfig()  # router.failover: how long and how often a request resumes
    max_pending_requests: int = Field(default=256, ge=1)  # serve.max_pending_requests, passed to `route`
    retry_after_s: int = Field(default=1, ge=1)  # serve.retry_after_s: a 429's Retry-After
    tokenizer_workers: int = Field(default=2, ge=1)  # serve.edge.tokenizer_workers
    tokenizer_queue: int = Field(default=64, ge=0)  # serve.edge.tokenizer_queue


def frontend_config(cfg: SpecfleetConfig) -> FrontendConfig:
    """The frontend's part of the root config (the one place it is read from the root)."""
    engine, router, serve = cfg.engine, cfg.router, cfg.serve
    disaggregated = router.disaggregation.enabled
    return FrontendConfig(
        model=engine.model, cache_tokens=engine.cache.capacity_tokens, block_size=engine.cache.block_size,
        route_by_blocks=engine.cache.prefix_caching and (router.dispatch == "cache_aware" or disaggregated),
        prefix_identity=engine.prefix_identity, share_across_tenants=engine.cache.share_across_tenants,
        disaggregated=disaggregated, reconnect_s=router.reconnect_s, failover=router.failover,
        max_pending_requests=serve.max_pending_requests, retry_after_s=serve.retry_after_s,
        tokenizer_workers=serve.edge.tokenizer_workers, tokenizer_queue=serve.edge.tokenizer_queue)
