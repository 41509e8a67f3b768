"""Per-request output: incremental detokenization equals a decode of the whole output, and its work per token does
not grow with the output's length; stop strings are bounded and found across token boundaries."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from actors.engine.output import MAX_PENDING, RequestOutput
from cluster.request import MAX_STOP_CHARS, FinishReason, SamplingParams


class CountingTokenizer:
    """The real tokenizer, recording how many token ids each decode call is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def decode(self, ids, **kwargs) -> str:
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


def stream(tokenizer, ids: list[int], params: SamplingParams) -> tuple[str, RequestOutput]:
    out = RequestOutput(tokenizer, params, [], len(ids))
    text = ""
    for tok in ids:
        out.append([tok])
        text += out.text_delta()
        if out.finish_reason is not None:
            break
    return text, out


def test_streamed_text_equals_a_decode_of_the_whole_output(tokenizer) -> None:
    rng = random.Random(0)
    multibyte = tokenizer.encode("ñandú 日本語 🎉 héllo wörld", add_special_tokens=False)
    for _ in range(40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))]
        cut = rng.randrange(len(ids))
        ids = ids[:cut] + multibyte + ids[cut:]
        text, _ = stream(tokenizer, ids, SamplingParams(max_tokens=10**6))
        assert text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_long_run_of_invalid_bytes_keeps_a_lead_byte_for_its_continuation(tokenizer) -> None:
    """More lead bytes in a row than a decode waits for (a random model's output does this): the text released
    when the wait runs out must not swallow the last lead byte, which the next token completes."""
    lead, *rest = [t for t in tokenizer.encode("\u05ae", add_special_tokens=False)]  # U+05AE is D6 AE in UTF-8
    assert rest, "the character should take two byte tokens"
    for run in range(1, 3 * MAX_PENDING):
        ids = [lead] * run + rest + tokenizer.encode(" ok", add_special_tokens=False)
        text, _ = stream(tokenizer, ids, SamplingParams(max_tokens=10**6))
        assert text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), run


def test_decoding_work_per_token_does_not_grow_with_the_output(tokenizer) -> None:
    rng = random.Random(1)
    counting = CountingTokenizer(tokenizer)
    ids = [rng.randrange(len(tokenizer)) for _ in range(4000)]
    stream(counting, ids, SamplingParams(max_tokens=10**6, stop=("never appears here",)))
    assert max(counting.calls) <= 2 * MAX_PENDING  # a decode of the whole output would take up to 4000 ids
    early, late = counting.calls[:400], counting.calls[-400:]
    assert sum(late) <= 1.5 * sum(early) + 40  # as much work per token at token 4000 as at token 100


def test_a_stop_string_split_over_tokens_ends_the_output_before_it(tokenizer) -> None:
    ids = tokenizer.encode("one two three STOP four five", add_special_tokens=False)
    text, out = stream(tokenizer, ids, SamplingParams(max_tokens=10**6, stop=("STOP",)))
    assert out.finish_reason == FinishReason.STOP and text == "one two three " and out.text == text


def test_a_restored_output_continues_as_the_uninterrupted_one(tokenizer) -> None:
    ids = tokenizer.encode("ñandú 日本語 and more text after it", add_special_tokens=False)
    full, _ = stream(tokenizer, ids, SamplingParams(max_tokens=10**6))
    k = len(ids) // 2
    first, head = stream(tokenizer, ids[:k], SamplingParams(max_tokens=10**6))
    out = RequestOutput(tokenizer, SamplingParams(max_tokens=10**6), [], len(ids))
    out.restore(ids[:k], len(first) - 1)  # one character of the first part not yet released
    rest = ""
    for tok in ids[k:]:
        out.append([tok])
        rest += out.text_delta()
    assert first[:-1] + rest == full


def test_stop_strings_are_bounded() -> None:
    SamplingParams(stop=("x" * MAX_STOP_CHARS,))
    with pytest.raises(ValidationError, match="at most"):
        SamplingParams(stop=("x" * 60_000,))
