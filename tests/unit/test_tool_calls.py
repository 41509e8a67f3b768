"""Tool calling's pure parts: the parsers and reasoning split (whole and streamed), the checks of tools and history,
and the grammar builder, whose calls always parse, always match their schemas, and stay lossless under speculation
(the tiny llama: a random model whose output only the grammar shapes, with a draft model and an n-gram drafter)."""

from __future__ import annotations

import json
import random
from typing import get_args

import jsonschema
import pytest

from actors.speculation.structured import GrammarCompiler
from cluster.request import SamplingParams, StructuredOutput
from deploy.serve.chat_output import ChatShape
from deploy.serve.reasoning import REASONERS, Qwen3, ReasoningStream, reasoner_for
from deploy.serve.tool_parsers import PARSERS, HermesParser, Llama3JsonParser, MistralParser, parser_for, scan
from deploy.serve.tools import NamedToolChoice, Tool, ToolError, after_reasoning, check_history, grammar, plan
from deploy.serve.openai_api import ChatMessage
from actors.engine.core import Engine
from actors.engine.offline import generate
from cluster.config import ModelConfig, SchedulerConfig, SpeculationConfig
from tests.unit.helpers import load, runner, text_prompts
from tests.unit.test_structured import SCHEMAS, make_engine
from tests.unit.test_deterministic import models, pair  # noqa: F401 - the deterministic bf16 tests' fixtures


def tool(name: str, parameters: dict | None) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


# 20 function schemas: each of test_structured's schemas as the one property of a function's parameters
FUNCTION_SCHEMAS = [{"type": "object", "properties": {"v": s}, "required": ["v"], "additionalProperties": False}
                    for s in SCHEMAS]

OUTPUTS = {
    HermesParser: ('I will look. <tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}]\\""}]}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
                   "I will look.", [("f", {"a": [1, {"b": '}]"'}]}), ("g", {})]),
    Llama3JsonParser: ('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "a;b"}}', "",
                       [("f", {"x": 1}), ("g", {"y": "a;b"})]),
    MistralParser: ('[TOOL_CALLS][{"name": "f", "arguments": {"x": true}}, {"name": "g", "arguments": "{\\"k\\": 2}"}]',
                    "", [("f", {"x": True}), ("g", {"k": 2})]),
}


@pytest.mark.parametrize("cls", list(OUTPUTS))
def test_each_format_parses_its_calls_whole_and_streamed_alike(cls) -> None:
    text, content, calls = OUTPUTS[cls]
    message, called = ChatShape(cls(), None).message(text)
    assert called and (message["content"] or "") == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    rng = random.Random(0)
    for _ in range(20):  # random chunkings: the deltas add up to the whole message
        stream, deltas = _streamed(cls, text, rng, 6)
        assert "".join(d.get("content", "") for d in deltas) == content
        got: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", ()):
                if c["index"] not in got:  # the first fragment of a call: index, id, type and name, no arguments
                    assert c["id"].startswith("call_") and c["type"] == "function" and c["function"]["arguments"] == ""
                    got[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
                else:
                    assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                    got[c["index"]]["arguments"] += c["function"]["arguments"]
        assert [(g["name"], json.loads(g["arguments"])) for _, g in sorted(got.items())] == calls
        assert stream.called


def test_text_stays_text_and_a_broken_call_is_text() -> None:
    p = HermesParser()
    assert p.parse("no calls here <tool_") == ("no calls here <tool_", [])
    assert p.parse('<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>')[1] == []
    assert Llama3JsonParser().parse("Sure: {\"name\": 1}")[1] == []
    stream = ChatShape(p, None).stream()
    deltas = stream.feed("half a tag <tool") + stream.feed("box> done") + stream.finish()
    assert "".join(d["content"] for d in deltas) == "half a tag <toolbox> done" and not stream.called


AFTER_CALLS = {  # (output, content, calls): text after the calls, braces and a tag-like start in it
    HermesParser: ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
                   '{"name": "g", "arguments": {}}\n</tool_call>\n\n<b>Done</b> {"ok": 1}',
                   'Let me look.\n<b>Done</b> {"ok": 1}', [("f", {"a": 1}), ("g", {})]),
    MistralParser: ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] and {x}', "and {x}", [("f", {"a": 1})]),
    Llama3JsonParser: ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}} ok',
                       "ok", [("f", {"a": 1}), ("g", {})]),
}


