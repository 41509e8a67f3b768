"""Requests, sampling parameters and checkpoints that cannot be served fail early with a message naming the problem."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from actors.engine.core import Engine, RequestError
from actors.model.loader import SUPPORTED_ARCHITECTURES, ModelLoadError, UnsupportedArchitecture, load_model
from actors.engine.offline import generate
from cluster.config import SpeculationConfig
from cluster.request import InvalidRequest, Request, SamplingParams, check_prompt, context_length
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.helpers import load, runner

CONTEXT = 256  # the tiny models' max_position_embeddings


@pytest.fixture
def engine(tiny_models) -> Engine:
    return Engine(runner(load(tiny_models["llama"])), None, SpeculationConfig(k=0))


def request(prompt, max_tokens: int = 4, rid: str = "r") -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))


# ---- requests --------------------------------------------------------------------------------------
def test_empty_prompt(engine: Engine) -> None:
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(request([]))
    assert not engine.has_unfinished()


def test_prompt_as_long_as_the_context(engine: Engine) -> None:
    assert engine.max_model_len == CONTEXT
    with pytest.raises(RequestError, match=rf"{CONTEXT} tokens.*context is {CONTEXT}"):
        engine.add_request(request([5] * CONTEXT, max_tokens=1))
    engine.add_request(request([5] * (CONTEXT - 1), max_tokens=1))  # one short of it is fine


def test_prompt_plus_max_tokens_beyond_the_context(engine: Engine) -> None:
    with pytest.raises(RequestError, match=r"max_tokens \(11\).*context of 256"):
        engine.add_request(request([5] * 250, max_tokens=11))
    engine.add_request(request([5] * 250, max_tokens=6))


def test_engine_max_model_len_caps_the_context(tiny_models) -> None:
    engine = Engine(runner(load(tiny_models["llama"])), None, SpeculationConfig(k=0), max_model_len=32)
    with pytest.raises(RequestError, match="context of 32"):
        engine.add_request(request([5] * 30, max_tokens=3))


def test_a_request_the_kv_cache_can_never_hold_is_refused_before_it_runs(tiny_models) -> None:
    """The context is capped at what the cache holds (usable blocks * block_size): a request that fits the model's
    context but not the cache is refused when it is added (a 400 before anything streams), not failed mid-run."""
    small = Engine(runner(load(tiny_models["llama"]), num_blocks=17), None, SpeculationConfig(k=0))  # 16 usable
    assert small.max_model_len == 16 * 4 < CONTEXT
    with pytest.raises(RequestError, match="context") as e:
        small.add_request(request([1] * 40, max_tokens=40))
    assert e.value.param == "max_tokens" and not small.has_unfinished()
    out = generate(small, [[1] * 40], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(out.token_ids) == 24  # the whole cache, served
    assert context_length(CONTEXT, None, cache_tokens=64) == 64 and context_length(CONTEXT, 32, 64) == 32
    assert context_length(CONTEXT, None) == CONTEXT


@pytest.mark.parametrize("bad", [360, 10_000, -1])
def test_token_id_outside_the_vocabulary(engine: Engine, bad: int) -> None:
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 360\)"):
        engine.add_request(request([5, bad, 7]))
    assert not engine.has_unfinished()


def test_duplicate_request_id(engine: Engine) -> None:
    engine.add_request(request([5, 6], rid="same"))
    with pytest.raises(RequestError, match="'same' is already in use"):
        engine.add_request(request([7, 8], rid="same"))
    engine.step()  # the first one is now running: still taken
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request(request([7, 8], rid="same"))


def test_generate_with_a_bad_prompt_leaves_nothing_behind(engine: Engine) -> None:
    with pytest.raises(RequestError, match="empty"):
        generate(engine, [[5, 6, 7], []], SamplingParams(temperature=0, max_tokens=4))
    assert not engine.has_unfinished()


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("stop", ["ok", ""]), ("unknown_field", 1), ("temperature", 2.5), ("seed", -1), ("seed", 2**63),
    ("stop", [str(i) for i in range(17)]), ("max_tokens", "12"), ("max_tokens", 12.0), ("ignore_eos", "yes"),
])
def test_invalid_sampling_params(field: str, value) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)


def test_sampling_params_accept_a_single_stop_string() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], seed=2**63 - 1, temperature=2).stop == ("a", "b")


def test_the_prompt_checks_are_one_function_naming_the_field() -> None:
    assert check_prompt([1, 2, 3], None, max_model_len=10, vocab_size=50) == 7  # None: the rest of the context
    assert check_prompt([1, 2, 3], 7, max_model_len=10, vocab_size=50) == 7
    for ids, max_tokens, param in [([], 1, "prompt"), ([50], 1, "prompt"), (list(range(10)), 1, "prompt"),
                                   ([1, 2, 3], 8, "max_tokens")]:
        with pytest.raises(InvalidRequest) as info:
            check_prompt(ids, max_tokens, max_model_len=10, vocab_size=50)
        assert info.value.param == param


# ---- checkpoints -----------------------------------------------------------------------------------
def test_unknown_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")

    with pytest.raises(UnsupportedArchitecture) as info:
        load_model(str(tmp_path / "gpt2"))

    message = str(info.value)
    assert "gpt2" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)
    assert isinstance(info.value, ModelLoadError)


@pytest.mark.parametrize("source", ["/nonexistent/x.gguf", "./missing-dir", "~/no/such/model"])
def test_missing_file_or_folder(source: str) -> None:
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_model(source)
    assert source in str(info.value)


def test_a_folder_without_a_model(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="empty"):
        load_model(str(tmp_path / "empty"))


def test_a_file_that_is_not_gguf(tmp_path: Path, tiny_models) -> None:
    weights = next(Path(tiny_models["llama"]).glob("*.safetensors"))
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(weights))
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(text))


def test_a_gguf_named_file_that_is_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"this is not a GGUF file at all" * 10)
    with pytest.raises(ModelLoadError, match="fake.gguf"):
        load_model(str(fake))


def test_unsupported_dtype(tiny_models) -> None:
    with pytest.raises(ModelLoadError, match="fp32"):
        load_model(str(tiny_models["llama"]), "int4")


def test_draft_with_a_different_vocabulary(tiny_models, tmp_path: Path) -> None:
    target = load(tiny_models["llama"])
    other = load_model(str(build_tiny_model("llama", tmp_path / "wide", vocab_size=400)))
    assert other.config.vocab_size == 400

    with pytest.raises(ValueError, match=r"draft vocabulary \(400\).*\(360\)"):
        Engine(runner(target), runner(other), SpeculationConfig(k=3))
