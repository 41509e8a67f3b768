"""`bench start`'s measurement on the tiny GGUF model: a cold start converts, a warm start only verifies."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import CacheConfig, EngineConfig, ModelConfig, SpeculationConfig
from deploy.bench.start import measure_start

pytestmark = pytest.mark.heavy  # the fast tier leaves it out: it starts fresh processes, cold and warm


def test_cold_start_converts_and_warm_start_reuses(tiny_gguf: Path) -> None:
    engine = EngineConfig(model=ModelConfig(target=str(tiny_gguf), draft_layers=(0,)),
                          speculation=SpeculationConfig(policy="fixed", k=2),
                          cache=CacheConfig(block_size=4, num_blocks=64))
    f = measure_start(engine, ["hello there", "who are you?"])
    for t in (f.cold, f.warm):
        assert 0 < t.imported_s <= t.resolved_s <= t.loaded_s <= t.first_token_s
        assert {"tokenizer", "weights", "layout"} <= set(t.phases)  # the engine's build, phase by phase
        assert abs(sum(t.breakdown().values()) - t.first_token_s) < 0.05  # the phases add up to the start
    # the cold start's resolve step converted the GGUF file; the warm one only checked the cached folder
    assert f.warm.resolved_s - f.warm.imported_s < f.cold.resolved_s - f.cold.imported_s
