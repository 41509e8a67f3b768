"""Per-request output: incremental detokenization and stop conditions (EOS, stop ids, stop strings, length).

Work per token does not grow with the output. The text is decoded incrementally (`Detokenizer`, as vLLM and
TGI do): each new token's text is the decode of a short window of recent tokens less the decode of the same
window without the new ones, so a tokenizer's context effects (a SentencePiece leading space, byte-level
merges) come out as in a decode of the whole output. A stop string is searched for only where it could end in
the new text: from at most len(longest stop) - 1 characters before it (stop strings are bounded:
cluster/request.py, MAX_STOP_CHARS).

Text is released only when it is final: an incomplete UTF-8 sequence (decoded as U+FFFD) waits for the next
tokens, and the last len(longest stop string) - 1 characters are held back until more tokens arrive or the
request ends, so a stream never shows part of a stop string and never has to take text back. As in vLLM, the
stop string itself is not part of the output text; the token that completed it stays in the token ids; EOS is
kept in the ids and (as a special token) left out of the text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from transformers import PreTrainedTokenizerBase

from cluster.request import FinishReason, SamplingParams

MAX_PENDING = 8  # tokens a decode may wait for (an incomplete UTF-8 sequence needs at most 4 byte tokens)


class Detokenizer:
    """A token sequence's text, one token at a time: `step(ids)` after each append returns that token's new text.

    `prefix` and `read` index `ids`: ids[:read] are decoded already; ids[prefix:read] is the window whose decode is
    subtracted from the decode of ids[prefix:] (vLLM's prefix_offset / read_offset). A step decodes at most
    MAX_PENDING + the previous window's tokens, however long the output is.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.prefix = self.read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def step(self, ids: Sequence[int], flush: bool = False) -> str:
        """The text that ids[read:] add; "" while they end inside a UTF-8 sequence (unless `flush`: the end)."""
        before = self._decode(ids[self.prefix:self.read])
        after = self._decode(ids[self.prefix:])
        waiting = len(ids) - self.read < MAX_PENDING
        if not flush and waiting and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""  # more tokens may complete the character, or add text to a window that added none yet
        end = len(ids)
        if not flush and after.endswith("\ufffd"):  # waited long enough: release up to a clean split (below)
            end, after = self._clean_split(ids, after)
        self.prefix, self.read = self.read, end
        return after[len(before):]

    def _clean_split(self, ids: Sequence[int], after: str) -> tuple[int, str]:
        """The latest end in ids[read:] whose text does not depend on the ids after it, with that text.

        A run of invalid bytes waits no longer than MAX_PENDING tokens, but its last few tokens may still begin a
        character (a UTF-8 lead byte waiting for its continuation): the split keeps up to 3 of them pending where
        the decode of the two parts equals the decode of the whole, so the text stays that of the whole output."""
        for end in range(len(ids) - 1, max(self.read, len(ids) - 4), -1):
            head = self._decode(ids[self.prefix:end])
            if head + self._decode(ids[end:]) == after:
                return end, head
        return len(ids), after


class RequestOutput:
    """Accumulates one request's generated tokens and decides when it stops."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        max_new_tokens: int,
    ) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_new_tokens = max_new_tokens  # max_tokens, capped by the model's context
        self.token_ids: list[int] = []
        self.detok = Detokenizer(tokenizer)
        self._released: list[str] = []  # text already released, in chunks
        self.emitted = 0  # characters released
        self._held = ""  # final text not released yet (stop string excluded once found)
        self.finish_reason: FinishReason | None = None
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    @property
    def text(self) -> str:
        """The final text so far (joined on demand: the hot path never builds it)."""
        return "".join(self._released) + self._held

    def restore(self, token_ids: list[int], text_chars: int) -> None:
        """Continue a request generated elsewhere: its tokens so far, of whose text `text_chars` were released."""
        for tok in token_ids:  # replayed as they came, so the detokenizer's windows are the original run's
            self.token_ids.append(tok)
            self._held += self.detok.step(self.token_ids)
        released = min(text_chars, len(self._held))
        self._released, self._held = [self._held[:released]], self._held[released:]
        self.emitted = released

    def append(self, tokens: list[int]) -> list[int]:
        """Add tokens in order until one ends the request; returns the tokens actually taken."""
        taken: list[int] = []
        for tok in tokens:
            taken.append(tok)
            self.token_ids.append(tok)
            ends = tok in self.stop_ids or len(self.token_ids) >= self.max_new_tokens
            hit = self._add_text(self.detok.step(self.token_ids, flush=ends))
            if tok in self.stop_ids or hit:
                self.finish_reason = FinishReason.STOP
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = FinishReason.LENGTH
            if self.finish_reason is not None:
                break
        return taken

    def _add_text(self, new: str) -> bool:
        """Append a token's text; on a stop string ending in it, cut the text where the stop begins and say so."""
        if not new:
            return False
        text = self._held + new
        if self.params.stop:
            since = max(0, len(self._held) - self._hold)  # a stop ending in `new` starts no earlier
            cut = min((i for s in self.params.stop if (i := text.find(s, since)) >= 0), default=-1)
            if cut >= 0:
                self._held = text[:cut]
                return True
        self._held = text
        return False

    def text_delta(self) -> str:
        """Newly final text since the last call."""
        end = len(self._held)
        if self.finish_reason is None:
            end -= self._hold
            while end > 0 and self._held[end - 1] == "\ufffd":
                end -= 1
        if end <= 0:
            return ""
        delta, self._held = self._held[:end], self._held[end:]
        self._released.append(delta)
        self.emitted += len(delta)
        return delta
