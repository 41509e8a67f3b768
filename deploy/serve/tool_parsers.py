"""Tool-call formats by name (as vLLM's `--tool-call-parser`): where a model's calls begin, how they parse, their grammar.

A model writes its calls in the format its chat template taught it:
- `hermes` (NousResearch Hermes 2 Pro; the Qwen2.5 and Qwen3 templates): text, then one or more
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `llama3_json` (Meta's Llama 3.1/3.2 JSON tool calling): the whole output is `{"name": ..., "parameters": {...}}`,
  several joined by `; `, optionally after `<|python_tag|>`;
- `mistral` (Mistral's v3+ tokenizers): text, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`.
Each parser is detected from a marker in the chat template (`detect`), splits an output into its text, its calls
section (`calls_at`) and any text after the calls (`split`), and writes the Lark grammar (llguidance's syntax) of its
calls section, each call's JSON held to the tool's schema (deploy/serve/tools.py assembles the whole grammar). The
calls section is read as its format's tags and separators around JSON objects in order (`split`, objects by
`scan`-style reading), complete or not, so a stream can hand out each call's name once known, its arguments as they
come, and the text after the calls once the section has ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

# JSON as json.dumps writes it (actors/speculation/structured.py's layout), given to llguidance inside a Lark %json
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class RawCall:
    """One call object of a calls section, as far as it has arrived."""

    name: str | None  # once its "name" string is complete
    arguments: str  # the raw JSON text of its arguments value so far ("" before it starts)
    arguments_open: bool  # the arguments are an object or array (streamable as raw text), not a stringified one
    complete: bool  # the object is closed

    def final_arguments(self) -> str:
        """The call's `function.arguments`: the arguments' JSON text (a stringified one unwrapped; none: `{}`)."""
        if not self.arguments:
            return "{}"
        if self.arguments_open:
            return self.arguments
        value = json.loads(self.arguments)
        return value if isinstance(value, str) else json.dumps(value)


def scan(section: str, args_key: str) -> list[RawCall]:
    """The call objects of a calls section in order (anything between them, tags and separators, is skipped); the
    last may be incomplete. Raises ValueError on a malformed object."""
    calls, i = [], 0
    while i < len(section):
        if section[i] != "{":
            i += 1
            continue
        call, i = _scan_object(section, i, args_key)
        calls.append(call)
        if not call.complete:
            break
    return calls


def _scan_object(s: str, start: int, args_key: str) -> tuple[RawCall, int]:
    """One JSON object from `s[start] == "{"`: its name, its arguments' raw text, and where it ends."""
    depth, in_str, esc = 0, False, False
    state, key, str_start, value_start, value_key = "key", None, 0, None, None
    name, args, args_open = None, "", False

    def close_value(end: int) -> None:
        nonlocal name, args, state, value_start
        raw = s[value_start:end].strip()
        if value_key == "name":
            name = json.loads(raw) if raw.startswith('"') else None
        elif value_key == args_key:
            args = raw
        state, value_start = "after", None

    for j in range(start, len(s)):
        ch = s[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 1 and state == "key_str":
                    key, state = json.loads(s[str_start:j + 1]), "colon"
                elif depth == 1 and state == "value" and value_start == str_start:
                    close_value(j + 1)
            continue
        if ch.isspace():
            continue
        if depth == 1 and state == "value" and value_start is None:
            value_start, value_key = j, key
            if value_key == args_key:
                args_open = ch in "{["
        if ch == '"':
            in_str, str_start = True, j
            if depth == 1 and state == "key":
                state = "key_str"
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 1:  # the object ends (a scalar value ends with it)
                if state == "value" and value_start is not None:
                    close_value(j)
                return RawCall(name, args, args_open, True), j + 1
            depth -= 1
            if depth == 1 and state == "value":
                close_value(j + 1)
        elif depth == 1 and ch == ":" and state == "colon":
            state = "value"
        elif depth == 1 and ch == ",":
            if state == "value" and value_start is not None:
                close_value(j)
            state = "key"
        elif depth == 1 and state not in ("value", "after"):
            raise ValueError(f"malformed call object at character {j}")
    if value_start is not None and value_key == args_key:
        args = s[value_start:]
    return RawCall(name, args, args_open, False), len(s)


PENDING = -1  # `_expect`: the text so far may still become what was expected


def _skip_space(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _expect(s: str, i: int, literals: tuple[str, ...], final: bool) -> int:
    """Past `literals` in order from `s[i]` (space allowed around each): the index after them, PENDING when the text
    ends inside them (not `final`), ValueError when something else stands there."""
    for lit in literals:
        i = _skip_space(s, i)
        if s.startswith(lit, i):
            i += len(lit)
        elif not final and lit.startswith(s[i:]):
            return PENDING
        else:
            raise ValueError(f"expected {lit!r} at character {i}")
    return i


class ToolParser:
    """A model's tool-call format: subclasses set the markers and keys.

    A calls section reads `first`, a call object, `after`, then for each further call `next_`, a call object and
    `after`, then `end` (each a sequence of literals; space is allowed around each)."""

    name: ClassVar[str]
    marker: ClassVar[str]  # opens the calls section
    template_marks: ClassVar[tuple[str, ...]]  # a chat template naming one of these uses this format
    args_key: ClassVar[str] = "arguments"
    first: ClassVar[tuple[str, ...]] = ()
    after: ClassVar[tuple[str, ...]] = ()
    next_: ClassVar[tuple[str, ...]] = ()
    end: ClassVar[tuple[str, ...]] = ()
    text_after: ClassVar[bool] = False  # auto mode's grammar lets text follow the calls (a section with a clear end)

    @classmethod
    def detect(cls, template: str) -> bool:
        return any(mark in template for mark in cls.template_marks)

    def calls_at(self, text: str) -> int | None:
        """Where the calls section begins in an output, or None (no call, so far)."""
        at = text.find(self.marker)
        return None if at < 0 else at

    def holdback(self, text: str) -> int:
        """How many trailing characters of text seen so far may be the start of the marker (a stream keeps them
        until the next delta tells)."""
        for n in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-n:]):
                return n
        return 0

    def split(self, section: str, final: bool) -> tuple[list[RawCall], int | None]:
        """A calls section's call objects in order (the last may be incomplete) and where the section ends: the text
        after that is the model's text after its calls; None while it has not ended (or may not have: the text so
        far may still open another call or close the section). Raises ValueError on a malformed section (with
        `final`, also on one that stops inside itself)."""
        calls: list[RawCall] = []
        i = _expect(section, 0, self.first, final)
        while i != PENDING:
            i = _skip_space(section, i)
            if i == len(section) and not final:
                return calls, None
            if not section.startswith("{", i):
                raise ValueError(f"expected a call object at character {i}")
            call, i = _scan_object(section, i, self.args_key)
            calls.append(call)
            if not call.complete:
                return calls, None
            i = _expect(section, i, self.after, final)
            if i == PENDING:
                break
            j = _skip_space(section, i)
            if self.next_ and section.startswith(self.next_[0], j):
                i = _expect(section, j, self.next_, final)
                continue
            if self.next_ and not final and self.next_[0].startswith(section[j:]):
                return calls, None  # another call may come
            end = _expect(section, i, self.end, final)
            return calls, (None if end == PENDING else end)
        if final:
            raise ValueError("the calls section stops inside itself")
        return calls, None

    def parse(self, text: str) -> tuple[str, list[RawCall]]:
        """An output's text and its complete calls; an output whose calls do not parse is all text (vLLM's rule).
        Text after the calls joins the text before them (`join_text`)."""
        at = self.calls_at(text)
        if at is None:
            return text, []
        try:
            calls, end = self.split(text[at:], final=True)
        except ValueError:
            return text, []
        if not calls or not all(c.complete and c.name for c in calls):
            return text, []
        return join_text(text[:at].rstrip(), text[at + end:].lstrip()), calls

    # ---- grammar (llguidance's Lark syntax) -------------------------------------------------------------
    def call_schema(self, name: str, parameters: dict) -> dict:
        """A call's JSON: its name, then its arguments under the tool's schema."""
        return {"type": "object", "properties": {"name": {"const": name}, self.args_key: parameters},
                "required": ["name", self.args_key], "additionalProperties": False, "x-guidance": JSON_LAYOUT}

    def literal(self, text: str, special: dict[str, int]) -> str:
        """A marker in Lark: the tokenizer's own token when it has one (a model emits it whole), else the text."""
        return lark_literal(text, special)

    def calls_rule(self, schemas: list[dict], parallel: bool, special: dict[str, int]) -> str:
        """Lark rules defining `calls` (the marker, then `after_open`) and what they use."""
        return f"calls: {self.literal(self.marker, special)} after_open\n" + self.after_open(schemas, parallel, special)

    def after_open(self, schemas: list[dict], parallel: bool, special: dict[str, int]) -> str:
        """Lark rules defining `after_open`: the calls after their opening marker (one call, or with `parallel`
        one or more), each any of the schemas."""
        raise NotImplementedError

    def text_rule(self) -> str:
        """The Lark terminal TEXT: free text that does not open a call (auto mode)."""
        m = regex_literal(self.marker)
        return f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{m}(.|\\n)*/"

    def auto_body(self, special: dict[str, int]) -> str:
        """Auto mode's `body`: text, or text then calls (then text, where the format's calls section has a clear
        end). llguidance's lexer is greedy (a lexeme is not cut short to let the next one start), so free text cannot
        be followed by a marker written as text: then the text and the marker are one lexeme, TEXT_OPEN, which ends
        at the first marker, and no text follows the calls. A marker that is its own token (Qwen's `<tool_call>`) is
        no text at all, and ends TEXT by itself."""
        if self.marker in special:
            return "body: TEXT | TEXT? calls" + (" TEXT?" if self.text_after else "")
        m = regex_literal(self.marker)
        return f"body: TEXT | TEXT_OPEN after_open\nTEXT_OPEN: /(.|\\n)*{m}/ & ~/(.|\\n)*{m}(.|\\n)+/"


