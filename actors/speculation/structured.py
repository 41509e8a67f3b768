"""Structured outputs: a request's grammar (JSON schema, JSON object, regex, choice, Lark) as a token mask per position.

Built on llguidance (Microsoft's Rust constrained-decoding engine; its masks cost tens of microseconds a token):
the request's spec is compiled once per distinct spec and tokenizer (off the engine's loop, actors/serving/grammar_pool.py;
kept in a cache bounded in bytes), and each request gets a matcher that has consumed exactly the tokens it emitted.
Speculation goes through the same matcher, which can look ahead and step back:
- a draft model proposes under the mask of the state after its own earlier drafts (so it proposes only allowed
  tokens); a lookup drafter's proposal is cut at its first token the grammar refuses and goes on with the tokens
  the grammar forces after it (`extend`);
- verification masks position j of the target's k + 1 with the state after the round's first j drafts, then
  steps back (`masks`), so the accepted prefix and the recovered or bonus token are what plain constrained
  decoding would emit; only the tokens a round emits are consumed for good (`consume`).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.request import InvalidRequest, StructuredOutput, parse_json_schema

try:  # an optional dependency until a request asks for structured output
    import llguidance
    import llguidance.hf
except ImportError:  # pragma: no cover - exercised only where llguidance is not installed
    llguidance = None


# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace (a model is not left to pad its
# output with whitespace the schema allows; llguidance's flexible default lets a weak model wander in it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar of a spec (not yet checked)."""
    if spec.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json_schema, overrides=JSON_LAYOUT)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.choice))
    if spec.lark is not None:  # tool calls, reasoning (deploy/serve/tools.py builds them)
        return llguidance.LLMatcher.grammar_from_lark(spec.lark)
    raise InvalidRequest("a structured output needs a JSON schema, JSON object mode, a regex or choices",
                         param="response_format")


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec's grammar compiled for one tokenizer: a matcher at its start state, never advanced (each request gets a
    copy of it, a millisecond where compiling took up to seconds), and what it counts against the cache."""

    key: str  # sha256 of the spec
    matcher: object  # llguidance.LLMatcher at the grammar's start
    nbytes: int  # the grammar's text, what the cache's byte bound counts
    vocab_size: int
    eos: tuple[int, ...]

    def start(self) -> "GrammarState":
        """A request's own matcher, at the grammar's start."""
        return GrammarState(self.matcher.deep_copy(), self.vocab_size, self.eos)


def spec_key(spec: StructuredOutput) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


class GrammarCompiler:
    """Grammars of one tokenizer, compiled once per distinct spec and kept while they hold at most `cache_bytes`.

    Safe to call from several threads (actors/serving/grammar_pool.py compiles on a pool, the engine's loop looks up): the
    cache and the refusals are read and written under a lock, a compile runs outside it (llguidance releases the
    GIL while it builds a matcher). A spec refused once (invalid, or too slow to compile: `refuse`) is refused
    again at once, with the same message, while it is remembered (the last REFUSALS_KEPT)."""

    REFUSALS_KEPT = 1024

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_bytes: int = 64 * 2**20) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos = hf_tokenizer, vocab_size, tuple(eos_token_ids)
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._tokenizer = None
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()  # least recently used first
        self._refused: OrderedDict[str, str] = OrderedDict()  # key -> its message
        self.held_bytes = 0  # what the cache holds now, <= cache_bytes

    @property
    def tokenizer(self):
        """llguidance's view of the tokenizer (about a second to build: once, on the first structured request)."""
        if llguidance is None:
            raise InvalidRequest("structured outputs need the llguidance package, which is not installed here",
                                 param="response_format")
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=list(self.eos))
            return self._tokenizer

    def cached(self, spec: StructuredOutput, key: str | None = None) -> CompiledGrammar | None:
        """The spec's compiled grammar if it is kept (InvalidRequest if the spec was refused); None otherwise."""
        key = key or spec_key(spec)
        with self._lock:
            if (message := self._refused.get(key)) is not None:
                raise InvalidRequest(message, param="response_format")
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
            return hit

    def compile(self, spec: StructuredOutput, key: str | None = None) -> CompiledGrammar:
        """The spec's compiled grammar, from the cache or compiled now; InvalidRequest (a 400) naming what is wrong."""
        key = key or spec_key(spec)
        if (hit := self.cached(spec, key)) is not None:
            return hit
        tokenizer = self.tokenizer
        try:
            grammar = grammar_of(spec)
        except (ValueError, TypeError) as e:
            raise self.refuse(key, f"invalid structured output: {e}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise self.refuse(key, f"invalid structured output: {matcher.get_error()[:500]}")
        compiled = CompiledGrammar(key, matcher, len(grammar), self.vocab_size, self.eos)
        self._keep(compiled)
        return compiled

    def matcher(self, spec: StructuredOutput) -> "GrammarState":
        """A request's matcher for `spec` (compiled here if it is not kept: the offline path, tests)."""
        return self.compile(spec).start()

    def refuse(self, key: str, message: str) -> InvalidRequest:
        """Remember `key` as refused with `message`; the error to raise."""
        with self._lock:
            self._refused[key] = message
            self._refused.move_to_end(key)
            while len(self._refused) > self.REFUSALS_KEPT:
                self._refused.popitem(last=False)
        return InvalidRequest(message, param="response_format")

    def _keep(self, compiled: CompiledGrammar) -> None:
        if compiled.nbytes > self.cache_bytes:
            return  # larger than the whole cache: used by its request only
        with self._lock:
            if compiled.key in self._grammars or compiled.key in self._refused:
                return
            self._grammars[compiled.key] = compiled
            self.held_bytes += compiled.nbytes
            while self.held_bytes > self.cache_bytes:
                _, old = self._grammars.popitem(last=False)
                self.held_bytes -= old.nbytes


class GrammarState:
    """One request's matcher: it has consumed exactly the request's emitted tokens between steps."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, frozenset(eos_token_ids)
        self._bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)  # host buffer, reused

    def consume(self, tokens: Sequence[int]) -> None:
        """Tokens the request emitted for good (an end of sequence after a complete grammar ends it: not fed)."""
        tokens = list(tokens)
        while tokens and tokens[-1] in self.eos and self.matcher.is_stopped():
            tokens.pop()
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused an emitted token: {self.matcher.get_error()}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next, as a bool row (V,) on the host."""
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        bits = (self._bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (W, 32)
        return bits.reshape(-1)[: self.vocab_size].bool()

    def masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """Allowed tokens (len(drafts) + 1, V) at each position of a round: position j after `drafts[:j]`."""
        rows = [self.allowed()]
        stepped = 0
        for t in drafts:
            if not self.step(t):
                break  # a draft the grammar refuses is never accepted: later positions cannot matter
            stepped += 1
            rows.append(self.allowed())
        if stepped:
            self.matcher.rollback(stepped)
        while len(rows) < len(drafts) + 1:  # positions after a refused draft: anything (they are never reached)
            rows.append(torch.ones(self.vocab_size, dtype=torch.bool))
        return torch.stack(rows)

    def extend(self, tokens: Sequence[int], k: int) -> list[int]:
        """A lookup's proposal as the grammar lets it go on: `tokens` cut at the first it refuses, then the tokens
        it forces after them (llguidance's fast-forward tokens: the only continuation its bytes allow), k at most.
        The state is left as it was."""
        out = list(tokens[: self.valid_prefix(tokens)])[:k]
        if len(out) >= k or self.matcher.is_stopped():
            return out
        stepped = 0
        for t in out:
            if not self.step(t):
                break
            stepped += 1
        try:
            forced = [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())
        finally:
            self.back(stepped)
        return out[:stepped] + forced[: k - stepped]

    def step(self, token: int) -> bool:
        """Look ahead one proposed token (undone with `back`); False, and no step, if the grammar refuses it."""
        return self.matcher.validate_tokens([token]) == 1 and self.matcher.consume_token(token)

    def back(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    @property
    def finished(self) -> bool:
        """The grammar is complete: only the end of the sequence may follow."""
        return self.matcher.is_stopped()


def parse_schema(text: str, param: str = "structured") -> dict:
    """A JSON schema given as a string (gRPC carries it so), bounded in depth (cluster/request.py)."""
    return parse_json_schema(text, param)


def check(spec: StructuredOutput, param: str) -> None:
    """Check a spec without a tokenizer (no vocabulary to build: the API edge does this before admitting a
    request); InvalidRequest naming `param` if the schema or regex is invalid."""
    if llguidance is None:
        raise InvalidRequest("structured outputs need the llguidance package, which is not installed here",
                             param=param)
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_of(spec))
    except (ValueError, TypeError, RecursionError) as e:
        error = str(e) or type(e).__name__
    if error:
        raise InvalidRequest(f"{param}: invalid structured output: {error[:500]}", param=param)
