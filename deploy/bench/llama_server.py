"""llama.cpp's own server (`llama-server -np N`) as a child process: the third side of `bench serve --throughput N`.

The binary is built from the vendored llama.cpp source of llama-cpp-python's PyPI sdist (docs/benchmarks.md says
how); nothing else in the project needs it. The bench starts it on 127.0.0.1 on a free port, on the served config's
GGUF file, with N slots and as many threads as the served config's instance gets, waits for /health within a
deadline and stops it at the end. Its streaming /completion (tools/server/README.md in the llama.cpp tree) takes the
prompt as token ids and sends one SSE event per token, each with that token's id in `tokens`; the last event has
`stop: true`, `stop_type` and `tokens_predicted`, and no `data: [DONE]` follows.

`body` and `event` are what the bench's client sends and how it reads each event (tests/unit/test_llama_server.py);
`LlamaServer` (starting and stopping the binary) is exercised by the bench only.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from deploy.cli.flags import UsageError

ENV = "SPECFLEET_LLAMA_SERVER"  # the binary's path, the default of `bench serve --llama-server`
FINISH = {"limit": "length", "eos": "stop", "word": "stop"}  # llama-server's stop_type as an OpenAI finish_reason


def body(ids: list[int], max_tokens: int) -> dict:
    """A streaming /completion request: the prompt's token ids, greedy (temperature 0 keeps only the top logit; top_k
    1 is the only sampler, so no other one runs), exactly `max_tokens` new tokens (`ignore_eos`). `cache_prompt`
    as the served app's prefix caching: a slot reuses the KV of a prompt it has seen."""
    return {"prompt": list(ids), "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "samplers": ["top_k"], "cache_prompt": True, "stream": True}


def event(t, obj: dict, now: float) -> None:
    """One /completion SSE event into `t` (deploy/bench/serve.py Trace): its tokens counted by id; the last event
    ends the stream, its `tokens_predicted` must equal the tokens counted."""
    if "error" in obj:
        t.error = obj["error"].get("message", "error")
        return
    if n := len(obj.get("tokens") or ()):
        t.tokens += n
        t.first = t.first or now
        t.last = now
        t.chunk_times.append(now)
    if obj.get("stop"):
        t.done, t.last = True, now
        t.finish_reason = FINISH.get(obj.get("stop_type", ""), obj.get("stop_type"))
        if obj.get("tokens_predicted") != t.tokens:
            t.error = f"llama-server predicted {obj.get('tokens_predicted')} tokens, its stream carried {t.tokens}"


def binary(path: str | Path | None) -> Path:
    """The llama-server executable at `path` (a file or a name on PATH); UsageError if there is none."""
    if not path:
        raise UsageError(f"--llama-server: give the llama-server binary's path (or set ${ENV}); "
                         "docs/benchmarks.md says how to build it from llama.cpp's source")
    found = shutil.which(str(path))
    if found is None:
        raise UsageError(f"--llama-server {path}: no executable file there "
                         "(build it from llama.cpp's source: docs/benchmarks.md)")
    return Path(found)


def threads(instance_num_cpus: float) -> int:
    """What the served config's instance gets: the instance actor sets torch's threads to its CPUs, rounded up."""
    return max(1, math.ceil(instance_num_cpus))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server` on `gguf` with `slots` slots of `slot_ctx` tokens each and `n_threads` threads, on 127.0.0.1;
    an async context: started and healthy on entry (within `start_timeout_s`), stopped on exit, always."""

    def __init__(self, exe: Path, gguf: Path, slots: int, slot_ctx: int, n_threads: int,
                 start_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(exe), "-m", str(gguf), "-np", str(slots), "-c", str(slots * slot_ctx), "-t", str(n_threads),
                    "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"]
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.props: dict = {}
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="llama-server-", suffix=".log")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def __aenter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            await self._healthy()
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)

    async def _healthy(self) -> None:
        """Polls /health until 200 (503 while the model loads); UsageError with the log's tail if the process ends
        or the deadline passes."""
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(base_url=self.url, timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise UsageError(f"llama-server exited with code {self.proc.returncode}: {self.log_tail()}")
                try:
                    if (await c.get("/health")).status_code == 200:
                        self.props = (await c.get("/props")).json()
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                await asyncio.sleep(0.25)
        raise UsageError(f"llama-server was not healthy within {self.start_timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 8) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(no output)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; the log file goes with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def describe(self) -> dict:
        """For the report: the command, the build (`/props`), its slots."""
        return {"command": " ".join(self.cmd), "build_info": self.props.get("build_info"),
                "total_slots": self.props.get("total_slots")}
