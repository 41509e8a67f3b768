"""Per-forward batch layout: which new tokens each sequence runs, at which positions, into which KV slots.

Tokens of all sequences in one forward are packed into one row of N tokens (a prefill chunk, k+1
verification tokens and single decode tokens side by side), so projections and MLPs cost exactly the
real tokens, as in Sarathi-Serve's hybrid batches (arXiv 2403.02310). Only attention uses a padded
(B, T) view: padded query rows attend to slot 0 only, so they never produce NaN, and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.kv.cache import KVCache


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for one forward pass; logits are wanted for the last `num_logits`."""

    request_id: str
    token_ids: tuple[int, ...]
    num_logits: int = 1


@dataclass
class AttentionMetadata:
    """Tensors shared by every layer of one forward over one shard's cache.

    The per-token fields are views of one tensor made in one copy; the padded (B, T) layout that only the
    batched attention reads is made when first asked for (a single sequence on consecutive blocks, `span`,
    never needs it).
    """

    token_ids: torch.Tensor  # (N,) new tokens, packed
    positions: torch.Tensor  # (N,) absolute positions
    slots: torch.Tensor  # (N,) flat cache slots to write
    logits_index: torch.Tensor  # (sum num_logits,) indices into N whose logits are wanted
    block_size: int
    padded_shape: tuple[int, int]  # (B, T)
    packed_is_padded: bool = False  # every sequence brings the same number of tokens: no padding to scatter into
    # one sequence whose blocks are consecutive in the pool: (first flat slot, its length after this forward);
    # attention then reads its K, V in place (KVCache.span)
    span: tuple[int, int] | None = None
    max_position: int = 0  # the largest of `positions`, as a plain int (no device sync to read it)
    # per sequence, in chunk order: (its new tokens, its length after this forward), plain ints
    seqs: tuple[tuple[int, int], ...] = ()
    _layout: tuple = ()  # (pad_index, q_positions, valid, block_tables) as plain ints, for the padded layout
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _masks: dict[object, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def pad_index(self) -> torch.Tensor:
        """(N,) where each packed token sits in the padded (B*T) attention layout."""
        return self._padded("pad_index", 0, torch.long)

    @property
    def q_positions(self) -> torch.Tensor:
        """(B, T) absolute positions in the padded layout."""
        return self._padded("q_positions", 1, torch.long)

    @property
    def valid(self) -> torch.Tensor:
        """(B, T) True for real tokens."""
        return self._padded("valid", 2, torch.bool)

    @property
    def block_tables(self) -> torch.Tensor:
        """(B, nb) blocks to read, the scratch block where padded."""
        return self._padded("block_tables", 3, torch.long)

    def _padded(self, name: str, i: int, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._tensors:
            self._tensors[name] = torch.tensor(self._layout[i], dtype=dtype, device=self.token_ids.device)
        return self._tensors[name]

    @classmethod
    def build(cls, chunks: list[SeqChunk], cache: KVCache) -> "AttentionMetadata":
        """Lay out `chunks` against `cache`, whose blocks for the new tokens must already be reserved.

        The layout is computed as plain ints and lands on the cache's device in one copy.
        """
        b, t = len(chunks), max(len(c.token_ids) for c in chunks)
        tables = [cache.block_table(c.request_id) for c in chunks]
        span = None
        if b == 1:
            length = cache.length(chunks[0].request_id) + len(chunks[0].token_ids)
            used = tables[0][:cache.blocks_for(length)]
            if used == list(range(used[0], used[0] + len(used))):
                span = (used[0] * cache.block_size, length)
        nb = max(len(tab) for tab in tables)
        block_tables = [tab + [cache.scratch_block] * (nb - len(tab)) for tab in tables]  # (B, nb)
        q_positions = [[0] * t for _ in chunks]  # (B, T)
        valid = [[False] * t for _ in chunks]  # (B, T)
        token_ids, positions, slots, pad_index, logits_index = [], [], [], [], []
        offset = 0
        for i, c in enumerate(chunks):
            n, start = len(c.token_ids), cache.length(c.request_id)
            token_ids.extend(c.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(cache.slot_list(c.request_id, start, start + n))
            pad_index.extend(range(i * t, i * t + n))
            q_positions[i][:n] = range(start, start + n)
            valid[i][:n] = [True] * n
            logits_index.extend(range(offset + n - c.num_logits, offset + n))
            offset += n
        ints = torch.tensor(token_ids + positions + slots + logits_index, dtype=torch.long, device=cache.device)
        n = len(token_ids)
        return cls(
            token_ids=ints[:n],
            positions=ints[n:2 * n],
            slots=ints[2 * n:3 * n],
            logits_index=ints[3 * n:],
            block_size=cache.block_size,
            padded_shape=(b, t),
            packed_is_padded=all(len(c.token_ids) == t for c in chunks),
            span=span,
            max_position=max(positions, default=0),
            seqs=tuple((len(c.token_ids), cache.length(c.request_id) + len(c.token_ids)) for c in chunks),
            _layout=(pad_index, q_positions, valid, block_tables),
        )

    def span_mask(self, sliding_window: int | None = None) -> torch.Tensor | None:
        """The mask (1, 1, T, S) of a `span` forward, S = its length: None where every query sees every key (one
        new token, no window it exceeds); else causal, within the window."""
        t, (_, length) = self.num_tokens, self.span
        if t == 1 and (sliding_window is None or length <= sliding_window):
            return None
        key = ("span", sliding_window)
        if key not in self._masks:
            key_pos = torch.arange(length, device=self.positions.device)  # (S,)
            q_pos = self.positions[:, None]  # (T, 1)
            allowed = key_pos <= q_pos
            if sliding_window is not None:
                allowed &= key_pos > q_pos - sliding_window
            self._masks[key] = allowed[None, None]
        return self._masks[key]

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """Boolean attention mask (B, 1, T, S): causal per sequence, within the window if one is set."""
        if sliding_window not in self._masks:
            key_pos = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.valid.device)  # (S,)
            q_pos = self.q_positions.unsqueeze(-1)  # (B, T, 1)
            allowed = key_pos <= q_pos  # (B, T, S)
            if sliding_window is not None:
                allowed &= key_pos > q_pos - sliding_window
            allowed &= self.valid.unsqueeze(-1)
            allowed[..., 0] |= ~self.valid  # padded queries see slot 0 only
            self._masks[sliding_window] = allowed.unsqueeze(1)
        return self._masks[sliding_window]