def join_text(before: str, after: str) -> str:
    """The message's content when the model wrote text before and after its calls: both, a newline between."""
    return before + "\n" + after if before and after else before or after


def regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark `/regex/`."""
    return "".join(f"\\{c}" if c in "\\/.^$*+?()[]{}|-" else c for c in text)


def lark_literal(text: str, special: dict[str, int]) -> str:
    """`text` in Lark: its token (`<[id]>`) when the tokenizer has it as one added token, else the string."""
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def _alternatives(schemas: list[dict]) -> str:
    return "\ncall: " + " | ".join(f"%json {json.dumps(s)}" for s in schemas)


class HermesParser(ToolParser):
    """`<tool_call>\\n{json}\\n</tool_call>`, calls joined by a newline (the Hermes / Qwen templates)."""

    name = "hermes"
    marker = "<tool_call>"
    template_marks = ("<tool_call>",)
    first = next_ = ("<tool_call>",)
    after = ("</tool_call>",)
    text_after = True

    def after_open(self, schemas: list[dict], parallel: bool, special: dict[str, int]) -> str:
        close = self.literal("</tool_call>", special)
        more = f' ("\\n" {self.literal(self.marker, special)} one)*' if parallel else ""
        return f'after_open: one{more}\none: "\\n" call "\\n" {close}' + _alternatives(schemas)


class MistralParser(ToolParser):
    """`[TOOL_CALLS][{json}, ...]` (Mistral's tokenizers v3 and later; `[TOOL_CALLS]` is a control token)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    template_marks = ("[TOOL_CALLS]",)
    first, next_, end = ("[TOOL_CALLS]", "["), (",",), ("]",)
    text_after = True

    def after_open(self, schemas: list[dict], parallel: bool, special: dict[str, int]) -> str:
        items = '"[" call ("," " " call)* "]"' if parallel else '"[" call "]"'
        return f"after_open: {items}" + _alternatives(schemas)


class Llama3JsonParser(ToolParser):
    """`{"name": ..., "parameters": {...}}` as the whole output, several joined by `; ` (Llama 3.1+ JSON calls)."""

    name = "llama3_json"
    marker = "{"
    template_marks = ("<|python_tag|>", "ipython")
    args_key = "parameters"
    next_ = (";",)

    def calls_at(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>"):
            return len(text) - len(stripped) + len("<|python_tag|>")
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def holdback(self, text: str) -> int:
        return 0

    def calls_rule(self, schemas: list[dict], parallel: bool, special: dict[str, int]) -> str:
        return ('calls: call ("; " call)*' if parallel else "calls: call") + _alternatives(schemas)

    def text_rule(self) -> str:
        return "TEXT: /[^{\\s](.|\\n)*/"  # text never opens with a call's brace

    def auto_body(self, special: dict[str, int]) -> str:
        return "body: TEXT | calls"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, MistralParser, Llama3JsonParser)}


def parser_for(setting: str | None, chat_template: str | None) -> ToolParser | None:
    """The parser a model gets: the one its config names, or with "auto" the one its chat template's markers
    name (hermes, then mistral, then llama3_json), or none ("none", or a template that names no tool format)."""
    if setting in (None, "none"):
        return None
    if setting != "auto":
        if setting not in PARSERS:
            raise ValueError(f"unknown tool-call parser {setting!r}; known: {', '.join(sorted(PARSERS))}")
        return PARSERS[setting]()
    for cls in (HermesParser, MistralParser, Llama3JsonParser):
        if chat_template and cls.detect(chat_template):
            return cls()
    return None
