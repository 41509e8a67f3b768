"""The agent workload of `specfleet bench agent`: tool-calling conversations with scripted tools, run at a concurrency.

A conversation is a dataset question (an MT-Bench first turn or a HumanEval task, ../shared/datasets) put to an agent
with two function tools, `search` (a query: results from the same datasets, chosen by the query's hash) and
`run_python` (code: a scripted run that echoes the code's first lines and a status), as agent frameworks loop:
the model's turn either calls a tool (one call per turn: `parallel_tool_calls: false`), whose result goes back as a
tool message for the next turn, or answers, which ends the conversation. The first turn is `tool_choice: required` (the agent must look something up, as the Agents
SDK's `tool_choice` then reset to `auto`), the middle turns `auto`, the last allowed turn `none` (it must answer).
Tool results repeat the arguments and texts the conversation already holds: what model-free drafting (n-gram, suffix)
exploits in agent loops (SuffixDecoding, Oliaro et al. 2024: its headline is agentic workloads).

Everything here is pure asyncio: `run` drives any `ChatFn` (the benchmark's goes through the API's frontend to
served instances, deploy/bench/agent.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

SYSTEM = ("You are a research agent. Use the tools to look things up or run code before you answer; when you have "
          "what you need, answer briefly.")
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the knowledge base; returns the best matching passages.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60}},
                       "required": ["query"], "additionalProperties": False}}},
    # a snippet short enough that a call (about 60 tokens) ends well inside a turn's token limit: a call cut by the
    # limit sends no result back, and the loop would measure first turns only (docs/benchmarks.md, issue 38)
    {"type": "function", "function": {
        "name": "run_python", "description": "Run a short Python snippet and return its output.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "maxLength": 160}},
                       "required": ["code"], "additionalProperties": False}}},
]


@dataclass(frozen=True)
class TurnOut:
    """What a chat turn gave: the assistant message (OpenAI's shape, arguments as JSON text), its tokens, whether it
    called, how it ended, and the drafts proposed and accepted."""

    message: dict
    token_ids: tuple[int, ...]
    called: bool
    finish: str
    proposed: int = 0
    accepted: int = 0


ChatFn = Callable[[list[dict], str], Awaitable[TurnOut]]  # (template messages, tool_choice) -> the turn


@dataclass
class TurnRecord:
    seconds: float
    tokens: int
    called: bool
    proposed: int
    accepted: int
    token_ids: tuple[int, ...]
    finish: str = "stop"  # "length": the turn hit its token limit (a call cut there sends nothing back)


@dataclass
class Conversation:
    question: str
    turns: list[TurnRecord] = field(default_factory=list)


def scripted_result(name: str, arguments: dict, corpus: list[str]) -> str:
    """A tool's result, a function of its arguments only (every mode sees the same conversation)."""
    text = json.dumps(arguments, sort_keys=True)
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    if name == "search":
        hits = [corpus[(h + 7 * i) % len(corpus)][:160] for i in range(2)]
        return json.dumps({"query": arguments.get("query", ""), "results": [{"rank": i + 1, "passage": p}
                                                                            for i, p in enumerate(hits)]})
    code = str(arguments.get("code", ""))
    return json.dumps({"status": "ok", "exit_code": 0, "code": code[:120], "stdout": f"{h % 1000}\n"})


def choice_for(turn: int, max_turns: int) -> str:
    """The first turn must call, the last must answer, the rest choose."""
    if turn == max_turns - 1:
        return "none"
    return "required" if turn == 0 else "auto"


def tool_messages(message: dict, corpus: list[str]) -> list[dict]:
    """The assistant's calls as the chat template takes them (arguments as objects), then each call's result."""
    calls = message.get("tool_calls") or []
    assistant = {"role": "assistant", "content": message.get("content") or "", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                         "arguments": json.loads(c["function"]["arguments"])}}
        for c in calls]}
    results = [{"role": "tool", "tool_call_id": c["id"],
                "content": scripted_result(c["function"]["name"], json.loads(c["function"]["arguments"]), corpus)}
               for c in calls]
    return [assistant, *results]


async def converse(question: str, chat: ChatFn, corpus: list[str], max_turns: int) -> Conversation:
    """One conversation, turn by turn, until the model answers or `max_turns` turns were taken."""
    conv = Conversation(question)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for turn in range(max_turns):
        t0 = time.perf_counter()
        out = await chat(messages, choice_for(turn, max_turns))
        conv.turns.append(TurnRecord(time.perf_counter() - t0, len(out.token_ids), out.called, out.proposed,
                                     out.accepted, out.token_ids, out.finish))
        if not out.called:
            break
        messages = messages + tool_messages(out.message, corpus)
    return conv


async def run(questions: list[str], chat: ChatFn, corpus: list[str], concurrency: int,
              max_turns: int) -> tuple[list[Conversation], float]:
    """Every conversation, `concurrency` at a time (a new one starts when one ends); and the run's wall seconds."""
    queue = list(enumerate(questions))
    done: dict[int, Conversation] = {}

    async def worker() -> None:
        while queue:
            i, q = queue.pop(0)
            done[i] = await converse(q, chat, corpus, max_turns)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(questions)))))
    return [done[i] for i in range(len(questions))], time.perf_counter() - t0


def figures(convs: list[Conversation], seconds: float) -> dict:
    """Tokens per second over the run, time per turn (mean and p50), turns, calls, acceptance; `cut`: turns that hit
    the token limit, `answered`: conversations whose last turn was an answer that ended by itself (the loop
    completed: a call, its result, an answer or another call)."""
    turns = [t for c in convs for t in c.turns]
    times = sorted(t.seconds for t in turns)
    proposed, accepted = sum(t.proposed for t in turns), sum(t.accepted for t in turns)
    return {"conversations": len(convs), "turns": len(turns), "calls": sum(t.called for t in turns),
            "cut": sum(t.finish == "length" for t in turns),
            "answered": sum(bool(c.turns) and not c.turns[-1].called and c.turns[-1].finish != "length"
                            for c in convs),
            "tokens": sum(t.tokens for t in turns), "seconds": round(seconds, 2),
            "tok_s": round(sum(t.tokens for t in turns) / seconds, 2),
            "turn_s_mean": round(sum(times) / len(times), 3), "turn_s_p50": round(times[(len(times) - 1) // 2], 3),
            "acceptance": round(accepted / proposed, 3) if proposed else None}
