"""Prefix identity of KV blocks: each full block is named by a hash of its tokens chained with its parent's hash.

Two requests whose token sequences start alike get the same hashes for the blocks they share, and only for
those: block i's hash covers tokens [0, (i + 1) * block_size) through the chain, as in vLLM's automatic prefix
caching and SGLang's radix tree. The chain starts from a root that names everything else that changes a
block's content or who may see it: the model, the tenant (an API key's name, never the key: unless the fleet
shares its cache across tenants, `engine.cache.share_across_tenants`) and a request's cache salt. A cache shared
across tenants is a side channel: a tenant timing (or counting) its own hits learns what another's prompts began
with (the prompt-leak timing attack of arXiv 2411.18191), so the default keeps each tenant's blocks to itself
(vLLM's `cache_salt` does the same per request). The layer range a pipeline stage holds
is not part of the name: each stage has its own pool, and instances split differently must agree on a block's
name for a migration to skip what the destination already holds.

The hash is BLAKE2b, 16 bytes, over the parent's digest and the block's token ids: stable across processes and
machines (Python's `hash` of a str is not), so an instance, the API replica and the router compute the same names.
128 bits, not 64: a name is trusted as the block's content, and a 64-bit name falls to a birthday search of about
2^32 crafted blocks, which would let one request poison another's cache (vLLM moved to SHA-256 names
after its advisory GHSA-rm76-4mrf-v9r8 showed predictable collisions of its builtin hash).
Plain data, no torch, no Ray.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = int  # an unsigned 128-bit name
_DIGEST = 16  # bytes


def root_hash(model: str, salt: str | None = None, tenant: str | None = None) -> BlockHash:
    """The chain's start for `model`, kept apart per `tenant` (None: shared by all) and per `salt`."""
    text = repr((model, tenant, salt))  # each part in its own field: no salt spells another tenant's root
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=_DIGEST).digest(), "little")


def request_root(model: str, tenant: str, salt: str | None, share_across_tenants: bool) -> BlockHash:
    """The root of a request's chains: its tenant's own unless the fleet shares its cache across tenants (the one
    place that decides it, for the engine that names the blocks and the API replica that routes by them)."""
    return root_hash(model, salt, None if share_across_tenants else tenant)


def next_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The name of a block holding `tokens` after the block named `parent`."""
    h = hashlib.blake2b(parent.to_bytes(_DIGEST, "little"), digest_size=_DIGEST)
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
