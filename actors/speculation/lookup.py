"""Model-free drafting: n-gram prompt lookup and suffix-tree lookup over a request's own tokens (no KV, no forward).

Prompt lookup (Saxena 2023, the method behind transformers' `prompt_lookup_num_tokens` and vLLM's `ngram`
speculator): find the most recent earlier occurrence of the last n tokens (n from `max_n` down to
`min_n`) and propose the tokens that followed it.

Suffix lookup follows SuffixDecoding (Oliaro et al., arXiv 2411.04975): a suffix tree (here a depth-
bounded suffix trie with occurrence counts) over the request's prompt and output, and optionally one over
recently served outputs (per tenant, bounded in tokens: OutputCache); the longest suffix of the context found in a tree selects a
node, and the draft walks its most frequent children while the path's empirical probability
(product of count(child) / count(node)) stays at or above `min_prob`. The verifier here checks one
path, not a token tree, so the draft is the single most likely path.

Both are pure: they see token lists and return token lists. State per request is synced lazily from
the request's accepted tokens, so rejected drafts never enter it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class NgramIndex:
    """The most recent end position of every n-gram (min_n <= n <= max_n) that has a continuation."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its most recent occurrence
        self.indexed = 0  # n-grams ending before this index are in `last`

    def sync(self, tokens: Sequence[int]) -> None:
        """Index n-grams ending at positions < len(tokens) - 1 (each has at least one following token)."""
        for end in range(max(self.indexed, 1), len(tokens)):  # n-gram tokens[end - n:end], continuation tokens[end]
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram matching the end of `tokens`."""
        return self.match(tokens, k)[0]

    def match(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """`propose`'s tokens and the n of the n-gram they follow (0: no match), the evidence behind them."""
        self.sync(tokens)  # n-grams with a continuation: the final one itself is not indexed
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.last.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return list(tokens[end:end + k]), n
        return [], 0


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTrie:
    """Every substring of length <= depth of the inserted token streams, with occurrence counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1, active: list[_Node] | None = None) -> list[_Node]:
        """Insert (sign 1) or remove (sign -1) the substrings ending in `tokens`, continuing a stream whose open
        paths are `active` (the nodes of its last depth - 1 suffixes); returns the new open paths."""
        active = list(active or [])
        for t in tokens:
            nxt = []
            for node in [*active, self.root]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[t]
                    continue
                nxt.append(child)
            active = nxt[-(self.depth - 1):] if self.depth > 1 else []
        return active

    def match(self, context: Sequence[int], max_len: int, continued: bool = False) -> tuple[_Node, int]:
        """The node of the longest suffix of `context` (at most max_len tokens) present in the trie, and its
        length; with `continued`, the longest one that some occurrence continues (a node with children)."""
        for n in range(min(max_len, len(context)), 0, -1):
            node = self.root
            for t in context[len(context) - n:]:
                node = node.children.get(t)
                if node is None:
                    break
            else:
                if node.children or not continued:
                    return node, n
        return self.root, 0

    @staticmethod
    def walk(node: _Node, k: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`: up to k tokens while its probability stays >= min_prob."""
        out: list[int] = []
        prob = 1.0
        while len(out) < k and node.children:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(token)
            node = child
        return out, prob


class SuffixIndex:
    """One request's suffix trie over its prompt and accepted output, synced lazily."""

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.active: list[_Node] = []
        self.indexed = 0

    def sync(self, tokens: Sequence[int]) -> None:
        self.active = self.trie.add(tokens[self.indexed:], active=self.active)
        self.indexed = len(tokens)


class OutputCache:
    """Suffix tries over the outputs of recently finished requests (SuffixDecoding's global tree), one per scope, and
    at most `capacity` tokens of outputs in all: the oldest outputs are forgotten first, whichever scope holds them.

    A scope is a tenant (LookupDrafter gives each API key its own, so no key drafts from, and through the
    proposed-token counts of its responses learns about, another's outputs), or one scope for all when shared.
    Each token adds at most `depth` nodes, so the tries hold at most capacity * depth nodes (`size`).
    """

    def __init__(self, depth: int, capacity: int) -> None:
        self.depth, self.capacity = depth, capacity
        self.tries: dict[str, SuffixTrie] = {}
        self.outputs: deque[tuple[str, tuple[int, ...]]] = deque()  # (scope, output), oldest first
        self.tokens = 0  # tokens of `outputs`

    def trie(self, scope: str) -> SuffixTrie | None:
        return self.tries.get(scope)

    def add(self, scope: str, output: Sequence[int]) -> None:
        if self.capacity <= 0 or not output:
            return
        kept = tuple(output[-self.capacity:])  # an output longer than the whole cache keeps its end
        trie = self.tries.get(scope)
        if trie is None:
            trie = self.tries[scope] = SuffixTrie(self.depth)
        trie.add(kept)
        self.outputs.append((scope, kept))
        self.tokens += len(kept)
        while self.tokens > self.capacity:
            old_scope, old = self.outputs.popleft()
            self.tokens -= len(old)
            old_trie = self.tries[old_scope]
            old_trie.add(old, sign=-1)
            if not old_trie.root.children:
                del self.tries[old_scope]

    def size(self) -> int:
        """Nodes in all tries (roots excluded)."""
        count, stack = 0, [t.root for t in self.tries.values()]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    def clear(self) -> None:
        """Forget every output (a benchmark that replays the same prompts must not draft from their answers)."""
        self.tries.clear()
        self.outputs.clear()
        self.tokens = 0


def suffix_propose(own: SuffixIndex, shared: SuffixTrie | None, tokens: Sequence[int], k: int,
                   min_prob: float) -> list[int]:
    """SuffixDecoding's choice between the request's own tree and the shared one: the longer match wins
    (ties to the more probable path). The request's own tree holds `tokens` up to the end, so the pattern
    always finds itself there: what counts is the longest suffix that an occurrence continues."""
    return suffix_match(own, shared, tokens, k, min_prob)[0]


def suffix_match(own: SuffixIndex, shared: SuffixTrie | None, tokens: Sequence[int], k: int,
                 min_prob: float) -> tuple[list[int], int]:
    """`suffix_propose`'s tokens and the length of the suffix they continue (0: none), the evidence behind them."""
    own.sync(tokens)
    max_len = own.trie.depth - 1
    best, best_key = [], (0, 0.0)
    for trie in (own.trie, shared):
        if trie is None:
            continue
        node, n = trie.match(tokens, max_len, continued=True)
        if n == 0:
            continue
        path, prob = SuffixTrie.walk(node, k, min_prob)
        if path and (n, prob) > best_key:
            best, best_key = path, (n, prob)
    return best, best_key[0]
