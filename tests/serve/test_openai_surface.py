"""The OpenAI surface with the official client over real Ray Serve (speculation on, fp32): logprobs, prompt
scoring, penalties and bias, structured outputs; each held to a transformers forward of the same tiny target."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from tests.serve.conftest import API_KEY, MODEL, ServedApp
from tests.unit.helpers import load, reference_greedy, text_prompts

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(served_app: ServedApp) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served_app.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


def log_softmax(app: ServedApp, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the sequence (fp32): row i is the distribution after token i."""
    model = load(app.target).hf_model
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def processed_greedy(app: ServedApp, prompt: list[int], n: int, repetition: float, frequency: float,
                     bias: dict[int, float]) -> list[int]:
    """Plain greedy decoding with HF's repetition penalty, OpenAI's frequency penalty and a logit bias."""
    model, tokens = load(app.target).hf_model, list(prompt)
    for _ in range(n):
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            out = tokens[len(prompt):]
            seen = torch.tensor(sorted(set(tokens)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
            logits -= frequency * torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel())
            for t, b in bias.items():
                logits[t] += b
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_completion_logprobs_streamed_and_not_equal_a_transformers_forward(client, served_app: ServedApp) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=31)[0]
    args = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    done = client.completions.create(**args)
    lp = done.choices[0].logprobs
    tokens = reference_greedy(served_app.target, prompt, 10)
    ref = log_softmax(served_app, prompt + tokens)
    strings = load(served_app.target).tokenizer
    n = len(tokens)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for j in range(n):
        assert lp.tokens[j] == strings.decode([tokens[j]])
        assert lp.token_logprobs[j] == pytest.approx(float(ref[len(prompt) + j - 1, tokens[j]]), abs=1e-4)
        top = ref[len(prompt) + j - 1].topk(3)
        assert {strings.decode([t]) for t in top.indices.tolist()} <= set(lp.top_logprobs[j])
    assert lp.text_offset == [sum(map(len, lp.tokens[:j])) for j in range(n)]
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [o for c in chunks if c.choices and c.choices[0].logprobs
            for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_as_a_transformers_forward(client, served_app: ServedApp) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=7)[0]
    ref = log_softmax(served_app, prompt)
    args = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    for stream in (False, True):
        if stream:
            chunks = [c for c in client.completions.create(**args, stream=True) if c.choices]
            [lp] = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
            text = "".join(c.choices[0].text for c in chunks)
        else:
            done = client.completions.create(**args)
            lp, text = done.choices[0].logprobs, done.choices[0].text
            assert done.usage.completion_tokens == 0
        assert text == load(served_app.target).tokenizer.decode(prompt)
        assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for j in range(1, len(prompt)):
            assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-4)


def test_chat_logprobs_carry_top_logprobs_per_token_streamed_and_not(client) -> None:
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=2)
    done = client.chat.completions.create(**args)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens > 0
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
    streamed = [e for c in client.chat.completions.create(**args, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_penalties_and_logit_bias_give_plain_decoding_with_them(client, served_app: ServedApp) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=13)[0]
    plain = processed_greedy(served_app, prompt, 12, 1.0, 0.0, {})
    bias = {plain[0]: -100.0, plain[3]: 5.0}
    want = processed_greedy(served_app, prompt, 12, 1.5, 0.4, bias)
    assert want != plain  # the request below must change the output
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=0.4,
        logit_bias={str(t): b for t, b in bias.items()}, logprobs=0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True})
    tokenizer = load(served_app.target).tokenizer
    assert done.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in want]


def test_json_schema_output_parses_and_validates(client) -> None:
    for stream in (False, True):
        args = dict(model=MODEL, messages=[{"role": "user", "content": "a color"}], max_tokens=64, temperature=0,
                    response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
                           if c.choices)
        else:
            done = client.chat.completions.create(**args)
            assert done.choices[0].finish_reason == "stop"
            text = done.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
    regex = client.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=0,
                                      extra_body={"guided_regex": "[a-c]{2,4}"}).choices[0].text
    assert 2 <= len(regex) <= 4 and set(regex) <= set("abc")


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}},
     "response_format", "invalid structured output"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid structured output"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output"),
    # the tiny llama's template names no tool-call format: calls need a parser (docs/serving.md, tool calling)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "needs a tool-call parser"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "token ids must be in"),
    ({"logit_bias": {"one": 1}}, "logit_bias", "keys must be token ids"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids", "token ids must be in"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "structured output"),
])
def test_bad_structured_outputs_tools_and_token_ids_are_400s_naming_the_field(client, extra, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    assert e.value.body["param"] == param and words in e.value.body["message"]
