"""Qwen3, Qwen3-MoE and Gemma 3 on the hand-written layers (the native path, which `backend: auto` now picks for them):
transformers' own logits in fp32 (q/k norms, Gemma's sandwich of (1 + w) norms, GeGLU, sqrt(H) embeddings, local and
global RoPE, sliding windows crossing blocks, its score scale and final softcap), the same as the generic path's, and
speculation on them lossless (in bf16 on our CPU kernels too)."""

from __future__ import annotations

import gguf
import pytest
import torch

from actors.engine.core import Engine
from actors.model.generic_runner import GenericRunner
from actors.model.layers import DecoderLayer
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.moe import ep, shuffle
from actors.speculation import easyspec
from cluster.config import DraftParallelConfig, SpeculationConfig
from tests.fixtures.tiny_models import build_tiny_model, write_tiny_gguf
from tests.unit.helpers import isa_params, load, runner, text_prompts
from tests.unit.test_generic_lossless import check
from tests.unit.test_expert_parallel import ep_forward
from tests.unit.test_lossless import make_engine
from tests.unit.test_stored_weights import CACHE, greedy
from tests.unit.test_runner import ATOL, hf_logits, run_in_two_chunks

NEW_NATIVE = ("qwen3", "qwen3_moe", "gemma3_text")


@pytest.mark.parametrize("family", NEW_NATIVE)
def test_auto_picks_the_native_path_and_it_gives_transformers_logits(tiny_generic_models, family: str) -> None:
    model = load(tiny_generic_models[family])
    assert model.plan.describe() == f"native path (hand-written layers for {family})"
    r = runner(model)
    assert type(r) is ModelRunner and all(isinstance(layer, DecoderLayer) for layer in r.layers)
    prompt = text_prompts(model, 1)[0]  # 40 tokens: across Gemma's 6-token windows and many 4-slot blocks

    logits = r.forward([SeqChunk("a", tuple(prompt), num_logits=len(prompt))])

    torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", NEW_NATIVE)
def test_a_varlen_batch_and_two_stages_give_each_sequences_logits(tiny_generic_models, family: str) -> None:
    """Prefill chunks, k+1 verification rows and single decodes in one forward (a batch: gathered block tables), on
    the whole model and on two pipeline stages."""
    model = load(tiny_generic_models[family])
    prompts = text_prompts(model, 3)  # 40, 9, 31 tokens
    whole = run_in_two_chunks([runner(model)], prompts, splits=[25, 5, 30])
    split = run_in_two_chunks([runner(model, [0, 1], last=False), runner(model, [2, 3], first=False)], prompts,
                              splits=[33, 4, 30])
    for prompt, got, staged in zip(prompts, whole, split):
        want = hf_logits(model, prompt)
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        torch.testing.assert_close(staged, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", NEW_NATIVE)
def test_the_native_path_gives_the_generic_paths_logits(tiny_generic_models, family: str) -> None:
    path = tiny_generic_models[family]
    native, generic = load(path), load(path, "generic")
    assert isinstance(runner(generic), GenericRunner)
    prompts = text_prompts(native, 3)

    got = run_in_two_chunks([runner(native)], prompts, splits=[20, 1, 17])
    want = run_in_two_chunks([runner(generic)], prompts, splits=[20, 1, 17])

    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_easyspec_halves_in_true_order_are_the_layer(tiny_generic_models, family: str) -> None:
    """EasySpec's attention mode runs each native layer's halves apart: Gemma's norms after each half go with it."""
    model = load(tiny_generic_models[family])
    prompt = text_prompts(model, 1)[0]
    r = runner(model)
    easyspec.enable(r, DraftParallelConfig(group_size=2, sequential_head=1, sequential_tail=1, mode="attention"))

    exact = r.forward([SeqChunk("a", tuple(prompt), num_logits=len(prompt))], parallel=False)
    parallel = r.forward([SeqChunk("b", tuple(prompt), num_logits=len(prompt))], parallel=True)

    torch.testing.assert_close(exact, hf_logits(model, prompt), rtol=0, atol=ATOL)
    assert parallel.shape == exact.shape and not torch.allclose(parallel, exact)


@pytest.mark.parametrize(("family", "draft"), [("qwen3", "pair"), ("qwen3_moe", "pair"), ("gemma3_text", "pair"),
                                               ("gemma3_text", "layers"), ("qwen3", "ngram")])
def test_speculative_output_on_the_native_path_equals_greedy(tiny_generic_models, tiny_generic_drafts, family: str,
                                                             draft: str) -> None:
    engine = make_engine(tiny_generic_models, tiny_generic_drafts, family, draft, k=3)
    assert engine.target.model.backend == "native" and type(engine.target) is ModelRunner
    check(engine, tiny_generic_models, family, 4, draft)


# Q8_0 blocks hold 32 weights: of the tiny qwen3's matrices (hidden 72), o_proj's rows (4 heads x 128) split into them
def test_a_qwen3_gguf_runs_native_on_its_stored_blocks(tmp_path_factory) -> None:
    """llama.cpp's names of a Qwen3 file's tensors (no rotary row permutation, unlike llama's) and its q/k norms from
    the file: in fp32 the stored path's logits are the file's own transformers forward."""
    folder = build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-native") / "qwen3", head_dim=128)
    path = write_tiny_gguf(folder, folder.parent / "tiny-qwen3.gguf", {"attn_output.weight": gguf.GGMLQuantizationType.Q8_0})
    model = load_model(str(path), "fp32", weights="stored")
    assert model.backend == "native" and model.stored is not None
    r = runner(model)
    assert all(model.stored.get(f"model.layers.{i}.self_attn.o_proj") is not None for i in r.layer_ids)
    prompts = text_prompts(model, 3)

    got = run_in_two_chunks([r], prompts, splits=[20, 5, 30])

    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)


