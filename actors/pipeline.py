"""PipelineRunner: the ModelRunner interface on the driver, for a model whose layers run as stages elsewhere.

The engine (actors/engine.py) drives a PipelineRunner exactly like a ModelRunner: `forward(chunks)` gives
logits (sum num_logits, V), `reserve` and `cache` account KV in blocks, `model` has the tokenizer and config.
The cache is a KVLedger (actors/kv_ledger.py): block accounting only, recording every reserve, crop and
free; `forward` ships the recorded ops with the chunks in the executor's one call per stage, and the
stages replay them on their own caches before they run. Activations between stages never pass through the
driver (actors/shard.py sends them point-to-point); only the last stage's logits come back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from actors.kv_cache import KVExport, reshard
from actors.kv_ledger import CacheOp, KVLedger
from actors.kv_links import LinkedKV, LinkPart, kv_span
from actors.model.loader import LoadedModel
from actors.model.metadata import SeqChunk
from actors.model.runner import CacheFull
from cluster.config import CacheConfig
from cluster.migration import Link


class ShardFailure(RuntimeError):
    """A shard died, failed, or did not answer in time: the instance cannot go on."""


class StageExecutor(Protocol):
    """Runs a model's stages, wherever they are (actors/local_stages.py: this process; actors/ray_stages.py: Ray
    actors); each call replays `ops` on every stage's cache first, and a stage that fails raises ShardFailure."""

    layer_ids: list[tuple[int, ...]]  # per stage, in pipeline order
    exports_kv: bool  # whether `export` and `import_` work (a layer-parallel draft's KV is rebuilt, not moved)
    kv_links: bool  # whether its stages send and receive a migration's KV themselves (the link methods below)
    replicated_cache: bool  # whether every stage replays every cache op (prefix caching shares blocks only then)

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor | None:
        """One forward through every stage: the last stage's logits (sum num_logits, V); None if no chunks.
        `parallel`: a draft's EasySpec layer groups run in parallel (ModelRunner.forward)."""
        ...

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        """Each stage's KV of tokens [start, end) of a request, in stage order."""
        ...

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        """Write exports[i] into stage i's cache; False if any stage lacks room."""
        ...

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """(used, free) blocks of each stage's own cache, after replaying `ops`."""
        ...

    def kill(self, stages: Sequence[int] | None = None) -> None:
        """Stop the given stages (all by default); any later call raises ShardFailure."""
        ...

    # ---- a migration's links (actors/kv_links.py), where `kv_links`; the first three and the last may be called
    # from any thread, `send_links` and `import_links` only between steps, like `export` and `import_`
    def kv_device(self) -> str:
        """The device type ("cuda" or "cpu") its stages keep their KV on."""
        ...

    def link_addresses(self, stages: list[int], host: str) -> list[str]:
        """A rendezvous address on the node of each of `stages` (`host`: this process's node, for its own)."""
        ...

    def open_links(self, links: list[Link], side: str, timeout_s: float, backend: str) -> None:
        """Each stage joins the links it is an end of (`side` "src": link.src; "dst": link.dst)."""
        ...

    def send_links(self, ops: list[CacheOp], request_id: str, start: int, end: int,
                   links: list[Link]) -> list[LinkPart]:
        """Each stage sends its KV of tokens [start, end) of a request over its links (the sends go on after)."""
        ...

    def receive_links(self, kv: LinkedKV) -> None:
        """Each stage receives the parts sent to it (blocking until they are in)."""
        ...

    def import_links(self, ops: list[CacheOp], kv: LinkedKV) -> bool:
        """Each stage writes what it received of `kv` into its cache; False if any lacks room."""
        ...

    def close_links(self, prefix: str) -> None:
        """Forget the links whose ids start with `prefix`, and what arrived on them."""
        ...