@pytest.mark.parametrize("cls", list(AFTER_CALLS))
def test_text_after_the_calls_is_content_whole_and_streamed_alike(cls) -> None:
    """Text the model writes after its calls is kept (vLLM's streaming hands it out as content; its whole-output
    parser drops it): the content is the text before and after the calls, the calls are all there, and the stream's
    deltas add up to the whole message at every chunking."""
    text, content, calls = AFTER_CALLS[cls]
    message, called = ChatShape(cls(), None).message(text)
    assert called and message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    rng = random.Random(2)
    for _ in range(20):
        stream, deltas = _streamed(cls, text, rng, 7)
        assert "".join(d.get("content", "") for d in deltas) == content
        kinds = ["content" if "content" in d else "call" for d in deltas]
        assert "call" in kinds and kinds[-1] == "content"  # the text after the calls comes after them
        got = {}
        for d in deltas:
            for c in d.get("tool_calls", ()):
                got.setdefault(c["index"], [c["function"].get("name"), ""])[1] += c["function"]["arguments"]
        assert [(n, json.loads(a)) for n, a in got.values()] == calls


def test_auto_grammar_lets_text_follow_the_calls_where_the_section_ends_clearly(tmp_path) -> None:
    """auto with hermes' tokens: text, calls, then text (a newline then another call still parses as one more
    call); `required` ends with its calls. Checked on a tokenizer that has `<tool_call>` as a token, as Qwen's."""
    from tests.fixtures.agent_model import AGENT_TOKENS, HERMES_TEMPLATE
    from tests.fixtures.tiny_models import build_tokenizer

    tokenizer = build_tokenizer(tmp_path, HERMES_TEMPLATE, AGENT_TOKENS)
    special = tokenizer.get_added_vocab()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    tools = [tool("f", FUNCTION_SCHEMAS[0])]
    call = '<tool_call>\n{"name": "f", "arguments": {"v": {"a": 3}}}\n</tool_call>'

    def ends(spec: StructuredOutput, text: str) -> bool:
        """The grammar takes the whole text and may end after it."""
        state, ids = compiler.matcher(spec), tokenizer.encode(text, add_special_tokens=False)
        if state.valid_prefix(ids) != len(ids):
            return False
        state.consume(ids)
        return bool(state.allowed()[tokenizer.eos_token_id])

    auto, required = (grammar(plan(tools, mode, True), HermesParser(), special) for mode in ("auto", "required"))
    for text in ("Hi", call, f"Hi{call}", f"{call}\n{call}", f"{call}\nDone {{x}}.", f"Hi{call}\n{call}\nDone."):
        assert ends(auto, text), text
    assert not ends(auto, f"{call}\nDone.{call}")  # text after the calls opens no further call
    assert ends(required, f"{call}\n{call}") and not ends(required, f"{call}\nDone.")
    single = grammar(plan(tools, "auto", False), HermesParser(), special)
    assert ends(single, f"{call}\nDone.") and not ends(single, f"{call}\n{call}")


def test_scan_gives_a_partial_call_its_name_and_raw_arguments() -> None:
    [call] = scan('{"name": "f", "arguments": {"a": [1, 2', "arguments")
    assert (call.name, call.arguments, call.arguments_open, call.complete) == ("f", '{"a": [1, 2', True, False)
    [call] = scan('{"arguments": {"a": 1}, "name": "g"}', "arguments")  # any key order
    assert (call.name, call.final_arguments(), call.complete) == ("g", '{"a": 1}', True)


