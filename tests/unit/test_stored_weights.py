"""Weights computed as stored (`engine.model.weights`): a quantized GGUF model's logits on its int4 kernels equal
the dequantized path's in fp32, through the file itself or the folder converted from it; speculation on the
same weights is lossless; and odd widths (a hidden size of 72) never reach a kernel that crashes on them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from actors.engine.core import Engine
from actors.model.convert import converted
from actors.model.deterministic import Tiled
from actors.model.loader import ModelLoadError, load_model
from actors.model.metadata import SeqChunk
from actors.model.qlinear import Int4Linear, Int8Linear
from actors.model.runner import ModelRunner
from actors.model.weights import Concat
from actors.engine.offline import generate
from cluster.config import CacheConfig, SpeculationConfig
from cluster.request import SamplingParams
from tests.fixtures.tiny_models import build_tiny_model, write_tiny_gguf
from tests.unit.helpers import isa_params, text_prompts

# q, k, gate, up, o and the head in Q4_0; v in Q8_0 (two planes, so qkv is two kernel calls); down in Q5_1
MIXED = {"attn_v.weight": Q.Q8_0, "ffn_down.weight": Q.Q5_1, "weight": Q.Q4_0}
CACHE = CacheConfig(block_size=4, num_blocks=256)
ATOL = 1e-4  # fp32: the int4 kernel's sums differ from the dense matmul's by rounding only


@pytest.fixture(scope="module")
def quantized_gguf(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_models["llama"], tmp_path_factory.mktemp("q-gguf") / "tiny-llama-q.gguf", MIXED)


def logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    return runner.forward([SeqChunk("r", tuple(prompt), len(prompt))])  # (T, V)


def greedy(engine: Engine, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    """Each prompt's greedy continuation, one request at a time; the engine must accept some drafts if it has a
    drafter (else the comparison would prove nothing about speculation)."""
    done = [generate(engine, [p], SamplingParams(temperature=0.0, max_tokens=n))[0] for p in prompts]
    assert engine.drafter is None or sum(c.stats.accepted for c in done) > 0
    return [c.token_ids for c in done]


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_stored_blocks_fuse_by_format_and_compute_the_dequantized_paths_logits(quantized_gguf: Path,
                                                                               activations: str) -> None:
    """bf16: the kernels each projection lands on (fp32 holds the stored weights exactly and runs them dense), whose
    logits are near the dequantized path's, nearer with bf16 inputs than with int8 ones; fp32: the stored path's
    logits are the dequantized path's."""
    model = load_model(str(quantized_gguf), "bf16", weights="stored", activations=activations)
    stored = ModelRunner(model, range(model.num_layers), CACHE)
    layer = stored.layers[0]
    assert isinstance(layer.attn.qkv_proj, Concat)  # Q4_0 q, k in one call, Q8_0 v (two planes) in another
    assert [p.planes for p in layer.attn.qkv_proj.parts] == [1, 2]
    assert isinstance(layer.ffn.gate_up_proj, Int4Linear) and layer.ffn.down_proj.planes == 2
    assert isinstance(stored.lm_head, Int4Linear)  # vocab 360: a partial last block of rows
    exact = load_model(str(quantized_gguf), "fp32", weights="stored")
    fp32 = ModelRunner(exact, range(exact.num_layers), CACHE)
    dense = ModelRunner(exact, range(exact.num_layers), CACHE, weights="dequantized")
    for prompt in text_prompts(exact, 3):
        want = logits(dense, prompt)
        torch.testing.assert_close(logits(fp32, prompt), want, rtol=0, atol=ATOL)
        got = logits(stored, prompt).float()
        # int8 inputs: each row's rounding per group of 32 adds to bf16's (measured here: at most 0.21 std, 4% of the
        # logits' norm; the real models' figures are in docs/weights.md)
        assert float((got - want).abs().max()) < (0.1 if activations == "bf16" else 0.3) * float(want.std())


def test_a_converted_folder_computes_on_the_gguf_it_came_from(quantized_gguf: Path, tmp_path: Path) -> None:
    src = tmp_path / "models" / quantized_gguf.name
    src.parent.mkdir()
    shutil.copy2(quantized_gguf, src)
    folder = converted(src, tmp_path / "converted", "fp32")
    model = load_model(str(folder), "fp32", weights="stored")
    assert model.stored is not None and model.stored.path == src.resolve()
    runner = ModelRunner(model, range(model.num_layers), CACHE)
    direct = load_model(str(src), "fp32", weights="stored")
    prompt = text_prompts(model, 1)[0]
    want = logits(ModelRunner(direct, range(direct.num_layers), CACHE), prompt)
    torch.testing.assert_close(logits(runner, prompt), want, rtol=0, atol=ATOL)
    src.write_bytes(src.read_bytes()[:-1] + b"\0")  # the source changed: its blocks are no longer the folder's
    with pytest.raises(ModelLoadError, match="gone or changed"):
        load_model(str(folder), "fp32", weights="stored")
    assert load_model(str(folder), "fp32").stored is None  # the dequantized folder itself still loads


