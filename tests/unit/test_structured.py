"""Structured outputs: JSON schemas, JSON mode, regexes and choices, lossless under speculation.

Every output parses and validates, and equals plain constrained greedy decoding token for token, with a draft
model, an n-gram drafter and none (fp32, the tiny llama: a random model whose output only the grammar shapes).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import ValidationError

from actors.engine.core import Engine, RequestError
from actors.engine.offline import generate
from cluster.config import SchedulerConfig, SpeculationConfig
from cluster.request import InvalidRequest, Request, SamplingParams, StructuredOutput
from tests.unit.helpers import load, runner, text_prompts

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["x"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0,
                                                                               "maximum": 5}},
                                            "required": ["q"], "additionalProperties": False}},
     "required": ["p"], "additionalProperties": False},
    {"type": "string", "maxLength": 5},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "boolean"},
    {"enum": [1, 2, 3]},
    {"const": "fixed"},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "b": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
     "required": ["n"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]{1,3}$"}}, "required": ["s"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"i": {"type": "integer", "minimum": 0,
                                                                        "maximum": 2}},
                                "required": ["i"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "w": {"type": "string", "maxLength": 3}},
     "required": ["v", "w"], "additionalProperties": False},
]


def make_engine(tiny_models, tiny_draft_models, draft: str) -> Engine:
    target = load(tiny_models["llama"])
    d = runner(load(tiny_draft_models["llama"])) if draft == "pair" else None
    spec = SpeculationConfig(policy="off" if draft == "none" else "fixed", k=3,
                             method="ngram" if draft == "ngram" else "model", ngram={"min_n": 1, "max_n": 3})
    return Engine(runner(target), d, spec, SchedulerConfig())


def texts(engine: Engine, prompt: list[int], specs: list[StructuredOutput], max_tokens: int = 96) -> list:
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=s) for s in specs]
    return [(c.text, c.token_ids, c.finish_reason) for c in generate(engine, [prompt] * len(specs), params)]


@pytest.mark.parametrize("draft", ["pair", "ngram"])
def test_json_schema_outputs_validate_and_equal_plain_constrained_decoding(tiny_models, tiny_draft_models,
                                                                          draft) -> None:
    prompt = text_prompts(load(tiny_models["llama"]), 1, offset=2)[0]
    specs = [StructuredOutput(json_schema=s) for s in SCHEMAS]
    got = texts(make_engine(tiny_models, tiny_draft_models, draft), prompt, specs)
    want = texts(make_engine(tiny_models, tiny_draft_models, "none"), prompt, specs)
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    for schema, (text, _, reason) in zip(SCHEMAS, got):
        assert reason.value == "stop", f"{schema}: {text!r} did not finish"
        jsonschema.validate(json.loads(text), schema)


def test_json_mode_regex_and_choice(tiny_models, tiny_draft_models) -> None:
    prompt = text_prompts(load(tiny_models["llama"]), 1, offset=6)[0]
    specs = [StructuredOutput(json_object=True), StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"),
             StructuredOutput(choice=("yes", "no", "maybe so"))]
    got = texts(make_engine(tiny_models, tiny_draft_models, "pair"), prompt, specs, max_tokens=64)
    want = texts(make_engine(tiny_models, tiny_draft_models, "none"), prompt, specs, max_tokens=64)
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    obj, code, choice = (t for t, _, _ in got)
    assert isinstance(json.loads(obj), dict) or got[0][2].value == "length"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", code)
    assert choice in ("yes", "no", "maybe so")


def test_an_invalid_schema_or_regex_is_refused_before_anything_runs(tiny_models, tiny_draft_models) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, "pair")
    prompt = tuple(text_prompts(engine.target.model, 1)[0])
    for spec in (StructuredOutput(regex="(unclosed"), StructuredOutput(json_schema={"type": "no-such-type"})):
        with pytest.raises(RequestError, match="invalid structured output") as e:
            engine.add_request(Request("bad", prompt, SamplingParams(structured=spec)))
        assert e.value.param == "response_format"
    assert not engine.has_unfinished()


def test_sampled_structured_output_still_matches(tiny_models, tiny_draft_models) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, "pair")
    prompt = text_prompts(engine.target.model, 1, offset=1)[0]
    schema = SCHEMAS[13]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96, structured=StructuredOutput(json_schema=schema))
              for s in range(8)]
    for c in generate(engine, [prompt] * 8, params):
        jsonschema.validate(json.loads(c.text), schema)


DEEP = 2_000  # levels: past Python's recursion limit (json.loads) and pydantic's serializer


def _deep_schema(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def test_a_schema_nested_past_any_recursion_limit_is_a_clear_error_not_a_recursion_error() -> None:
    """A guided_json string or a gRPC schema nested 2,000 deep is a 400 naming the field, never a RecursionError
    (a 500 with a traceback); a schema object within pydantic's parser but nested past MAX_SCHEMA_DEPTH too."""
    from actors.speculation.structured import parse_schema
    from cluster.request import MAX_SCHEMA_DEPTH
    from deploy.serve.openai_api import APIError, _schema

    with pytest.raises(InvalidRequest, match="nest"):
        parse_schema(_deep_schema(DEEP))
    with pytest.raises(APIError) as e:
        _schema(_deep_schema(DEEP))
    assert e.value.status == 400 and e.value.param == "guided_json"
    deep = json.loads(_deep_schema(MAX_SCHEMA_DEPTH))  # within json.loads' limit, past ours
    with pytest.raises(ValidationError, match="nest"):
        StructuredOutput(json_schema=deep)
    StructuredOutput(json_schema=json.loads(_deep_schema(MAX_SCHEMA_DEPTH // 2 - 1)))  # 2 levels a step: fine


def test_choices_and_stop_token_ids_have_the_same_bounds_whichever_api_brings_them() -> None:
    from cluster.request import MAX_CHOICE_CHARS, MAX_STOP_TOKEN_IDS

    with pytest.raises(ValidationError, match="choice"):
        StructuredOutput(choice=("x" * (MAX_CHOICE_CHARS + 1),))
    with pytest.raises(ValidationError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))
    SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)))
