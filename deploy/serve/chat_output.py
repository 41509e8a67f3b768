"""A chat answer's shape: reasoning, text and tool calls out of the generated text, whole or as stream deltas.

`ChatFormats` is what a served model's chat template writes (its tool-call parser, its reasoning parser, the tokens
they use), found once when the frontend starts. `ChatShape` holds one request's: `message` shapes a whole output as
OpenAI's assistant message, `stream` gives a `ChatStream` that turns each text delta into OpenAI's chunk deltas in
order: `reasoning_content`, `content`, then per call its index, id, type and name first and its arguments in
fragments (their concatenation is the call's `function.arguments`, as in the whole message), then `content` again for
text the model wrote after its calls (the deltas' content adds up to the whole message's: tool_parsers.join_text).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from cluster.request import StructuredOutput
from deploy.serve.openai_api import APIError
from deploy.serve.reasoning import Reasoner, ReasoningStream, reasoner_for
from deploy.serve.tool_parsers import RawCall, ToolParser, join_text, parser_for
from deploy.serve.tools import ToolPlan, after_reasoning, grammar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatFormats:
    """A served model's tool-call and reasoning formats (from the config, or detected from its chat template)."""

    parser: ToolParser | None
    reasoner: Reasoner | None
    reasoning_in_prompt: bool  # the template opens the reasoning itself (the output starts inside it)
    special: dict[str, int]  # the tokenizer's added tokens: a grammar names a marker by its token

    @classmethod
    def of(cls, tokenizer, tool_parser: str | None, reasoning_parser: str | None) -> "ChatFormats":
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        reasoner = reasoner_for(reasoning_parser, template)
        inside = False
        if reasoner is not None and template is not None:
            try:
                probe = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                      add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - a template that refuses the probe: assume the output opens it
                log.warning("the chat template refused a one-message probe (%s: %s); reading outputs as opening "
                            "their own reasoning", type(e).__name__, e)
                probe = ""
            inside = reasoner.starts_inside(probe)
        special = {text: id_ for text, id_ in tokenizer.get_added_vocab().items()}
        return cls(parser_for(tool_parser, template), reasoner, inside, special)

    def shape(self, plan: ToolPlan | None, spec: StructuredOutput | None, spec_param: str | None,
              model_name: str) -> tuple["ChatShape | None", StructuredOutput | None, str | None]:
        """A chat request's answer shape (None: plain text) and the grammar it decodes under, with the field that
        asked: its tools' (deploy/serve/tools.py) or its structured output's, after the reasoning of a reasoning
        model."""
        calls = plan is not None and plan.mode != "none"
        if calls and spec is not None:
            raise APIError(400, f"give tools (with tool_choice other than \"none\") or {spec_param}, not both",
                           param=spec_param, code="invalid_value")
        if calls and self.parser is None:
            raise APIError(400, f"tool_choice {plan.mode!r} needs a tool-call parser, and the chat template of "
                                f"{model_name!r} names no known format: set engine.model.tool_parser (hermes, "
                                "llama3_json, mistral; docs/serving.md)", param="tool_choice", code="invalid_value")
        if calls:
            spec = grammar(plan, self.parser, self.special, self.reasoner, self.reasoning_in_prompt)
            spec_param = "tools"
        elif spec is not None and self.reasoner is not None:
            spec = after_reasoning(spec, self.reasoner, self.reasoning_in_prompt, self.special)
        if not calls and self.reasoner is None:
            return None, spec, spec_param
        shape = ChatShape(self.parser if calls else None, self.reasoner, self.reasoning_in_prompt,
                          self.marker_id() if calls else None)
        return shape, spec, spec_param

    def marker_id(self) -> int | None:
        """The id of the parser's marker when it is a special token the detokenizer drops (Mistral's
        `[TOOL_CALLS]`): the stream puts it back where the token came."""
        if self.parser is None:
            return None
        return self.special.get(self.parser.marker)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(index: int | None, call: RawCall) -> dict:
    out = {"id": call_id(), "type": "function",
           "function": {"name": call.name, "arguments": call.final_arguments()}}
    return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ChatShape:
    """One request's answer shape: tool calls parsed with `parser` (None: text only), reasoning split by
    `reasoner`."""

    parser: ToolParser | None
    reasoner: Reasoner | None
    inside: bool = False
    marker_id: int | None = None

    def message(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> tuple[dict, bool]:
        """The assistant message of a whole output, and whether it holds calls."""
        if self.marker_id is not None and self.marker_id in token_ids and self.parser.marker not in text:
            text = self.parser.marker + text
        reasoning = None
        if self.reasoner is not None:
            reasoning, text = self.reasoner.split(text, self.inside)
        calls: list[RawCall] = []
        if self.parser is not None:
            text, calls = self.parser.parse(text)
        msg: dict = {"role": "assistant", "content": text if (text or not calls) else None}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [tool_call(None, c) for c in calls]
        return msg, bool(calls)

    def stream(self) -> "ChatStream":
        return ChatStream(self)


@dataclass
class ChatStream:
    """One choice's deltas: feed each text delta, then `finish`; `called` once a call has begun."""

    shape: ChatShape
    called: bool = False
    _reasoning: ReasoningStream | None = None
    _text: str = ""  # the answer so far
    _sent: int = 0  # characters of the answer's text handed out as content
    _section: int | None = None  # where the calls begin in the answer
    _calls: list[dict] = field(default_factory=list)  # per call: {"id", "name", "sent"}
    _after_sent: int = 0  # characters of the text after the calls handed out
    _broken: bool = False  # the calls section stopped parsing (no grammar held it): the rest is dropped

    def __post_init__(self) -> None:
        if self.shape.reasoner is not None:
            self._reasoning = ReasoningStream(self.shape.reasoner, self.shape.inside)

    def feed(self, text: str, token_ids: tuple[int, ...] = ()) -> list[dict]:
        shape = self.shape
        if shape.marker_id is not None and shape.marker_id in token_ids and shape.parser.marker not in text:
            text = shape.parser.marker + text
        out = []
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        return out + self._answer(text, final=False)

    def finish(self) -> list[dict]:
        out = []
        text = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.finish()
            if reasoning:
                out.append({"reasoning_content": reasoning})
        return out + self._answer(text, final=True)

    def _answer(self, text: str, final: bool) -> list[dict]:
        parser = self.shape.parser
        self._text += text
        if parser is None:
            return [{"content": text}] if text else []
        out = []
        if self._section is None:
            self._section = parser.calls_at(self._text)
            if self._section is not None:  # the text before the calls, as `message` gives it (trailing space cut)
                end = len(self._text[:self._section].rstrip())
            elif final:
                end = len(self._text)
            else:  # a tail that may open a call, or trailing space before one, waits for the next delta
                end = len(self._text[:len(self._text) - parser.holdback(self._text)].rstrip())
            if end > self._sent:
                out.append({"content": self._text[self._sent:end]})
                self._sent = end
        if self._section is not None and not self._broken:
            out += self._call_deltas(final)
        return out

    def _call_deltas(self, final: bool) -> list[dict]:
        try:
            raws, end = self.shape.parser.split(self._text[self._section:], final)
        except ValueError:
            self._broken = True
            return []
        out = self._each_call(raws)
        if end is not None:  # the section ended: what follows is text (its leading space cut, as `message` does)
            after = self._text[self._section + end:].lstrip()
            if len(after) > self._after_sent:
                sep = "\n" if self._sent and not self._after_sent else ""  # join_text's, once
                out.append({"content": sep + after[self._after_sent:]})
                self._after_sent = len(after)
        return out

    def _each_call(self, raws: list[RawCall]) -> list[dict]:
        out = []
        for i, raw in enumerate(raws):
            if raw.name is None:
                break  # a call's name comes before anything else of it
            if i == len(self._calls):
                self._calls.append({"id": call_id(), "sent": 0})
                self.called = True
                out.append({"tool_calls": [{"index": i, "id": self._calls[i]["id"], "type": "function",
                                            "function": {"name": raw.name, "arguments": ""}}]})
            state = self._calls[i]
            if raw.arguments_open or raw.complete:
                args = raw.final_arguments() if raw.complete else raw.arguments
                if len(args) > state["sent"] and (raw.arguments_open or state["sent"] == 0):
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": args[state["sent"]:]}}]})
                    state["sent"] = len(args)
        return out


def merge(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of the same kind as one (fewer chunks; tool-call fragments of one call joined)."""
    out: list[dict] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and set(d) == set(last) and ("content" in d or "reasoning_content" in d):
            key = next(iter(d))
            out[-1] = {key: last[key] + d[key]}
        else:
            out.append(d)
    return out