@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_bf16_on_our_kernels_speculation_equals_plain_decoding(tmp_path_factory, family: str,
                                                               kernel_isa: str) -> None:
    """Widths our CPU kernels take (hidden 64, head dim 32), weights int4 at load, bf16: the q/k norms ahead of the
    in-place RoPE kernel, Gemma's fp32 norms and GELU around the int4 projections; a self-draft of the target's own
    layers (sharing its projections) gives the plain greedy output."""
    folder = build_tiny_model(family, tmp_path_factory.mktemp(f"{family}-wide") / family, hidden_size=64,
                              head_dim=32, intermediate_size=128)
    model = load_model(str(folder), "bf16", weights="int4")
    assert model.backend == "native"
    target = ModelRunner(model, range(model.num_layers), CACHE)
    assert (target.layers[0].attn.fused is not None) == (kernel_isa != "torch")
    prompts = text_prompts(model, 4, offset=2)
    plain = greedy(Engine(target, None, SpeculationConfig(policy="off")), prompts)

    spec = greedy(Engine(target, ModelRunner(model, [0, 3], CACHE), SpeculationConfig(policy="fixed", k=3)), prompts)

    assert spec == plain


@pytest.mark.parametrize("enable", [ep.enable, shuffle.enable], ids=["expert parallel", "token shuffle"])
def test_qwen3_moe_expert_parallel_ranks_give_the_whole_models_logits(tiny_generic_models, enable) -> None:
    """Expert parallelism stays a native-path feature and Qwen3-MoE now has it: each rank's tokens (or, token
    shuffling, each rank's slice of the heads, q/k norms per head included) give the whole model's logits."""
    path = tiny_generic_models["qwen3_moe"]
    model = load(path)
    chunks = [SeqChunk(f"r{i}", tuple(p), 2) for i, p in enumerate(text_prompts(model, 4))]
    with torch.inference_mode():
        want = runner(model).forward(chunks)  # (4 * 2, V)
    shuffled = enable is shuffle.enable
    got, _, _ = ep_forward(path, 2, [chunks] * 2 if shuffled else [chunks[:2], chunks[2:]], enable=enable)
    for logits in got if shuffled else [torch.cat(got)]:  # shuffled: every rank runs every token
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
