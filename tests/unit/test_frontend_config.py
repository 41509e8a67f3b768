"""The frontend's own sub-config (deploy/serve/frontend_config.py) carries what it reads from the root, in one place."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.disagg import DisaggConfig
from cluster.config import CacheConfig, EngineConfig, ModelConfig, RouterConfig, ServeConfig, SpecfleetConfig
from deploy.serve.frontend_config import FrontendConfig, frontend_config


def _root(dispatch: str = "least_load", prefix_caching: bool = True, roles: tuple[str, ...] = ()) -> SpecfleetConfig:
    router = RouterConfig.model_validate({"dispatch": dispatch, "reconnect_s": 7.0,
                                          "failover": {"max_wait_s": 120.0, "max_attempts": 5}})
    root = SpecfleetConfig(
        engine=EngineConfig(model=ModelConfig(target="/m/tiny.gguf", max_model_len=64),
                            cache=CacheConfig(block_size=8, num_blocks=33, prefix_caching=prefix_caching,
                                              share_across_tenants=True)),
        router=router,
        serve=ServeConfig.model_validate({"max_pending_requests": 9, "retry_after_s": 3,
                                          "edge": {"tokenizer_workers": 3, "tokenizer_queue": 11}}))
    # the roles set as given (one per instance: where the instance count lives is the fleet's business, not this test's)
    return root.model_copy(update={"router": router.model_copy(update={"disaggregation": DisaggConfig(roles=roles)})})


def test_the_frontends_part_is_read_from_each_subtree() -> None:
    root = _root()
    cfg = frontend_config(root)
    assert cfg.model == root.engine.model
    assert (cfg.cache_tokens, cfg.block_size) == (32 * 8, 8)  # usable blocks (one is the null block) * block size
    assert cfg.prefix_identity == root.engine.prefix_identity and cfg.share_across_tenants
    assert (cfg.reconnect_s, cfg.failover.max_wait_s, cfg.failover.max_attempts) == (7.0, 120.0, 5)
    assert (cfg.max_pending_requests, cfg.retry_after_s) == (9, 3)
    assert (cfg.tokenizer_workers, cfg.tokenizer_queue) == (3, 11)
    assert not cfg.disaggregated


@pytest.mark.parametrize(("dispatch", "prefix_caching", "roles", "by_blocks", "disaggregated"), [
    ("least_load", True, (), False, False),  # the router does not route by the prompt's blocks
    ("cache_aware", True, (), True, False),
    ("cache_aware", False, (), False, False),  # no blocks are cached to be found
    ("least_load", True, ("prefill", "decode"), True, True),  # a disaggregated router scores the pair's prefix too
])
def test_the_router_is_told_a_prompts_blocks_only_where_it_routes_by_them(dispatch, prefix_caching, roles, by_blocks,
                                                                          disaggregated) -> None:
    cfg = frontend_config(_root(dispatch, prefix_caching, roles))
    assert (cfg.route_by_blocks, cfg.disaggregated) == (by_blocks, disaggregated)


def test_it_is_frozen_and_refuses_unknown_fields() -> None:
    cfg = frontend_config(_root())
    with pytest.raises(ValidationError):
        cfg.retry_after_s = 5
    with pytest.raises(ValidationError):
        FrontendConfig(model=cfg.model, router=RouterConfig())  # the root's subtrees are not its fields
