"""Per-forward batch layout: which new tokens each sequence runs, at which positions, into which KV slots.

Sequences in one forward are ragged (a prefill chunk, k+1 verification tokens, one decode token):
they are padded to T new tokens. Padded positions write to the cache's scratch block and attend to
slot 0 only, so they never touch real data and never produce NaN; their outputs are discarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.kv_cache import KVCache


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for one forward pass; logits are wanted for the last `num_logits`."""

    request_id: str
    token_ids: tuple[int, ...]
    num_logits: int = 1


@dataclass
class AttentionMetadata:
    """Tensors shared by every layer of one forward over one shard's cache."""

    token_ids: torch.Tensor  # (B, T) new tokens, 0 where padded
    positions: torch.Tensor  # (B, T) absolute positions
    valid: torch.Tensor  # (B, T) True for real tokens
    slots: torch.Tensor  # (B*T,) flat cache slots to write, scratch slot where padded
    block_tables: torch.Tensor  # (B, nb) blocks to read, scratch block where padded
    logits_index: torch.Tensor  # (sum num_logits,) flat indices into B*T whose logits are wanted
    block_size: int
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, chunks: list[SeqChunk], cache: KVCache) -> "AttentionMetadata":
        """Lay out `chunks` against `cache`, whose blocks for the new tokens must already be reserved."""
        b, t = len(chunks), max(len(c.token_ids) for c in chunks)
        bs = cache.block_size
        scratch_slot = cache.scratch_block * bs
        token_ids = torch.zeros(b, t, dtype=torch.long)
        positions = torch.zeros(b, t, dtype=torch.long)
        valid = torch.zeros(b, t, dtype=torch.bool)
        slots = torch.full((b, t), scratch_slot, dtype=torch.long)
        tables = [cache.block_table(c.request_id) for c in chunks]
        nb = max(len(tab) for tab in tables)
        block_tables = torch.full((b, nb), cache.scratch_block, dtype=torch.long)
        logits_index = []
        for i, (c, tab) in enumerate(zip(chunks, tables)):
            n, start = len(c.token_ids), cache.length(c.request_id)
            token_ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
            positions[i, :n] = torch.arange(start, start + n)
            valid[i, :n] = True
            slots[i, :n] = cache.slots(c.request_id, start, start + n)
            block_tables[i, : len(tab)] = torch.tensor(tab, dtype=torch.long)
            logits_index.extend(range(i * t + n - c.num_logits, i * t + n))
        return cls(
            token_ids=token_ids,
            positions=positions,
            valid=valid,
            slots=slots.view(-1),
            block_tables=block_tables,
            logits_index=torch.tensor(logits_index, dtype=torch.long),
            block_size=bs,
        )

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """Boolean attention mask (B, 1, T, S): causal per sequence, within the window if one is set."""
        if sliding_window not in self._masks:
            key_pos = torch.arange(self.block_tables.shape[1] * self.block_size)  # (S,)
            q_pos = self.positions.unsqueeze(-1)  # (B, T, 1)
            allowed = key_pos <= q_pos  # (B, T, S)
            if sliding_window is not None:
                allowed &= key_pos > q_pos - sliding_window
            allowed &= self.valid.unsqueeze(-1)
            allowed[..., 0] |= ~self.valid  # padded queries see slot 0 only
            self._masks[sliding_window] = allowed.unsqueeze(1)
        return self._masks[sliding_window]
