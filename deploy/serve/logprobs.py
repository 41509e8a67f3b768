"""OpenAI's logprobs bodies from the engine's TokenLogprobs: completions' parallel lists, chat's content entries.

The logprobs are the engine's "processed" ones (cluster/request.py TokenLogprob: after temperature, penalties,
bias and the grammar's mask, as vLLM reports them). A token's string is the tokenizer's decode of that one id,
special tokens included (a token holding part of a multi-byte character decodes to U+FFFD); chat's `bytes` are
that string's UTF-8. JSON has no infinity: a token the processors made impossible reports -9999.0, as vLLM does.
Completions' `top_logprobs` hold the N most likely tokens and the chosen one (so N + 1 at most, as vLLM); chat's
hold the N most likely. `text_offset` counts characters of the token strings from the start of the choice's text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from cluster.request import TokenLogprob

IMPOSSIBLE = -9999.0
Scored = tuple[int, TokenLogprob | None]  # a token id and its logprob (None: the prompt's first token)


class TokenStrings:
    """Each token id's string: the tokenizer's decode of it alone (cached)."""

    def __init__(self, tokenizer, cache_size: int = 1 << 16) -> None:
        self.of = lru_cache(maxsize=cache_size)(lambda token_id: tokenizer.decode([token_id]))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else IMPOSSIBLE


def completion(scored: Sequence[Scored], strings: TokenStrings, offset: int) -> tuple[dict, int]:
    """Completions' `logprobs` of these tokens, their text offsets starting at `offset`; and the offset after them."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, lp in scored:
        text = strings.of(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_finite(lp.logprob))
        alternatives = {strings.of(t): _finite(v) for t, v in lp.top}
        alternatives.setdefault(text, _finite(lp.logprob))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def _entry(strings: TokenStrings, token_id: int, logprob: float) -> dict:
    text = strings.of(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat(generated: Sequence[TokenLogprob], strings: TokenStrings) -> dict:
    """Chat's `logprobs` of these generated tokens."""
    return {"content": [{**_entry(strings, lp.token_id, lp.logprob),
                         "top_logprobs": [_entry(strings, t, v) for t, v in lp.top]} for lp in generated]}
