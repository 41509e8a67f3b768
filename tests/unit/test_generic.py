"""The generic path (transformers' decoder layers on our paged cache) gives transformers' own logits for every family
it takes: whole prompts, varlen batches, pipeline stages, EasySpec's halves; what it cannot run is refused in a line."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoConfig

from actors.kv.cache import reshard
from actors.model.generic_runner import GenericRunner
from actors.model.loader import UnsupportedArchitecture, load_model, load_model_config
from actors.model.metadata import SeqChunk
from actors.speculation import easyspec
from cluster.config import CacheConfig, DraftParallelConfig
from tests.fixtures.tiny_models import GENERIC_FAMILIES, build_tiny_model, write_tiny_gguf
from tests.unit.helpers import load as load_any
from tests.unit.helpers import runner, text_prompts
from tests.unit.test_runner import ATOL, hf_logits, run_in_two_chunks


def load(path):
    """The model on the generic path (Qwen3, Qwen3-MoE and Gemma 3 take the native one by default)."""
    return load_any(path, "generic")


def prompts_of(model, n: int = 3) -> list[list[int]]:
    """Real-text prompts of 40, 9 and 31 tokens: the long ones cross the 6-token windows and many 4-slot blocks."""
    return text_prompts(model, n)


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_a_full_prompt_gives_transformers_logits(tiny_generic_models, family: str) -> None:
    model = load(tiny_generic_models[family])
    assert model.backend == "generic" and family in model.plan.reason
    r = runner(model)
    assert isinstance(r, GenericRunner)
    prompt = prompts_of(model)[0]

    logits = r.forward([SeqChunk("a", tuple(prompt), num_logits=len(prompt))])

    torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_a_varlen_batch_of_prefill_chunks_verification_rows_and_decodes_equals_each_sequence(
        tiny_generic_models, family: str) -> None:
    """One forward holds a prefill chunk (every row's logits), k+1 = 4 verification rows and a single decode (a batch:
    attention gathers block tables; the full-prompt test reads one sequence's blocks in place)."""
    model = load(tiny_generic_models[family])
    a, b, c = prompts_of(model)  # 40, 9, 31 tokens
    r = runner(model)
    r.forward([SeqChunk("a", tuple(a[:20])), SeqChunk("b", tuple(b[:5])), SeqChunk("c", tuple(c[:30]))])

    got = r.forward([SeqChunk("a", tuple(a[20:33]), num_logits=13), SeqChunk("b", tuple(b[5:9]), num_logits=4),
                     SeqChunk("c", (c[30],), num_logits=1)])

    want = torch.cat([hf_logits(model, a)[20:33], hf_logits(model, b)[5:9], hf_logits(model, c)[30:31]])
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_two_pipeline_stages_give_the_whole_models_logits(tiny_generic_models, family: str) -> None:
    model = load(tiny_generic_models[family])
    prompts = prompts_of(model)
    first, second = runner(model, [0, 1], last=False), runner(model, [2, 3], first=False)
    assert first.lm_head is None and second.embed is None

    got = run_in_two_chunks([first, second], prompts, splits=[30, 4, 2])

    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)


SPLITTABLE = [f for f in GENERIC_FAMILIES if f != "phi"]  # Phi runs attention and MLP side by side on one norm


@pytest.mark.parametrize("family", SPLITTABLE)
def test_easyspec_halves_in_true_order_are_the_layer(tiny_generic_models, family: str) -> None:
    """EasySpec's attention mode splits each layer into its attention and feed-forward halves; run in true order
    (groups of one) they must give the whole model's logits, whatever the layer's norm layout (pre-norm, Gemma's
    sandwich, OLMo 2's post-norm, Granite's residual multiplier)."""
    model = load(tiny_generic_models[family])
    prompt = prompts_of(model)[0]
    r = runner(model)
    easyspec.enable(r, DraftParallelConfig(group_size=2, sequential_head=1, sequential_tail=1, mode="attention"))

    exact = r.forward([SeqChunk("a", tuple(prompt), num_logits=len(prompt))], parallel=False)
    parallel = r.forward([SeqChunk("b", tuple(prompt), num_logits=len(prompt))], parallel=True)

    torch.testing.assert_close(exact, hf_logits(model, prompt), rtol=0, atol=ATOL)
    assert parallel.shape == exact.shape and not torch.allclose(parallel, exact)  # the groups do run in parallel


@pytest.mark.parametrize("mode", ["attention", "layer"])
def test_easyspec_refuses_a_layer_without_halves_when_it_is_enabled(tiny_generic_models, mode: str) -> None:
    """EasySpec's steps run a layer's halves apart (its singletons too, in either mode): Phi's attention and MLP
    read one norm side by side, so a draft of it is refused when the groups are set up, not in a forward."""
    r = runner(load(tiny_generic_models["phi"]))
    with pytest.raises(ValueError, match="PhiDecoderLayer layout does not split"):
        easyspec.enable(r, DraftParallelConfig(group_size=2, sequential_head=1, sequential_tail=1, mode=mode))
    assert r.layer_parallel is None


def test_a_draft_by_layer_subset_shares_the_weights_and_keeps_its_own_cache(tiny_generic_models) -> None:
    model = load(tiny_generic_models["gemma3_text"])
    prompt = prompts_of(model)[0]
    target, draft = runner(model), runner(model, [0, 3])
    assert draft.layers[0].module is target.layers[0].module and draft.cache is not target.cache

    draft.forward([SeqChunk("a", tuple(prompt[:7]))])
    logits = target.forward([SeqChunk("a", tuple(prompt), num_logits=len(prompt))])

    assert draft.cache.length("a") == 7 and target.cache.length("a") == len(prompt)
    torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)


