"""Prefix identity of KV blocks: each full block is named by a hash of its tokens chained with its parent's hash.

Two requests whose token sequences start alike get the same hashes for the blocks they share, and only for
those: block i's hash covers tokens [0, (i + 1) * block_size) through the chain, as in vLLM's automatic prefix
caching and SGLang's radix tree. The chain starts from a root that names everything else that changes a
block's content or who may see it: the model and a tenant's cache salt. The layer range a pipeline stage holds
is not part of the name: each stage has its own pool, and instances split differently must agree on a block's
name for a migration to skip what the destination already holds.

The hash is BLAKE2b, 8 bytes, over the parent's digest and the block's token ids: stable across processes and
machines (Python's `hash` of a str is not), so an instance, the API replica and the router compute the same names.
Plain data, no torch, no Ray.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

BlockHash = int  # an unsigned 64-bit name


def root_hash(model: str, salt: str | None = None) -> BlockHash:
    """The chain's start for `model`, kept apart per `salt` (a tenant that must not share its cache)."""
    text = model if salt is None else f"{model}\x00salt\x00{salt}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def next_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The name of a block holding `tokens` after the block named `parent`."""
    h = hashlib.blake2b(struct.pack("<Q", parent), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, root: BlockHash,
                 known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Names of every full block of `tokens`; `known` (names already computed for a prefix of the same tokens,
    e.g. last step's) are reused, so extending a sequence token by token hashes each block once."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out = list(known[: len(tokens) // block_size])
    parent = out[-1] if out else root
    for start in range(len(out) * block_size, len(tokens) - block_size + 1, block_size):
        parent = next_hash(parent, tokens[start:start + block_size])
        out.append(parent)
    return out


class ChainNames:
    """The names of one growing token sequence's full blocks (a request's prompt and output), each hashed once."""

    def __init__(self, root: BlockHash, block_size: int) -> None:
        self.root, self.block_size = root, block_size
        self._names: list[BlockHash] = []

    def upto(self, tokens: Sequence[int], n: int) -> list[BlockHash]:
        """Names of the full blocks within tokens[:n] (`tokens` only ever grows at its end)."""
        full = n // self.block_size
        if len(self._names) < full:
            self._names = block_hashes(tokens[: full * self.block_size], self.block_size, self.root, self._names)
        return self._names[:full]
