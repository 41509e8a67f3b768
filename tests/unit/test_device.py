"""Device plumbing: runner, cache and engine take a device and every tensor they create lands on it.

On this CPU machine two checks can fail where a tensor would go astray: on `meta` (allocation, and a runner's
whole forward: a tensor made on the CPU beside meta ones raises), and, on `cpu`, a record of every tensor
factory call of a speculative generate (each must name its device; one that relies on the CPU default would
put a GPU engine's tensors on the CPU). A source scan keeps `.cpu()` and `.to("cpu")` out of the data plane.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from actors.model.device import DeviceError, resolve_device
from actors.engine.core import Engine
from actors.kv.cache import KVCache
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SpeculationConfig
from cluster.request import SamplingParams
from tests.unit.helpers import load, reference_greedy, text_prompts

CACHE = CacheConfig(block_size=4, num_blocks=64)
META = torch.device("meta")
ACTORS = Path(__file__).resolve().parents[2] / "actors"


def test_a_cache_allocates_on_its_device_and_its_slots_live_there() -> None:
    cache = KVCache([0, 1], num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, device="meta")
    assert cache.k.device == cache.v.device == META and cache.k.shape == (2, 8, 4, 2, 8)
    assert cache.reserve("r", 6)
    assert cache.slots("r", 0, 6).device == META


def test_a_runner_on_meta_holds_its_weights_and_cache_there_and_runs_a_forward(tiny_models) -> None:
    model = load_model(str(tiny_models["llama"]), device="meta")
    r = ModelRunner(model, range(model.num_layers), CACHE)
    assert r.device == META and r.cache.k.device == META
    assert all(p.device == META for p in model.hf_model.parameters())

    logits = r.forward([SeqChunk("a", (1, 2, 3, 4, 5)), SeqChunk("b", (6, 7), num_logits=2)])

    assert logits.device == META and logits.shape == (3, model.config.vocab_size)


def test_a_runner_given_a_device_moves_only_the_layers_it_runs(tiny_models) -> None:
    model = load_model(str(tiny_models["llama"]))  # on the CPU
    stage = ModelRunner(model, [2, 3], CACHE, first=False, last=True, device="meta")
    hf = model.hf_model.model
    assert all(p.device == META for i in (2, 3) for p in hf.layers[i].parameters())
    assert all(p.device.type == "cpu" for i in (0, 1) for p in hf.layers[i].parameters())
    assert stage.cache.k.device == META and stage.device == META
    hidden = stage.forward([SeqChunk("a", (1, 2, 3))], torch.empty(3, model.config.hidden_size, device=META))
    assert hidden.device == META


def test_an_engine_loads_its_pair_onto_the_device_it_is_given(tiny_models, tiny_draft_models) -> None:
    cfg = EngineConfig(model=ModelConfig(target=str(tiny_models["llama"]), draft=str(tiny_draft_models["llama"])),
                       speculation=SpeculationConfig(policy="fixed", k=2), cache=CACHE)
    engine = Engine.from_config(cfg, device="meta")
    assert engine.device == META
    for runner in (engine.target, engine.draft):
        assert runner.cache.k.device == META and all(p.device == META for p in runner.model.hf_model.parameters())


FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
             torch.randint}


class FactoryCalls(TorchFunctionMode):
    """Records every tensor factory call that names no device (it would land on the default device)."""

    def __init__(self) -> None:
        super().__init__()
        self.unplaced: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.unplaced.append(func.__name__)
        return func(*args, **kwargs)


def test_a_speculative_generate_creates_no_tensor_without_naming_its_device(tiny_models, tiny_draft_models) -> None:
    cfg = EngineConfig(model=ModelConfig(target=str(tiny_models["llama"]), draft=str(tiny_draft_models["llama"]),
                                         device="cpu"),
                       speculation=SpeculationConfig(policy="fixed", k=3), cache=CACHE)
    engine = Engine.from_config(cfg)
    prompts = text_prompts(load(tiny_models["llama"]), 2, offset=4)
    params = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.8, seed=3, max_tokens=10)]

    with FactoryCalls() as calls:
        greedy, sampled = generate(engine, prompts, params)

    assert calls.unplaced == []
    assert greedy.token_ids == reference_greedy(tiny_models["llama"], prompts[0], 10)
    assert sampled.stats.proposed > 0  # drafts were verified by rejection sampling too


def test_device_settings_resolve_on_a_machine_without_a_gpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("this check is for a machine without a GPU")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="sees no GPU"):
        resolve_device("cuda")


def _host_copies(path: Path) -> list[str]:
    """`x.cpu()` and `x.to("cpu")` / `x.to(device="cpu")` calls in a source file, as file:line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        cpu_arg = any(isinstance(a, ast.Constant) and a.value == "cpu" for a in node.args) or any(
            k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value == "cpu" for k in node.keywords)
        if node.func.attr == "cpu" or (node.func.attr == "to" and cpu_arg):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_data_plane_never_copies_to_the_cpu() -> None:
    files = sorted(ACTORS.rglob("*.py"))
    assert len(files) > 20
    assert [hit for f in files for hit in _host_copies(f)] == []


def test_the_source_scan_finds_a_host_copy(tmp_path) -> None:
    bad = tmp_path / "probe.py"  # the scan must be able to fail: a file with each form, and a legal move
    bad.write_text('x = t.cpu()\ny = t.to("cpu")\nz = t.to(device="cpu")\nw = t.to(dev)\n')
    assert _host_copies(bad) == ["probe.py:1", "probe.py:2", "probe.py:3"]