def test_a_native_family_forced_onto_the_generic_path_matches_the_native_runner(tiny_models) -> None:
    native = load_any(tiny_models["mistral"])
    forced = load_model(str(tiny_models["mistral"]), "fp32", backend="generic")
    assert (native.backend, forced.backend) == ("native", "generic") and "forced" in forced.plan.reason
    prompts = prompts_of(native)

    got = run_in_two_chunks([runner(forced)], prompts, splits=[25, 1, 13])
    want = run_in_two_chunks([runner(native)], prompts, splits=[25, 1, 13])

    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL)


def test_kv_export_import_and_crop_round_trip(tiny_generic_models) -> None:
    """A generic-path request's KV moves to another runner (a migration's import) and decodes on there as if it
    had never moved; a crop drops rejected tokens exactly."""
    model = load(tiny_generic_models["gpt_oss"])
    prompt = prompts_of(model)[0]
    src, dst = runner(model), runner(model)
    src.forward([SeqChunk("a", tuple(prompt[:30]))])
    src.forward([SeqChunk("a", (prompt[30], 7, 8, 9))])  # three rejected draft tokens after the real one
    src.cache.crop("a", 31)

    assert dst.import_kv(reshard(src.export_kv("a"), [[0, 1], [2, 3]]))
    assert dst.cache.length("a") == 31
    logits = dst.forward([SeqChunk("a", tuple(prompt[31:]), num_logits=len(prompt) - 31)])

    torch.testing.assert_close(logits, hf_logits(model, prompt)[31:], rtol=0, atol=ATOL)


def test_quantized_weights_and_deterministic_mode_stay_on_the_native_path(tiny_generic_models) -> None:
    model = load(tiny_generic_models["qwen3"])
    with pytest.raises(ValueError, match="generic path computes on the checkpoint's dense weights"):
        runner(model).use_weights("int8")
    with pytest.raises(ValueError, match="native path only"):
        GenericRunner(model, range(model.num_layers), CacheConfig(), deterministic=True)


# ---- refusals: one line naming the reason, before any weight is read -------------------------------------------
def _config_only(tmp_path: Path, model_type: str, **kwargs) -> Path:
    """A folder with only a config.json: a load that got as far as reading weights would fail on the missing file."""
    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **kwargs).save_pretrained(folder)
    assert not any(p.suffix == ".safetensors" for p in folder.iterdir())
    return folder


@pytest.mark.parametrize(("model_type", "kwargs", "reason"), [
    ("deepseek_v3", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64}, "multi-head latent"),
    ("qwen3_next", {"num_hidden_layers": 4, "hidden_size": 64}, "hybrid model (layer types linear_attention)"),
    ("gpt2", {"n_layer": 2, "n_embd": 32, "n_head": 2}, "no single decoder ModuleList"),
    ("t5", {"num_layers": 1}, "encoder-decoder"),
])
def test_an_architecture_the_generic_path_cannot_run_is_refused_with_its_reason(tmp_path, model_type, kwargs,
                                                                                   reason) -> None:
    folder = _config_only(tmp_path, model_type, **kwargs)
    for load_it in (load_model_config, load_model):
        with pytest.raises(UnsupportedArchitecture) as info:
            load_it(str(folder))
        message = str(info.value)
        assert "\n" not in message and model_type in message and reason in message, message


def test_backend_native_refuses_a_family_without_hand_written_layers(tiny_generic_models) -> None:
    with pytest.raises(UnsupportedArchitecture, match="'gemma2' has no native path .no hand-written layers for gemma2"):
        load_model_config(str(tiny_generic_models["gemma2"]), backend="native")
    config = json.loads((tiny_generic_models["gemma2"] / "config.json").read_text())
    assert config["model_type"] == "gemma2"


# ---- GGUF files of a generic-path family: transformers' loader dequantizes, the generic path runs them --------------
@pytest.fixture(scope="module")
def tiny_qwen3_128(tmp_path_factory) -> Path:
    """A tiny qwen3 with transformers' default head_dim (qwen3's GGUF keys do not carry one)."""
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-hd128") / "qwen3", head_dim=128)


# Q8_0 blocks hold 32 weights: of the tiny qwen3's matrices (hidden 72), o_proj's rows (4 heads x 128) split into them
@pytest.mark.parametrize("quant", [None, {"attn_output.weight": gguf.GGMLQuantizationType.Q8_0}], ids=["f32", "q8_0"])
def test_a_gguf_file_of_a_generic_family_runs_on_the_generic_path(tiny_qwen3_128, tmp_path, quant) -> None:
    path = write_tiny_gguf(tiny_qwen3_128, tmp_path / "tiny-qwen3.gguf", quant)
    model = load_model(str(path), "fp32", weights="stored", backend="generic")  # the generic path: dequantized
    assert model.backend == "generic" and model.stored is None
    source = load_any(tiny_qwen3_128)  # the native path, from the folder
    prompts = prompts_of(source)

    got = run_in_two_chunks([runner(model)], prompts, splits=[20, 5, 30])

    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, hf_logits(model, prompt), rtol=0, atol=ATOL)  # its own forward
        if quant is None:  # F32: the very weights of the folder it was written from
            torch.testing.assert_close(logits, hf_logits(source, prompt), rtol=0, atol=ATOL)
