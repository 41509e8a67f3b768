"""Structured outputs' grammars compiled off the engine's loop: a bounded pool, fair among tenants, a time bound.

Compiling a grammar costs up to seconds (llguidance builds a megabyte JSON schema's matcher in about two on one
core), and the engine's loop thread is every stream's: a compile there stalls each of them for as long. An
instance's server (actors/serving/server.py) compiles a request's grammar here before it hands the request to the
loop, which then only copies the compiled matcher (a millisecond):

- the pool's `compile_workers` threads are shared among tenants by cluster/fair_share.py's rules, the tokenizer
  pool's (one tenant on at most all but one thread, at most `compile_queue` waiting, round-robin by tenant); a
  request beyond the queue is refused;
- a compile that takes longer than `compile_timeout_s` is refused (a 400 / INVALID_ARGUMENT naming the bound), and
  so is the same spec sent again, at once, while the compiler remembers it. A thread
  cannot be stopped: the compile goes on to its end and holds its slot (and so its tenant's share) until then;
- compiled grammars are kept for reuse while they hold at most `cache_bytes` (actors/speculation/structured.py), so a
  repeated spec (tool definitions, a response format) is compiled once; a cache hit does not wait for a thread.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

from actors.speculation.structured import CompiledGrammar, GrammarCompiler, spec_key
from cluster.config import GrammarConfig
from cluster.fair_share import FairSlots
from cluster.request import InvalidRequest, StructuredOutput


class GrammarPool:
    """Compile `spec` for a tenant on the pool (see the module docstring); call from one event loop."""

    def __init__(self, compiler: GrammarCompiler, cfg: GrammarConfig) -> None:
        self.compiler, self.timeout_s = compiler, cfg.compile_timeout_s
        self.slots = FairSlots(cfg.compile_workers, cfg.compile_queue, self._full)
        self._executor = ThreadPoolExecutor(cfg.compile_workers, thread_name_prefix="grammar")

    async def compile(self, tenant: str, spec: StructuredOutput) -> CompiledGrammar:
        """The spec's compiled grammar; InvalidRequest if it is invalid, too slow to compile, or the queue is full."""
        key = spec_key(spec)
        if (hit := self.compiler.cached(spec, key)) is not None:
            return hit
        job = await self.slots.submit(self._executor, tenant, self.compiler.compile, spec, key)
        job.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), self.timeout_s)
        except TimeoutError:
            raise self.compiler.refuse(key, f"the structured output's grammar took longer than {self.timeout_s:g} s "
                                       f"to compile (engine.grammar.compile_timeout_s): simplify the schema") from None

    def _full(self, busy: int, queued: int) -> Exception:
        return InvalidRequest(f"{busy} grammars are being compiled and {queued} wait (engine.grammar.compile_queue): "
                              f"retry later", param="response_format")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _retrieve(job: Future) -> None:
    """A compile that ended after its request stopped waiting: its error (if any) was told to nobody else."""
    if not job.cancelled():
        job.exception()
