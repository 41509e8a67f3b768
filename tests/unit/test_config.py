"""The typed config tree: the shipped default loads, and every kind of mistake is named clearly."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

import deploy
from cluster.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecfleetConfig,
    SpeculationConfig,
    load_config,
    parse_config,
)
from deploy.model_store import CATALOG

DEFAULT = Path(deploy.__file__).parent / "configs" / "default.yaml"

MINIMAL = "engine:\n  model:\n    target: smollm2-135m-instruct\n"


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_default_config_loads() -> None:
    cfg = load_config(DEFAULT)
    model = cfg.engine.model
    assert model.target in CATALOG
    # the draft kind and dtype measured to pay on this model at batch 1 and 8: a model-free n-gram lookup; the dtype
    # chosen for the machine (bf16 where our kernels run: tests/unit/test_dtype_auto.py)
    assert model.draft is None and model.draft_layers is None
    assert model.dtype == "auto"
    assert cfg.engine.speculation == SpeculationConfig(method="ngram", policy="goodput", k=4)
    assert cfg.engine.cache == CacheConfig(block_size=16, num_blocks=1024)


def test_minimal_config_takes_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.engine.model == ModelConfig(target="smollm2-135m-instruct")
    assert cfg.engine.speculation == SpeculationConfig()
    assert cfg.engine.model.served_name == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("engine:\n  model: {target: x}\nrouters: {}\n", "routers"),
        ("engine:\n  model: {target: x}\nserve: {auth: {tokens: [a]}}\n", "serve.auth.tokens"),
        ("engine:\n  model: {target: x}\n  turbo: true\n", "engine.turbo"),
        ("engine:\n  model: {target: x, drafts: y}\n", "engine.model.drafts"),
        ("engine:\n  model: {target: x}\n  cache: {blocksize: 8}\n", "engine.cache.blocksize"),
    ],
)
def test_unknown_key_names_path_and_file(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text, "typo.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{key}: unknown key" in msg
    assert str(path) in msg


def test_a_fleet_key_written_under_router_names_where_it_moved(tmp_path: Path) -> None:
    """A config of the layout before `fleet:` (its shape under `router:`) is refused, each old key named with its new
    place, and never read as a one-instance fleet."""
    path = write(tmp_path, "engine:\n  model: {target: x}\nrouter:\n  instances: 3\n  pipeline_stages: 2\n"
                           "  instance_num_cpus: 0.5\n  instance_resources: {gpu_a: 1}\n  dispatch: round_robin\n"
                           "  autoscaling: {min_instances: 3, max_instances: 4}\n", "old.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert lines == [f"{path}: router.{key}: moved to fleet.{key}: write it there" for key in
                     ("instances", "pipeline_stages", "instance_num_cpus", "instance_resources", "autoscaling")]
    moved = load_config(write(tmp_path, "engine:\n  model: {target: x}\nfleet:\n  instances: 3\n  pipeline_stages: 2\n"
                                        "  instance_num_cpus: 0.5\n  instance_resources: {gpu_a: 1}\n"
                                        "router: {dispatch: round_robin}\n", "new.yaml"))
    assert (moved.fleet.instances, moved.fleet.pipeline_stages, moved.fleet.instance_num_cpus) == (3, 2, 0.5)
    assert moved.fleet.instance_resources == {"gpu_a": 1.0} and moved.router.dispatch == "round_robin"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("engine:\n  model: {target: x}\n  speculation: {k: many}\n", "engine.speculation.k"),
        ("engine:\n  model: {target: x, dtype: fp8}\n", "engine.model.dtype"),
        ("engine:\n  model: {target: x}\n  cache: {block_size: 0}\n", "engine.cache.block_size"),
        ("engine:\n  model: {target: x, draft_layers: [a]}\n", "engine.model.draft_layers.0"),
        ("engine:\n  model: {}\n", "engine.model.target"),
    ],
)
def test_wrong_value_names_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"{path}: {key}:"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="no such config file") as err:
        load_config(path)
    assert str(path) in str(err.value)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "engine: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, text))


def test_draft_and_draft_layers_together_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  model: {target: t, draft: d, draft_layers: [0, 1]}\n")
    with pytest.raises(ConfigError, match="either draft or draft_layers") as err:
        load_config(path)
    assert "engine.model" in str(err.value)


def test_empty_draft_layers_is_an_error() -> None:
    with pytest.raises(ConfigError, match="at least one layer"):
        parse_config({"engine": {"model": {"target": "t", "draft_layers": []}}})


def test_a_token_budget_below_the_batch_size_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"engine.scheduler: .*at least max_batch_size"):
        parse_config({"engine": {"model": {"target": "t"},
                                 "scheduler": {"max_batch_size": 8, "max_num_batched_tokens": 4}}})


def test_an_unknown_speculation_policy_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"engine.speculation.policy: .*'fixed', 'off' or 'goodput'"):
        parse_config({"engine": {"model": {"target": "t"}, "speculation": {"policy": "smart"}}})


def test_parse_config_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"^inline: engine: Field required"):
        parse_config({}, source="inline")


@pytest.mark.parametrize(
    ("obj", "field", "value"),
    [
        (ModelConfig(target="t"), "target", "u"),
        (SpeculationConfig(), "k", 2),
        (CacheConfig(), "num_blocks", 4),
        (EngineConfig(model=ModelConfig(target="t")), "scheduler", None),
        (SchedulerConfig(), "max_batch_size", 1),
        (SpecfleetConfig(engine=EngineConfig(model=ModelConfig(target="t"))), "engine", None),
    ],
)
def test_configs_are_frozen(obj: pydantic.BaseModel, field: str, value: object) -> None:
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        setattr(obj, field, value)


def test_loaded_config_is_frozen_and_hashable() -> None:
    cfg = load_config(DEFAULT)
    with pytest.raises(pydantic.ValidationError):
        cfg.engine.model.draft_layers = (0,)  # type: ignore[misc]
    assert hash(cfg) == hash(load_config(DEFAULT))


def test_expert_parallel_ranks_need_as_many_planned_slots() -> None:
    raw = {"engine": {"model": {"target": "m.gguf"}, "experts": {"ranks": 2}}}
    with pytest.raises(ConfigError, match="set fleet.pipeline_stages to 2"):
        parse_config(raw)
    cfg = parse_config({**raw, "fleet": {"pipeline_stages": 2}})
    assert cfg.engine.experts.enabled and cfg.engine.experts.plan is None and cfg.engine.experts.slack == 2
    with pytest.raises(ConfigError, match="engine.experts.ranks"):
        parse_config({"engine": {"model": {"target": "m.gguf"}, "experts": {"ranks": 0}}})