# bf16 batch invariance is our kernels': bf16 on each ISA of ours this CPU has; fp32 on whatever runs by default
@pytest.mark.parametrize("dtype,kernel_isa", [pytest.param("fp32", "auto", id="fp32")] + [
    pytest.param("bf16", p.values[0], marks=p.marks, id=f"bf16-{p.values[0]}") for p in isa_params()],
    indirect=["kernel_isa"])
def test_speculation_on_stored_weights_is_lossless(quantized_gguf: Path, dtype: str, kernel_isa: str) -> None:
    """Speculative output equals the plain decoding of the same stored weights, with a self-draft of the target's
    layers sharing its projections and with that draft re-quantized to int8: in fp32, and in bf16 on the int4
    kernels (no near-tie flips where a token's logits do not depend on its batch: tests/unit/test_cpu_kernels.py)."""
    model = load_model(str(quantized_gguf), dtype, weights="stored")
    target = ModelRunner(model, range(model.num_layers), CACHE)
    prompts = text_prompts(model, 4, offset=2)
    plain = greedy(Engine(target, None, SpeculationConfig(policy="off")), prompts)
    shared = ModelRunner(model, [0, 3], CACHE)
    assert shared.layers[0].attn.qkv_proj is target.layers[0].attn.qkv_proj  # built once, shared
    int8_draft = ModelRunner(model, [0, 2, 3], CACHE, weights="int8")
    assert isinstance(int8_draft.layers[0].attn.qkv_proj, Int8Linear if dtype == "fp32" else Int4Linear)
    for draft in (shared, int8_draft):
        assert greedy(Engine(target, draft, SpeculationConfig(policy="fixed", k=3)), prompts) == plain


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_odd_hidden_size_runs_quantized_at_load_and_stays_lossless(tmp_path: Path, weights: str) -> None:
    """Hidden size 72: int8's kernel needs K % 16 == 0, int4's groups of 32 do not fit 72, so these layers take
    the fallbacks; a crash here would be the segfault the guard prevents."""
    path = build_tiny_model("llama", tmp_path / "llama72", hidden_size=72, head_dim=18)
    model = load_model(str(path), "fp32", weights=weights)
    target = ModelRunner(model, range(model.num_layers), CACHE)
    qkv = target.layers[0].attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and not qkv.fused  # 72 % 16 != 0: the dense matmul of the codes
    assert isinstance(target.layers[0].ffn.down_proj, Int4Linear if weights == "int4" else Int8Linear)  # K = 128
    dense = ModelRunner(model, range(model.num_layers), CACHE, weights="dequantized")
    prompt = text_prompts(model, 1)[0]
    got, want = logits(target, prompt), logits(dense, prompt)
    assert not torch.equal(got, want)  # quantized at load: a nearby model, not the same one
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)) > 0.95
    prompts = text_prompts(model, 3, offset=5)
    plain = greedy(Engine(target, None, SpeculationConfig(policy="off")), prompts)
    draft = ModelRunner(model, [0, 3], CACHE, weights="int8")
    assert greedy(Engine(target, draft, SpeculationConfig(policy="fixed", k=3)), prompts) == plain


def test_a_safetensors_model_computes_as_stored_that_is_dense(tiny_models) -> None:
    model = load_model(str(tiny_models["qwen2"]), "fp32", weights="stored")
    assert model.stored is None
    runner = ModelRunner(model, range(model.num_layers), CACHE)
    assert isinstance(runner.layers[0].attn.qkv_proj, torch.nn.Linear)
    prompt = text_prompts(model, 1)[0]
    with torch.no_grad():
        hf = model.hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits(runner, prompt), hf, rtol=0, atol=ATOL)  # fused views of the same weights


@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
def test_deterministic_mode_takes_a_projection_of_mixed_formats(quantized_gguf: Path, kernel_isa: str) -> None:
    """A fused projection of two kernel calls (Q4_0 q, k beside Q8_0 v, as Q4_K_M's q, k beside a Q6_K v) runs in the
    batch-invariant forward, each part row-invariant (the default config's `deterministic: true` on such a file
    failed to load: the whole projection was wrapped as one linear map): k+1 verified positions beside another
    request's decode give the logits of one-token steps, bit for bit, in bf16."""
    model = load_model(str(quantized_gguf), "bf16", weights="stored")
    runner = ModelRunner(model, range(model.num_layers), CACHE, deterministic=True)
    qkv = runner.layers[0].attn.qkv_proj
    assert isinstance(qkv, Concat) and all(isinstance(p, Tiled) or p.invariant for p in qkv.parts)
    prompt, other = text_prompts(model, 2)
    for rid, p in (("a", prompt), ("b", prompt), ("c", other)):
        assert runner.reserve(rid, len(p) + 8)
        runner.forward([SeqChunk(rid, tuple(p), 1)])
    drafts = (5, 6, 7, 8)
    together = runner.forward([SeqChunk("c", (3,), 1), SeqChunk("a", drafts, len(drafts))])[1:]  # (k+1, V)
    alone = torch.cat([runner.forward([SeqChunk("b", (t,), 1)]) for t in drafts])
    assert torch.equal(together, alone), float((together.float() - alone.float()).abs().max())