def test_reasoning_splits_whole_and_streamed_alike() -> None:
    r = Qwen3()
    text = "<think>\nfirst I think </thi nk> still\n</think>\n\nThe answer."
    assert r.split(text, inside=False) == ("\nfirst I think </thi nk> still\n", "The answer.")
    assert r.split("no reasoning", inside=False) == (None, "no reasoning")
    assert r.split("opened by the prompt</think>answer", inside=True) == ("opened by the prompt", "answer")
    assert r.split("<think>never closed", inside=False) == ("never closed", "")
    rng = random.Random(1)
    for _ in range(30):
        stream, parts, at = ReasoningStream(r, False), [], 0
        while at < len(text):
            step = rng.randint(1, 5)
            parts.append(stream.feed(text[at:at + step]))
            at += step
        parts.append(stream.finish())
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == r.split(text, inside=False)


def test_parsers_are_chosen_by_name_or_by_the_template() -> None:
    assert isinstance(parser_for("auto", "... <tool_call> ..."), HermesParser)
    assert isinstance(parser_for("auto", "... [TOOL_CALLS] ..."), MistralParser)
    assert isinstance(parser_for("auto", "{{ '<|python_tag|>' }}"), Llama3JsonParser)
    assert parser_for("auto", "{{ messages }}") is None and parser_for("none", "<tool_call>") is None
    assert isinstance(parser_for("mistral", None), MistralParser)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser_for("nope", None)
    assert isinstance(reasoner_for("auto", "<think>"), Qwen3) and reasoner_for("auto", "plain") is None
    # the config's choices are the registries' names (a wrong one is refused when the config loads)
    fields = ModelConfig.model_fields
    assert set(get_args(fields["tool_parser"].annotation)) == {"auto", "none", *PARSERS}
    assert set(get_args(fields["reasoning_parser"].annotation)) == {"auto", "none", *REASONERS}


def test_tools_tool_choice_and_history_are_checked() -> None:
    with pytest.raises(ToolError) as e:
        plan([tool("f", {"type": "object", "properties": {"a": {"type": "no-such-type"}}})], "auto", None)
    assert e.value.param == "tools[0].function.parameters"
    with pytest.raises(ToolError) as e:
        plan([tool("f", {"type": "string"})], "auto", None)
    assert e.value.param == "tools[0].function.parameters"
    with pytest.raises(ToolError) as e:
        plan([tool("f", None), tool("f", None)], "auto", None)
    assert e.value.param == "tools[1].function.name"
    with pytest.raises(ToolError) as e:
        plan([tool("f", None)], NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}}), None)
    assert e.value.param == "tool_choice.function.name"
    with pytest.raises(ToolError) as e:
        plan(None, "required", None)
    assert e.value.param == "tool_choice"
    named = plan([tool("f", None), tool("g", None)],
                 NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}}), True)
    assert named.mode == "named" and [t.function.name for t in named.callable_] == ["g"] and not named.parallel
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "tool", "tool_call_id": "c2", "content": "r"})]
    check_history(history[:3])
    with pytest.raises(ToolError) as e:
        check_history(history)
    assert e.value.param == "messages[3].tool_call_id"


def engine_with(tiny_models, tiny_draft_models, draft: str) -> Engine:
    """test_structured's engines, and one drafting by suffix lookup."""
    if draft != "suffix":
        return make_engine(tiny_models, tiny_draft_models, draft)
    spec = SpeculationConfig(policy="fixed", k=3, method="suffix")
    return Engine(runner(load(tiny_models["llama"])), None, spec, SchedulerConfig())


