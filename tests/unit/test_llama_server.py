"""`bench serve --llama-server` (deploy/bench/llama_server.py): the request body, llama-server's SSE stream read into
a Trace by the bench's own client loop (serve.sse_line), on lines recorded from a real llama-server, and the flags.

CI has no llama-server binary, so the stream is tested on recorded lines; starting and stopping the binary is
exercised by the bench only (docs/benchmarks.md, "Against llama.cpp's own server")."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from deploy.bench import llama_server
from deploy.bench.llama_server import binary, body, event, threads
from deploy.bench.serve import Trace, run, sse_line
from deploy.cli.flags import UsageError
from deploy.cli.main import build_parser

# Recorded 2026-11-28 from llama-server (llama.cpp of llama-cpp-python 0.3.36's sdist, GGML_NATIVE without AMX, build
# b1-0c1e570) on smollm2-135m-instruct.gguf with `-np 2 -c 1024 -t 2`: the body of POST /completion with
# body([504, 3575, 282, 4649, 314], 3) ("The capital of France is"), line by line. One event per token, then the final
# event with empty `content`/`tokens`, `stop: true`, `stop_type` and `tokens_predicted`, and no `data: [DONE]`; only
# the final event's `generation_settings` and `timings` are cut down here (to one key each).
STREAM = [
    'data: {"index":0,"content":" Paris","tokens":[7042],"stop":false,"id_slot":-1,"tokens_predicted":1,'
    '"tokens_evaluated":5}',
    "",
    'data: {"index":0,"content":".","tokens":[30],"stop":false,"id_slot":-1,"tokens_predicted":2,'
    '"tokens_evaluated":5}',
    "",
    'data: {"index":0,"content":"\\n","tokens":[198],"stop":false,"id_slot":-1,"tokens_predicted":3,'
    '"tokens_evaluated":5}',
    "",
    'data: {"index":0,"content":"","tokens":[],"id_slot":1,"stop":true,'
    '"model":"/tmp/specfleet-models/smollm2-135m-instruct.gguf","tokens_predicted":3,"tokens_evaluated":5,'
    '"generation_settings":{"n_predict":3},"prompt":"The capital of France is","has_new_line":true,"truncated":false,'
    '"stop_type":"limit","stopping_word":"","tokens_cached":7,"timings":{"prompt_n":5}}',
    "",
]
# the same server's answer to a prompt with an invalid token id (HTTP 400), as an event
ERROR = '{"error":{"code":400,"message":"Prompt contains invalid tokens","type":"invalid_request_error"}}'


def read(lines: list[str]) -> Trace:
    """The lines through the bench's own SSE loop (serve.sse_line) and llama_server.event, a line a second."""
    t = Trace(sent=0.0)
    for i, line in enumerate(lines):
        sse_line(t, line, event, now=float(i + 1))
    return t


def test_the_body_asks_for_exactly_max_tokens_greedy_tokens_of_the_given_ids_streamed() -> None:
    b = body([1, 2, 3], 7)
    assert b["prompt"] == [1, 2, 3] and b["n_predict"] == 7 and b["ignore_eos"] is True and b["stream"] is True
    assert b["temperature"] == 0.0 and b["samplers"] == ["top_k"] and b["top_k"] == 1  # greedy
    assert b["cache_prompt"] is True  # as the served app's prefix caching


def test_a_whole_stream_counts_each_token_by_id_and_ends_at_the_stop_event() -> None:
    t = read(STREAM)
    assert t.ok and t.tokens == 3 and t.finish_reason == "length" and t.done
    assert t.chunk_times == [1.0, 3.0, 5.0]  # one chunk per event with a token; blank lines and the final event none
    assert t.first == 1.0 and t.last == 7.0  # the stream ends at its final event


def test_a_stream_cut_before_its_final_event_is_not_complete() -> None:
    t = read(STREAM[:6])
    assert t.tokens == 3 and not t.done and not t.ok


def test_a_final_count_that_differs_from_the_tokens_carried_fails_the_stream() -> None:
    t = read(STREAM[2:])  # the first token's event lost: 2 carried, 3 predicted
    assert t.done and t.tokens == 2 and not t.ok
    assert "predicted 3 tokens, its stream carried 2" in t.error


def test_an_error_event_fails_the_stream() -> None:
    t = read([f"data: {ERROR}", ""])
    assert t.error == "Prompt contains invalid tokens" and not t.ok


@pytest.mark.parametrize(("stop_type", "reason"), [("limit", "length"), ("eos", "stop"), ("word", "stop")])
def test_llama_servers_stop_type_becomes_an_openai_finish_reason(stop_type: str, reason: str) -> None:
    t = read([STREAM[-2].replace('"stop_type":"limit"', f'"stop_type":"{stop_type}"').replace(
        '"tokens_predicted":3', '"tokens_predicted":0')])
    assert t.finish_reason == reason and t.ok


def test_the_binary_must_be_an_executable_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no executable file there"):
        binary(tmp_path / "llama-server")  # absent
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(UsageError, match="no executable file there"):
        binary(plain)  # not executable
    with pytest.raises(UsageError, match="give the llama-server binary"):
        binary(None)
    exe = tmp_path / "exe"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert binary(exe) == exe and binary(Path(sys.executable).name) is not None  # a path, or a name on PATH


@pytest.mark.parametrize(("cpus", "n"), [(2.0, 2), (0.5, 1), (1.5, 2), (0.0, 1)])
def test_llama_server_gets_the_threads_the_instance_actor_gives_torch(cpus: float, n: int) -> None:
    assert threads(cpus) == n


def test_the_flag_is_checked_before_anything_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(llama_server.ENV, raising=False)

    def args(*flags: str):
        argv = ["bench", "serve", "--url", "http://127.0.0.1:9", *flags]
        return build_parser(argv).parse_args(argv)

    with pytest.raises(UsageError, match="give --throughput N as well"):
        run(args("--llama-server", str(tmp_path / "llama-server")))
    with pytest.raises(UsageError, match="no executable file there"):
        run(args("--throughput", "8", "--llama-server", str(tmp_path / "llama-server")))
    monkeypatch.setenv(llama_server.ENV, str(tmp_path / "from-env"))
    with pytest.raises(UsageError, match="from-env: no executable file there"):
        run(args("--throughput", "8"))  # the environment's binary, checked as the flag's
