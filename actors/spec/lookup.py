"""Model-free drafts: continuations looked up in text already seen, with no draft model, no KV and no forward.

Two lookups, each kept per request and updated incrementally as tokens are appended (a request's token list
only ever grows: rejected drafts never enter it):

- `NgramIndex`, prompt-lookup decoding (Saxena 2023; vLLM's `ngram` method; transformers'
  `prompt_lookup_num_tokens`): find the most recent earlier occurrence of the context's last n tokens
  (n from `max_n` down to `min_n`) and propose the tokens that followed it.
- `SuffixTrie`, SuffixDecoding (Oliaro et al., arXiv 2411.04975): every substring of up to `depth` tokens of
  the request's own context, with occurrence counts; the longest suffix of the context found in the trie
  selects a node, and the proposal follows its most frequent children. `SharedSuffixTrie` holds recent
  finished outputs of all requests (the paper's global tree), consulted when the request's own trie has a
  shorter match.

Proposals are plain token lists (possibly shorter than asked, or empty). For sampled requests the draft's
distribution is a point mass on each proposed token, which rejection sampling (actors/spec/verify.py) takes
as it is, so the output keeps the target's distribution.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.config import SpeculationConfig


class NgramIndex:
    """For n in [min_n, max_n]: each n-gram of a token list -> where its latest continuation starts."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.indexed = 0  # n-grams ending before this position are in `last`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens)
        for e in range(max(self.indexed, self.min_n), end):  # n-grams ending at e (exclusive), e < end
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.last[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end)
        if k <= 0:
            return []
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self.last.get(tuple(tokens[end - n:end]))
            if start is not None and start < end:
                return list(tokens[start:min(start + k, end)])
        return []


@dataclass
class _Node:
    count: int = 0
    children: dict[int, "_Node"] = field(default_factory=dict)


class SuffixTrie:
    """Counts of every substring of up to `depth` tokens of the token lists fed to it."""

    def __init__(self, depth: int = 24) -> None:
        self.depth = depth
        self.root = _Node()
        self._open: deque[_Node] = deque()  # nodes of the suffixes still growing (starting in the last depth-1 tokens)
        self.fed = 0  # tokens fed so far (for the request's own trie: a prefix of its token list)

    def extend(self, tokens: Sequence[int]) -> None:
        """Feed the tokens after the first `fed`: every suffix ending at each new token is counted."""
        for t in tokens[self.fed:]:
            self._open.append(self.root)
            grown: deque[_Node] = deque()
            for node in self._open:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                grown.append(child)
            if len(grown) >= self.depth:
                grown.popleft()  # that suffix reached the depth: it stops growing
            self._open = grown
        self.fed = max(self.fed, len(tokens))

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Count a whole separate sequence (the shared trie's input): its substrings, not joined to the last one."""
        self._open.clear()
        self.fed = 0
        self.extend(tokens)
        self._open.clear()

    def match(self, tokens: Sequence[int]) -> tuple[int, _Node | None]:
        """(length, node) of the longest suffix of `tokens` (at most depth - 1 long) that the trie holds with a
        continuation."""
        for m in range(min(self.depth - 1, len(tokens)), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return m, node
        return 0, None

    @staticmethod
    def follow(node: _Node, k: int) -> list[int]:
        """Up to k tokens along the most frequent child at each step (ties: the smaller token id)."""
        out = []
        while node.children and len(out) < k:
            t, node = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            out.append(t)
        return out


class SharedSuffixTrie:
    """The global trie over the last `max_sequences` finished outputs (rebuilt when it has forgotten half)."""

    def __init__(self, depth: int = 24, max_sequences: int = 256) -> None:
        self.depth, self.max_sequences = depth, max_sequences
        self.recent: deque[tuple[int, ...]] = deque()
        self.trie = SuffixTrie(depth)
        self._stale = 0

    def add(self, tokens: Sequence[int]) -> None:
        self.recent.append(tuple(tokens))
        self.trie.add_sequence(tokens)
        if len(self.recent) > self.max_sequences:
            self.recent.popleft()
            self._stale += 1
            if self._stale * 2 >= self.max_sequences:  # forget the evicted ones' counts
                self.trie = SuffixTrie(self.depth)
                for seq in self.recent:
                    self.trie.add_sequence(seq)
                self._stale = 0


class SuffixDrafter:
    """One request's suffix trie, plus the shared one: propose from whichever matches the longer suffix."""

    def __init__(self, depth: int = 24, shared: SharedSuffixTrie | None = None) -> None:
        self.own = SuffixTrie(depth)
        self.shared = shared

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        self.own.extend(tokens)  # the suffix being matched gets counted; its continuations come from earlier text
        if k <= 0:
            return []
        m, node = self.own.match(tokens)
        if self.shared is not None:
            m2, node2 = self.shared.trie.match(tokens)
            if m2 > m:
                m, node = m2, node2
        return SuffixTrie.follow(node, k) if node is not None else []


NGRAM_MIN, NGRAM_MAX = 2, 4  # n-gram sizes tried, longest first (a 1-gram matches too often to pay)
SUFFIX_DEPTH = 24  # longest substring a suffix trie counts


class Lookups:
    """The engine's model-free drafter: one lookup per running request, by `method`, and the shared trie."""

    def __init__(self, cfg: SpeculationConfig) -> None:
        if cfg.method not in ("ngram", "suffix"):
            raise ValueError(f"no model-free drafter for method {cfg.method!r}")
        self.method = cfg.method
        self.shared = SharedSuffixTrie(SUFFIX_DEPTH) if cfg.method == "suffix" and cfg.suffix_shared else None
        self.per_request: dict[str, NgramIndex | SuffixDrafter] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `tokens` (the request's prompt and output so far)."""
        drafter = self.per_request.get(request_id)
        if drafter is None:
            drafter = self.per_request[request_id] = (
                NgramIndex(NGRAM_MIN, NGRAM_MAX) if self.method == "ngram" else SuffixDrafter(SUFFIX_DEPTH, self.shared))
        return drafter.propose(tokens, k)

    def forget(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)

    def finished(self, output: Sequence[int]) -> None:
        """A request's generated tokens, for the shared trie (suffix method)."""
        if self.shared is not None and output:
            self.shared.add(output)