@pytest.mark.parametrize("draft", ["pair", "ngram", "suffix"])
def test_required_calls_always_validate_and_equal_plain_constrained_decoding(tiny_models, tiny_draft_models,
                                                                            draft) -> None:
    """20 function schemas, `required` (parallel) and named: every output is calls in the hermes format whose
    arguments validate against their schema, token for token what plain constrained greedy decoding gives."""
    prompt = text_prompts(load(tiny_models["llama"]), 1, offset=3)[0]
    specs = []
    for i, schema in enumerate(FUNCTION_SCHEMAS):
        tools = [tool(f"fn_{i}", schema), tool("other", {"type": "object", "properties": {}})]
        choice = "required" if i % 2 else NamedToolChoice.model_validate({"type": "function",
                                                                         "function": {"name": f"fn_{i}"}})
        specs.append(grammar(plan(tools, choice, i % 4 == 1), HermesParser(), {}))  # some may call in parallel
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured=s) for s in specs]
    got = [(c.text, c.token_ids, c.finish_reason) for c in
           generate(engine_with(tiny_models, tiny_draft_models, draft), [prompt] * len(specs), params)]
    want = [(c.text, c.token_ids, c.finish_reason) for c in
            generate(make_engine(tiny_models, tiny_draft_models, "none"), [prompt] * len(specs), params)]
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    for i, (text, _, reason) in enumerate(got):
        parallel = i % 4 == 1  # a random model may keep calling until max_tokens: its complete calls must hold
        assert reason.value == "stop" or parallel, text
        calls = HermesParser().parse(text)[1] if reason.value == "stop" else [c for c in scan(text, "arguments")
                                                                             if c.complete]
        assert calls and text.startswith("<tool_call>"), text
        for call in calls:
            schema = FUNCTION_SCHEMAS[i] if call.name == f"fn_{i}" else {"type": "object", "properties": {}}
            jsonschema.validate(json.loads(call.final_arguments()), schema)
        if i % 2 == 0:
            assert [c.name for c in calls] == [f"fn_{i}"]
        elif not parallel:
            assert len(calls) == 1


def tool_specs() -> list[StructuredOutput]:
    """The 20 schemas' grammars: `required` (some parallel) and named in turn, beside a tool of no parameters."""
    specs = []
    for i, schema in enumerate(FUNCTION_SCHEMAS):
        tools = [tool(f"fn_{i}", schema), tool("other", {"type": "object", "properties": {}})]
        choice = "required" if i % 2 else NamedToolChoice.model_validate({"type": "function",
                                                                         "function": {"name": f"fn_{i}"}})
        specs.append(grammar(plan(tools, choice, i % 4 == 1), HermesParser(), {}))
    return specs


@pytest.mark.heavy
@pytest.mark.parametrize("draft", ["model draft", "n-gram", "suffix"])
def test_calls_equal_plain_constrained_decoding_in_deterministic_bf16(models, pair, draft) -> None:
    """The same 20 tool grammars in the deterministic bf16 mode (engine.deterministic, docs/determinism.md; the
    tiny qwen2 of tests/unit/test_deterministic.py, bf16 on our kernels' widths): with each draft kind, every call
    is token for token what plain constrained greedy decoding gives, batched as the server batches them."""
    from actors.model.runner import ModelRunner
    from tests.unit.test_deterministic import CACHE, NGRAM, engine, runner as det_runner

    target, draft_model = models
    prompt = text_prompts(target, 1, offset=3)[0]
    specs = tool_specs()
    params = [SamplingParams(temperature=0.0, max_tokens=96, structured=s) for s in specs]
    # the draft as the app runs it: deterministic mode applies to the target only (its tokens only move acceptance)
    draft_runner = lambda: ModelRunner(draft_model, range(draft_model.num_layers), CACHE)  # noqa: E731
    speculative = {"model draft": lambda: engine(det_runner(target), draft_runner(), policy="fixed", k=4),
                   "n-gram": lambda: engine(det_runner(target), policy="fixed", k=4, **NGRAM),
                   "suffix": lambda: engine(det_runner(target), policy="fixed", k=4, method="suffix")}[draft]()
    got = generate(speculative, [prompt] * len(specs), params)
    want = generate(engine(det_runner(target), policy="off"), [prompt] * len(specs), params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert sum(c.stats.accepted for c in got) > 0, "nothing drafted was accepted: the comparison proves little"
    for i, c in enumerate(got):
        assert c.text.startswith("<tool_call>"), c.text
        calls = [x for x in scan(c.text, "arguments") if x.complete]
        assert calls or c.finish_reason.value == "length", c.text
        for call in calls:
            schema = FUNCTION_SCHEMAS[i] if call.name == f"fn_{i}" else {"type": "object", "properties": {}}
            jsonschema.validate(json.loads(call.final_arguments()), schema)


def test_auto_lets_the_model_write_text_or_a_valid_call(tiny_models, tiny_draft_models) -> None:
    """auto: whatever the random model writes parses (text, or text then calls that match their schema)."""
    engine = make_engine(tiny_models, tiny_draft_models, "pair")
    prompts = text_prompts(load(tiny_models["llama"]), 6, offset=9)
    tools = [tool("f", FUNCTION_SCHEMAS[0])]
    spec = grammar(plan(tools, "auto", True), HermesParser(), {})
    for c in generate(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=48, structured=spec)] * 6):
        content, calls = HermesParser().parse(c.text)
        assert "<tool_call>" not in content or c.finish_reason.value == "length"
        for call in calls:
            jsonschema.validate(json.loads(call.final_arguments()), FUNCTION_SCHEMAS[0])


