"""The agent workload of `specfleet bench agent` (deploy/bench/agent_loop.py): scripted tools, the turns' tool choices,
the history a call adds, and a whole conversation loop driven by a scripted chat function."""

from __future__ import annotations

import asyncio
import json

from deploy.bench.agent_loop import TOOLS, TurnOut, choice_for, figures, run, scripted_result, tool_messages


def test_the_workload_is_scripted_and_deterministic() -> None:
    corpus = ["alpha passage", "beta passage", "gamma passage"]
    one = scripted_result("search", {"query": "primes"}, corpus)
    assert one == scripted_result("search", {"query": "primes"}, corpus)  # a function of the arguments only
    assert json.loads(one)["query"] == "primes" and len(json.loads(one)["results"]) == 2
    assert json.loads(scripted_result("run_python", {"code": "print(1)"}, corpus))["code"] == "print(1)"
    assert [choice_for(t, 3) for t in range(3)] == ["required", "auto", "none"]
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]}
    assistant, result = tool_messages(message, corpus)
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"query": "x"}  # as templates take them
    assert result["tool_call_id"] == "call_1" and json.loads(result["content"])["query"] == "x"
    assert {t["function"]["name"] for t in TOOLS} == {"search", "run_python"}


def test_the_loop_calls_until_the_model_answers_at_each_concurrency() -> None:
    """A scripted chat: calls on the first two turns, then answers; the loop sends each call's result back."""
    seen: list[tuple[int, str]] = []

    async def chat(messages: list[dict], choice: str) -> TurnOut:
        await asyncio.sleep(0.001)
        seen.append((len(messages), choice))
        calls = sum(m["role"] == "tool" for m in messages)
        if calls < 2:
            call = {"id": f"call_{calls}", "type": "function",
                    "function": {"name": "search", "arguments": json.dumps({"query": messages[1]["content"]})}}
            return TurnOut({"role": "assistant", "content": None, "tool_calls": [call]}, (1, 2, 3), True, "stop", 4, 3)
        return TurnOut({"role": "assistant", "content": "done"}, (5,), False, "stop", 2, 0)

    for concurrency in (1, 3):
        seen.clear()
        convs, seconds = asyncio.run(run(["q1", "q2", "q3"], chat, ["p"], concurrency, max_turns=4))
        assert [len(c.turns) for c in convs] == [3, 3, 3] and [c.question for c in convs] == ["q1", "q2", "q3"]
        assert sorted(seen) == sorted([(2, "required"), (4, "auto"), (6, "auto")] * 3)
        f = figures(convs, seconds)
        assert (f["turns"], f["calls"], f["tokens"], f["acceptance"]) == (9, 6, 21, round(18 / 30, 3))
        assert (f["cut"], f["answered"]) == (0, 3)


def test_a_turn_cut_by_the_token_limit_is_counted_and_ends_its_conversation_unanswered() -> None:
    """A call cut by the limit parses as no call: nothing goes back, the conversation ends, and the figures say it was
    cut rather than answered (the first measurement's every turn was)."""

    async def chat(messages: list[dict], choice: str) -> TurnOut:
        return TurnOut({"role": "assistant", "content": '<tool_call>{"name": "sea'}, (1,) * 40, False, "length")

    convs, seconds = asyncio.run(run(["q1", "q2"], chat, ["p"], 2, max_turns=3))
    f = figures(convs, seconds)
    assert (f["turns"], f["cut"], f["answered"]) == (2, 2, 0)