class PipelineRunner:
    """A model split into stages run by `executor`, seen as one runner: a KV ledger here, the tensors there."""

    def __init__(self, model: LoadedModel, cache: CacheConfig, executor: StageExecutor,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.executor = executor
        self.device = torch.device(device)  # where the last stage's logits arrive
        self.cache = KVLedger(cache.num_blocks, cache.block_size)
        covered = sorted(i for ids in executor.layer_ids for i in ids)
        if len(covered) != len(set(covered)):
            raise ValueError(f"stages overlap: {executor.layer_ids}")

    @property
    def layer_ids(self) -> list[int]:
        return [i for ids in self.executor.layer_ids for i in ids]

    @property
    def replicated_cache(self) -> bool:
        """Whether every stage's cache replays every op (block sharing works only then)."""
        return self.executor.replicated_cache

    @property
    def exports_kv(self) -> bool:
        """Whether its KV can be exported and imported (a migration moves it rather than rebuilding it)."""
        return self.executor.exports_kv

    def reserve(self, request_id: str, total_tokens: int) -> bool:
        """Make room for `total_tokens` tokens of a request (in every stage, from the next call on)."""
        return self.cache.reserve(request_id, total_tokens)

    def forward(self, chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor:
        """Run the new tokens of each chunk through all stages; logits (sum num_logits, V) in fp32 (`parallel`: see
        ModelRunner.forward)."""
        if not chunks:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        for c in chunks:
            if not self.cache.reserve(c.request_id, self.cache.length(c.request_id) + len(c.token_ids)):
                raise CacheFull(f"no KV blocks for {c.request_id}")
        logits = self.executor.run(self.cache.drain(), chunks, parallel)  # (sum num_logits, V)
        assert logits is not None
        for c in chunks:
            self.cache.set_length(c.request_id, self.cache.length(c.request_id) + len(c.token_ids))
        return logits

    def expert_stats(self):
        """Expert-parallel figures since the start (actors/moe/ep.py EPStats) when the stages are expert-parallel
        ranks (actors/ep_stages.py), else None."""
        return getattr(self.executor, "totals", None)

    def flush(self) -> None:
        """Ship the ops recorded since the last call (frees after the last step) to every stage now."""
        if self.cache.pending:
            self.executor.run(self.cache.drain(), [])

    # ---- KV migration -----------------------------------------------------------------------
    def export_kv(self, request_id: str, start: int = 0, end: int | None = None,
                  links: list[Link] | None = None) -> list[KVExport] | LinkedKV:
        """KV of tokens [start, end) of a request: one export per stage, or with `links` (a migration's) sent by
        the stages themselves, and what each link carried."""
        end = self.cache.length(request_id) if end is None else end
        if not 0 <= start <= end <= self.cache.length(request_id):
            raise ValueError(f"{request_id}: range [{start}, {end}) outside its {self.cache.length(request_id)} tokens")
        if links is None:
            return self.executor.export(self.cache.drain(), request_id, start, end)
        parts = self.executor.send_links(self.cache.drain(), request_id, start, end, links)
        return LinkedKV(request_id, start, end, tuple(parts))

    def import_kv(self, exports: Sequence[KVExport] | LinkedKV) -> bool:
        """Append KV (exported by any split of the same model's layers, or received by the stages over a migration's
        links) after the request's KV here.

        It must cover every layer of this runner for one token range starting at the request's current length.
        Returns False, changing nothing, if the cache lacks room.
        """
        linked = isinstance(exports, LinkedKV)
        parts = [] if linked else reshard(exports, self.executor.layer_ids)
        rid, start, end = kv_span(exports)
        if start != self.cache.length(rid):
            raise ValueError(f"{rid}: export starts at {start}, the cache holds {self.cache.length(rid)} tokens")
        if not self.cache.reserve(rid, end):
            return False
        ops = self.cache.drain()
        if not (self.executor.import_links(ops, exports) if linked else self.executor.import_(ops, parts)):
            raise ShardFailure(f"{rid}: a stage had no room for imported KV its ledger had reserved")
        self.cache.set_length(rid, end)
        return True
