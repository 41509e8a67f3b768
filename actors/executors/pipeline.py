"""PipelineRunner: the ModelRunner interface on the driver, for a model whose layers run as stages elsewhere.

The engine (actors/engine/core.py) drives a PipelineRunner exactly like a ModelRunner: `forward(chunks)` gives
logits (sum num_logits, V), `reserve` and `cache` account KV in blocks, `model` has the tokenizer and config.
The cache is a KVLedger (actors/kv/ledger.py): block accounting only, recording every reserve, crop and
free; `forward` ships the recorded ops with the chunks in the executor's one call per stage, and the
stages replay them on their own caches before they run. What the runner can do beyond a forward follows
from the protocols its executor implements (actors/executors/protocol.py): moving KV (ExportsKV), over the stages' own
links (KVLinks), and expert-parallel figures (ExpertRanks). Activations between stages never pass through the
driver (actors/shards/stage.py sends them point-to-point); only the last stage's logits come back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.executors.protocol import ExpertRanks, ExportsKV, KVLinks, ShardFailure, StageExecutor, StageRun
from actors.kv.cache import KVExport, reshard
from actors.kv.ledger import KVLedger
from actors.kv.links import LinkedKV, MigratedKV, kv_span
from actors.model.loader import LoadedModel
from actors.model.metadata import SeqChunk
from actors.model.runner import CacheFull
from actors.moe.ep import EPStats
from cluster.config import CacheConfig
from cluster.migration_messages import Link


class PipelineRunner:
    """A model split into stages run by `executor`, seen as one runner: a KV ledger here, the tensors there."""

    def __init__(self, model: LoadedModel, cache: CacheConfig, executor: StageExecutor,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.executor = executor
        self.device = torch.device(device)  # where the last stage's logits arrive
        self.cache = KVLedger(cache.num_blocks, cache.block_size)
        # expert-parallel figures since the start, from every step's StageRun (ExpertRanks executors only)
        self._experts = EPStats() if isinstance(executor, ExpertRanks) else None
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
        return isinstance(self.executor, ExportsKV)

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
        logits = self._run(chunks, parallel).logits  # (sum num_logits, V)
        assert logits is not None
        for c in chunks:
            self.cache.set_length(c.request_id, self.cache.length(c.request_id) + len(c.token_ids))
        return logits

    def expert_stats(self) -> EPStats | None:
        """Expert-parallel figures since the start (actors/moe/ep.py EPStats) when the stages are expert-parallel
        ranks (actors/executors/experts.py), else None."""
        return self._experts

    def flush(self) -> None:
        """Ship the ops recorded since the last call (frees after the last step) to every stage now."""
        if self.cache.pending:
            self._run([])

    def _run(self, chunks: list[SeqChunk], parallel: bool = False) -> StageRun:
        """The executor's call with the ops recorded so far; its expert figures are added to the totals."""
        out = self.executor.run(self.cache.drain(), chunks, parallel)
        if self._experts is not None and out.experts is not None:
            self._experts.add(out.experts)
        return out

    # ---- KV migration -----------------------------------------------------------------------
    def export_kv(self, request_id: str, start: int = 0, end: int | None = None,
                  links: list[Link] | None = None) -> MigratedKV:
        """KV of tokens [start, end) of a request: one export per stage, or with `links` (a migration's) sent by
        the stages themselves, and what each link carried."""
        end = self.cache.length(request_id) if end is None else end
        if not 0 <= start <= end <= self.cache.length(request_id):
            raise ValueError(f"{request_id}: range [{start}, {end}) outside its {self.cache.length(request_id)} tokens")
        if links is None:
            return self._moves().export(self.cache.drain(), request_id, start, end)
        parts = self._links().send_links(self.cache.drain(), request_id, start, end, links)
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
        if not (self._links().import_links(ops, exports) if linked else self._moves().import_(ops, parts)):
            raise ShardFailure(f"{rid}: a stage had no room for imported KV its ledger had reserved")
        self.cache.set_length(rid, end)
        return True

    def _moves(self) -> ExportsKV:
        """The executor as one whose KV moves; TypeError if it is not (ask `exports_kv` first)."""
        if not isinstance(self.executor, ExportsKV):
            raise TypeError(f"{type(self.executor).__name__} keeps its KV where it is: it cannot export or import it")
        return self.executor

    def _links(self) -> KVLinks:
        """The executor as one whose stages carry a migration's KV over links; TypeError if it is not."""
        if not isinstance(self.executor, KVLinks):
            raise TypeError(f"{type(self.executor).__name__}'s stages take no links: its KV goes through this process")
        return self.executor
