"""Reasoning formats by name (as vLLM's `--reasoning-parser`): a thinking model's reasoning split from its answer.

`deepseek_r1` and `qwen3` (DeepSeek-R1, QwQ, Qwen3): the output opens with `<think>`, reasons, and closes with
`</think>` before the answer. A template may open `<think>` in the prompt itself (DeepSeek-R1's later templates), so the
output starts inside the reasoning: `Reasoner.start(prompt_text)` tells. `ReasoningStream` splits a stream of text
deltas into reasoning and answer deltas, holding back a tail that may be the start of a tag until the next delta
tells. The answer's grammar (a tool call's, a JSON schema's) applies after the reasoning: `lark_prefix` is the Lark
rule the grammar builder puts before it (deploy/serve/tools.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

from deploy.serve.tool_parsers import regex_literal


def _partial_suffix(text: str, tag: str) -> int:
    """The longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Reasoner:
    """A reasoning format: subclasses set the tags and the template marks that detect them."""

    name: ClassVar[str]
    open_tag: ClassVar[str] = "<think>"
    close_tag: ClassVar[str] = "</think>"
    template_marks: ClassVar[tuple[str, ...]] = ("<think>",)

    @classmethod
    def detect(cls, template: str) -> bool:
        return any(mark in template for mark in cls.template_marks)

    def starts_inside(self, prompt_tail: str) -> bool:
        """Whether the prompt (its last characters) opened the reasoning, so the output begins inside it."""
        tail = prompt_tail.rstrip()
        return tail.endswith(self.open_tag)

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """A whole output's (reasoning, answer): no reasoning unless it opened; an unclosed one is all reasoning."""
        stream = ReasoningStream(self, inside)
        reasoning, answer = stream.feed(text)
        r2, a2 = stream.finish()
        reasoning, answer = reasoning + r2, answer + a2
        return (reasoning if stream.reasoned else None), answer

    def lark_prefix(self, inside: bool, special: dict[str, int]) -> str:
        """Lark rules `think` (the reasoning, optional unless the prompt opened it) and `start` (think, then the
        grammar's `body`). llguidance's lexer is greedy, so reasoning closed by `</think>` written as text is one
        lexeme that ends at the first `</think>`; a closing tag that is its own token ends the text by itself."""
        gap = "THINK_GAP: /\\n+/\n"
        opening = "" if inside else (f"<[{special[self.open_tag]}]> " if self.open_tag in special
                                     else json.dumps(self.open_tag) + " ")
        start = "start: think body" if inside else "start: think? body"
        if self.close_tag in special:
            text = "THINK_TEXT: /(.|\\n)*/\n"
            think = f"think: {opening}THINK_TEXT <[{special[self.close_tag]}]> THINK_GAP?"
        else:
            m = regex_literal(self.close_tag)
            text = f"THINK_CLOSED: /(.|\\n)*{m}/ & ~/(.|\\n)*{m}(.|\\n)+/\n"
            think = f"think: {opening}THINK_CLOSED THINK_GAP?"
        return f"{gap}{text}{think}\n{start}"


class DeepSeekR1(Reasoner):
    name = "deepseek_r1"


class Qwen3(Reasoner):
    name = "qwen3"


REASONERS: dict[str, type[Reasoner]] = {r.name: r for r in (DeepSeekR1, Qwen3)}


def reasoner_for(setting: str | None, chat_template: str | None) -> Reasoner | None:
    """The reasoning parser a model gets: the one its config names, or with "auto" `qwen3` for a chat template that
    writes `<think>`, or none."""
    if setting in (None, "none"):
        return None
    if setting != "auto":
        if setting not in REASONERS:
            raise ValueError(f"unknown reasoning parser {setting!r}; known: {', '.join(sorted(REASONERS))}")
        return REASONERS[setting]()
    return Qwen3() if chat_template and Qwen3.detect(chat_template) else None


@dataclass
class ReasoningStream:
    """Splits text deltas into (reasoning, answer) deltas as they arrive."""

    reasoner: Reasoner
    inside: bool  # the prompt opened the reasoning
    reasoned: bool = False  # the output has reasoning (opened, here or in the prompt)
    _state: str = field(default="start")  # start (may open) -> reasoning -> answer
    _held: str = ""

    def __post_init__(self) -> None:
        if self.inside:
            self._state, self.reasoned = "reasoning", True

    def feed(self, text: str) -> tuple[str, str]:
        r, a = [], []
        buf, self._held = self._held + text, ""
        while buf:
            if self._state == "start":
                stripped = buf.lstrip()
                tag = self.reasoner.open_tag
                if stripped.startswith(tag):
                    self._state, self.reasoned = "reasoning", True
                    buf = stripped[len(tag):]
                elif tag.startswith(stripped):  # may still open: wait
                    self._held = buf
                    buf = ""
                else:
                    self._state = "answer"
            elif self._state == "reasoning":
                at = buf.find(self.reasoner.close_tag)
                if at >= 0:
                    r.append(buf[:at])
                    self._state, buf = "answer_start", buf[at + len(self.reasoner.close_tag):]
                else:
                    keep = _partial_suffix(buf, self.reasoner.close_tag)
                    r.append(buf[:len(buf) - keep])
                    self._held, buf = buf[len(buf) - keep:], ""
            elif self._state == "answer_start":  # the blank lines after the reasoning are no part of the answer
                stripped = buf.lstrip("\n")
                if stripped:
                    self._state, buf = "answer", stripped
                else:
                    buf = ""
            else:
                a.append(buf)
                buf = ""
        return "".join(r), "".join(a)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held if self._state in ("start", "answer") else held.lstrip("\n")
