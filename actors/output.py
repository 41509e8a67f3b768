"""Per-request output: incremental detokenization and stop conditions (EOS, stop ids, stop strings, length).

Text is released only when it is final: an incomplete UTF-8 sequence (decoded as U+FFFD) and the
last len(longest stop string) - 1 characters are held back until more tokens arrive or the request
ends, so a stream never shows part of a stop string and never has to take text back. As in vLLM,
the stop string itself is not part of the output text; the token that completed it stays in the
token ids; EOS is kept in the ids and (as a special token) left out of the text.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from cluster.request import FinishReason, SamplingParams


class RequestOutput:
    """Accumulates one request's generated tokens and decides when it stops."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        max_new_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_new_tokens = max_new_tokens  # max_tokens, capped by the model's context
        self.token_ids: list[int] = []
        self.text = ""  # final text so far (stop string excluded once found)
        self.emitted = 0  # characters of `text` already released
        self.finish_reason: FinishReason | None = None
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def restore(self, token_ids: list[int], text_chars: int) -> None:
        """Continue a request generated elsewhere: its tokens so far, of whose text `text_chars` were released."""
        self.token_ids = list(token_ids)
        self._update_text()
        self.emitted = min(text_chars, len(self.text))

    def append(self, tokens: list[int]) -> list[int]:
        """Add tokens in order until one ends the request; returns the tokens actually taken."""
        taken: list[int] = []
        for tok in tokens:
            taken.append(tok)
            self.token_ids.append(tok)
            hit = self._update_text()
            if tok in self.stop_ids or hit:
                self.finish_reason = FinishReason.STOP
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = FinishReason.LENGTH
            if self.finish_reason is not None:
                break
        return taken

    def _update_text(self) -> bool:
        """Re-decode; on a stop string in the new text, cut the text where it begins and say so."""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.params.stop:
            since = max(0, len(self.text) - self._hold - 1)  # text before this was already searched
            cut = min((i for s in self.params.stop if (i := text.find(s, since)) >= 0), default=-1)
            if cut >= 0:
                self.text = text[:cut]
                return True
        self.text = text
        return False

    def text_delta(self) -> str:
        """Newly final text since the last call."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= self._hold
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
        delta = self.text[self.emitted : max(end, self.emitted)]
        self.emitted += len(delta)
        return delta