def test_a_reasoning_model_reasons_before_its_grammar_applies(tiny_models) -> None:
    """With a reasoning parser the grammar lets `<think>...</think>` come first, then holds the answer to the schema
    (the tiny llama's tokenizer has no `<think>` token: the tags are matched as text)."""
    tokenizer = load(tiny_models["llama"]).tokenizer
    schema = FUNCTION_SCHEMAS[0]
    specs = {"json": after_reasoning(StructuredOutput(json_schema=schema), Qwen3(), False, {}),
             "tools": grammar(plan([tool("f", schema)], "required", False), HermesParser(), {}, Qwen3())}
    answers = {"json": '{"v": {"a": 3}}',
               "tools": '<tool_call>\n{"name": "f", "arguments": {"v": {"a": 3}}}\n</tool_call>'}
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for kind, spec in specs.items():
        for text, ok in ((f"<think>plan it</think>\n\n{answers[kind]}", True), (answers[kind], True),
                         (f"<think>plan</think>\n\n{answers[kind][:-2]}x", False), ("<think>a</think>b", False)):
            state = compiler.matcher(spec)
            ids = tokenizer.encode(text)
            assert (state.valid_prefix(ids) == len(ids)) == ok, (kind, text)
    # a template that opens the reasoning in the prompt: the output starts inside it
    inside = after_reasoning(StructuredOutput(json_schema=schema), Qwen3(), True, {})
    state = compiler.matcher(inside)
    ids = tokenizer.encode(f"thinking</think>\n{answers['json']}")
    assert state.valid_prefix(ids) == len(ids)


def test_mistral_calls_come_back_though_the_detokenizer_drops_the_marker() -> None:
    """`[TOOL_CALLS]` is a control token whose text the detokenizer drops: its id in a step's tokens puts it back."""
    shape = ChatShape(MistralParser(), None, marker_id=5)
    text = '[{"name": "f", "arguments": {"x": 1}}]'
    message, called = shape.message(text, [5, 9, 9])
    assert called and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert shape.message(text, [9, 9]) == ({"role": "assistant", "content": text}, False)
    stream = shape.stream()
    deltas = stream.feed(text[:10], (5, 9)) + stream.feed(text[10:], (9,)) + stream.finish()
    assert stream.called and not any("content" in d for d in deltas)


def _streamed(cls: type, text: str, rng: random.Random, max_step: int) -> tuple:
    """A fresh stream of `cls` fed `text` in random pieces of 1..max_step characters, and all its deltas."""
    stream, deltas, at = ChatShape(cls(), None).stream(), [], 0
    while at < len(text):
        step = rng.randint(1, max_step)
        deltas += stream.feed(text[at:at + step])
        at += step
    return stream, deltas + stream.finish()
