"""At temperature 0 the engine's output is token for token the target's own greedy output, in every mode."""

from __future__ import annotations

import pytest

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.engine.sequence import EngineSequence
from cluster.config import SchedulerConfig, SpeculationConfig
from cluster.request import FinishReason, Request, SamplingParams
from tests.fixtures.tiny_models import FAMILIES
from tests.unit.helpers import Result, drain, load, reference_greedy, runner, text_prompts

NEW_TOKENS = 24  # with prompts of up to 40 tokens, sequences run well past mistral's sliding window of 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# batch size -> first question: each set holds prompts whose greedy continuation ends with EOS (see helpers)
PROMPT_OFFSET = {1: 13, 4: 10, 8: 2}


def make_engine(tiny_models, tiny_draft_models, family: str, draft: str, k: int, num_blocks: int = 256,
                max_batch_size: int = 8, max_num_batched_tokens: int = 256, policy: str = "fixed",
                backend: str = "auto") -> Engine:
    """The target alone, with its perturbed copy as draft, with its layers [0, 3] as a self-speculative draft, or
    with a model-free drafter (n-gram prompt lookup, suffix tree); `backend` picks the path both run on."""
    target = load(tiny_models[family], backend)
    draft_runner = {
        "pair": lambda: runner(load(tiny_draft_models[family], backend), num_blocks=num_blocks),
        "layers": lambda: runner(target, [0, 3], num_blocks=num_blocks),
        "none": lambda: None, "ngram": lambda: None, "suffix": lambda: None,
    }[draft]()
    method = draft if draft in ("ngram", "suffix") else "model"
    speculation = SpeculationConfig(policy=policy, k=k, method=method, ngram={"min_n": 1, "max_n": 3})
    return Engine(runner(target, num_blocks=num_blocks), draft_runner, speculation,
                  SchedulerConfig(max_batch_size=max_batch_size, max_num_batched_tokens=max_num_batched_tokens))


def assert_all_blocks_free(engine: Engine) -> None:
    assert engine.target.cache.num_used_blocks == 0
    if engine.draft is not None:
        assert engine.draft.cache.num_used_blocks == 0


def assert_kv_accounting(engine: Engine) -> None:
    """Queued and preempted requests hold no blocks; running ones hold KV of all their tokens but the newest,
    and every used block belongs to a running request."""
    caches = [engine.target.cache] + ([engine.draft.cache] if engine.draft is not None else [])
    for seq in engine.waiting:
        assert not any(c.has(seq.request_id) for c in caches), f"waiting {seq.request_id} holds KV blocks"
    for seq in engine.running:  # n-1 once the prompt is processed; less while it is (re)computed in chunks
        assert engine.target.cache.length(seq.request_id) <= len(seq.token_ids) - 1
        if seq.output.token_ids and seq.num_preemptions == 0:
            assert engine.target.cache.length(seq.request_id) == len(seq.token_ids) - 1
    owned = sum(len(c.block_table(s.request_id)) for s in engine.running for c in caches if c.has(s.request_id))
    assert owned == sum(c.num_used_blocks for c in caches)


def assert_matches_reference(engine: Engine, path, prompt: list[int], result, max_tokens: int) -> None:
    reference = reference_greedy(path, prompt, max_tokens)
    assert result.token_ids == reference
    ended_by_eos = reference[-1] in engine.eos_token_ids
    assert ended_by_eos or len(reference) == max_tokens
    assert result.finish_reason == (FinishReason.STOP if ended_by_eos else FinishReason.LENGTH)
    assert result.text == engine.tokenizer.decode(reference, skip_special_tokens=True)


# ---- the promise ----------------------------------------------------------------------------------
CASES = [(d, k) for d in ("pair", "layers", "ngram", "suffix") for k in (1, 3, 5)] + [("none", 0)]


@pytest.mark.heavy
@pytest.mark.parametrize("batch_size", [1, 4, 8])
@pytest.mark.parametrize(("draft", "k"), CASES, ids=[f"{d}-k{k}" for d, k in CASES])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_the_targets_own(tiny_models, tiny_draft_models, family, draft, k, batch_size) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, family, draft, k)
    prompts = text_prompts(engine.target.model, batch_size, offset=PROMPT_OFFSET[batch_size])

    completions = generate(engine, prompts, GREEDY)

    for prompt, completion in zip(prompts, completions):
        assert_matches_reference(engine, tiny_models[family], prompt, completion, NEW_TOKENS)
    assert_all_blocks_free(engine)
    if draft != "none":
        assert sum(c.stats.proposed for c in completions) > 0
        if draft == "pair":  # the perturbed copy agrees often; the test is only meaningful if drafts get accepted
            assert sum(c.stats.accepted for c in completions) > 0
    for c in completions:
        s = c.stats
        assert 0 <= s.accepted <= s.proposed <= k * s.rounds
        assert sum(s.accepted_per_position) == s.accepted
        if draft == "none":
            assert s.proposed == s.rounds == 0
        elif draft in ("ngram", "suffix"):  # a lookup without a match proposes nothing: a step of one token
            assert s.rounds <= len(s.k_history) and len(c.token_ids) <= s.accepted + len(s.k_history)
        elif c.finish_reason == FinishReason.LENGTH:  # rounds emit accepted + 1; only a last 1-token round is undrafted
            assert len(c.token_ids) - (s.accepted + s.rounds) in (0, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prompt_sets_exercise_eos(tiny_models, family: str) -> None:
    """Guard: for every family some prompt above has a greedy continuation that ends with EOS early."""
    model = load(tiny_models[family])
    ended = []
    for batch_size, offset in PROMPT_OFFSET.items():
        for prompt in text_prompts(model, batch_size, offset):
            ref = reference_greedy(tiny_models[family], prompt, NEW_TOKENS)
            ended.append(len(ref) < NEW_TOKENS and ref[-1] in model.eos_token_ids)
    assert any(ended)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_requests_with_top_k_1_are_greedy_and_do_not_disturb_greedy_ones(tiny_models, tiny_draft_models,
                                                                                   family: str) -> None:
    """top_k=1 sends sampled requests through rejection sampling with one-hot p and q: the output must be greedy."""
    engine = make_engine(tiny_models, tiny_draft_models, family, "pair", k=3)
    prompts = text_prompts(engine.target.model, 8, offset=PROMPT_OFFSET[8])
    params = [SamplingParams(temperature=0.8, top_k=1, max_tokens=NEW_TOKENS, seed=i) if i % 2 else GREEDY
              for i in range(len(prompts))]
    free_running = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=99)  # shares the batch, not compared

    completions = generate(engine, [*prompts, prompts[0]], [*params, free_running])

    for prompt, completion in zip(prompts, completions):
        assert_matches_reference(engine, tiny_models[family], prompt, completion, NEW_TOKENS)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_token_prompts_and_running_up_to_the_context_end(tiny_models, tiny_draft_models, family: str) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, family, "pair", k=5)
    tokens = text_prompts(engine.target.model, 1, offset=8)[0]  # question 8: 3 tokens
    context = engine.max_model_len
    long = (tokens * context)[: context - 6]
    prompts = [[tokens[0]], [tokens[1]], long]
    max_tokens = [NEW_TOKENS, NEW_TOKENS, 6]  # the last ends exactly at the context length

    completions = generate(engine, prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])

    for prompt, m, completion in zip(prompts, max_tokens, completions):
        assert_matches_reference(engine, tiny_models[family], prompt, completion, m)
    assert_all_blocks_free(engine)


# ---- stopping -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_max_tokens_is_hit_exactly(tiny_models, tiny_draft_models, family: str) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, family, "pair", k=5)
    model = engine.target.model
    # a prompt whose greedy continuation runs the full length, so only max_tokens can stop it
    prompt = next(p for p in text_prompts(model, 8)
                  if not set(reference_greedy(tiny_models[family], p, NEW_TOKENS)) & model.eos_token_ids)
    reference = reference_greedy(tiny_models[family], prompt, NEW_TOKENS)
    limits = [1, 2, 5, 6, 7, 11, 13]  # around multiples of k + 1 = 6

    completions = generate(engine, [prompt] * len(limits),
                           [SamplingParams(temperature=0, max_tokens=m) for m in limits])

    for m, completion in zip(limits, completions):
        assert completion.finish_reason == FinishReason.LENGTH
        assert completion.token_ids == reference[:m]
    assert_all_blocks_free(engine)


def _expected_stop(tokenizer, reference: list[int], stop: tuple[str, ...]) -> tuple[list[int], str]:
    """The shortest reference prefix whose text contains a stop string, and its text cut before the stop string."""
    for i in range(1, len(reference) + 1):
        text = tokenizer.decode(reference[:i], skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            return reference[:i], text[: min(cuts)]
    raise AssertionError("the stop string is not in the reference")


def _stop_strings(text: str) -> list[str]:
    """Substrings of the reference text starting at different offsets (early to late), 1 to 4 characters.

    Random-weight models emit stray bytes that decode to U+FFFD until completed; stop strings avoid them.
    """
    picks = []
    for frac, length in ((0.0, 3), (0.1, 1), (0.3, 2), (0.55, 4), (0.8, 3), (0.95, 1)):
        for start in range(int(len(text) * frac), len(text) - length + 1):
            s = text[start : start + length]
            if "\ufffd" not in s:
                if s not in picks:
                    picks.append(s)
                break
    return picks


@pytest.mark.heavy
@pytest.mark.parametrize("family", FAMILIES)
def test_stop_strings_end_the_output_right_before_them(tiny_models, tiny_draft_models, family: str) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, family, "pair", k=3)
    tok = engine.tokenizer
    cases = []
    for prompt in text_prompts(engine.target.model, 3):
        reference = reference_greedy(tiny_models[family], prompt, NEW_TOKENS)
        text = tok.decode(reference, skip_special_tokens=True)
        for s in _stop_strings(text):
            cases.append((prompt, reference, (s,)))
        mid = len(text) // 2
        pairs = [(text[-2:], text[mid : mid + 2]),  # the earlier wins
                 (text[mid + 1 : mid + 3], text[mid : mid + 3])]  # both end at once
        # a U+FFFD in a prefix's decode may be a character still incomplete, which a stream never shows as text
        cases += [(prompt, reference, stop) for stop in pairs if not any("\ufffd" in s for s in stop)]
    assert len(cases) >= 12

    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop=stop) for _, _, stop in cases]
    completions = generate(engine, [prompt for prompt, _, _ in cases], params)

    for (prompt, reference, stop), completion in zip(cases, completions):
        ids, text = _expected_stop(tok, reference, stop)
        assert completion.token_ids == ids, stop
        assert completion.text == text, stop
        assert completion.finish_reason == FinishReason.STOP
        assert not any(s in completion.text for s in stop)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_token_ids_end_the_output_after_them(tiny_models, tiny_draft_models, family: str) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, family, "pair", k=3)
    cases = []
    for prompt in text_prompts(engine.target.model, 3):
        reference = reference_greedy(tiny_models[family], prompt, NEW_TOKENS)
        for pos in (0, len(reference) // 3, len(reference) // 2, len(reference) - 2):
            cases.append((prompt, reference, reference[pos]))

    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=(t,)) for _, _, t in cases]
    completions = generate(engine, [prompt for prompt, _, _ in cases], params)

    for (prompt, reference, token), completion in zip(cases, completions):
        expected = reference[: reference.index(token) + 1]  # its first occurrence stops the request
        assert completion.token_ids == expected
        assert completion.finish_reason == FinishReason.STOP
        # the stop token stays in the ids; whether its text is shown is a convention (vLLM leaves it out)
        full = engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.text in (full, engine.tokenizer.decode(expected[:-1], skip_special_tokens=True))
    assert_all_blocks_free(engine)


def test_ignore_eos_runs_past_eos(tiny_models, tiny_draft_models) -> None:
    family = "qwen2"
    model = load(tiny_models[family])
    hits = [p for p in text_prompts(model, 8, offset=PROMPT_OFFSET[8])
            if reference_greedy(tiny_models[family], p, NEW_TOKENS)[-1] in model.eos_token_ids]
    assert hits, "no prompt's greedy continuation ends with EOS within NEW_TOKENS"
    prompt = hits[0]
    reference = reference_greedy(tiny_models[family], prompt, NEW_TOKENS)
    assert len(reference) < NEW_TOKENS
    engine = make_engine(tiny_models, tiny_draft_models, family, "pair", k=3)
    [completion] = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))

    assert completion.finish_reason == FinishReason.LENGTH
    assert len(completion.token_ids) == NEW_TOKENS
    assert completion.token_ids[: len(reference)] == reference


# ---- scheduling -----------------------------------------------------------------------------------
@pytest.mark.heavy
@pytest.mark.parametrize(("family", "draft", "urgent"), [
    ("llama", "pair", False), ("mistral", "none", False), ("qwen2_moe", "layers", False), ("qwen2", "pair", True),
])
def test_preemption_under_a_small_cache_keeps_the_output(tiny_models, tiny_draft_models, family, draft, urgent) -> None:
    # 15 usable blocks of 4 tokens = 60 slots: one request fits (<= 31 + 24 + k tokens), four at once do not
    engine = make_engine(tiny_models, tiny_draft_models, family, draft, k=3, num_blocks=16)
    prompts = [p for p in text_prompts(engine.target.model, 8) if len(p) <= 31][:4]
    for i, prompt in enumerate(prompts):  # with `urgent`, the last to arrive has the highest priority
        engine.add_request(Request(f"r{i}", tuple(prompt), GREEDY, priority=int(urgent and i == len(prompts) - 1)))
    sequences: list[EngineSequence] = list(engine.waiting)

    results = drain(engine, check=assert_kv_accounting)

    assert sum(seq.num_preemptions for seq in sequences) >= 1
    # the victim is the lowest-priority, latest-arrived running request: the first in order is never preempted
    assert min(sequences, key=EngineSequence.order_key).num_preemptions == 0
    for i, prompt in enumerate(prompts):
        assert_matches_reference(engine, tiny_models[family], prompt, results[f"r{i}"], NEW_TOKENS)
    assert_all_blocks_free(engine)


def test_a_draft_cache_smaller_than_the_targets_only_turns_drafting_off(tiny_models, tiny_draft_models) -> None:
    """Draft KV is optional: when only the draft runs out of blocks, requests go on with k=0 (never preempted)."""
    target = load(tiny_models["mixtral"])
    draft = runner(load(tiny_draft_models["mixtral"]), num_blocks=16)
    engine = Engine(runner(target, num_blocks=256), draft, SpeculationConfig(k=3))
    prompts = [p for p in text_prompts(target, 8) if len(p) <= 31][:4]
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tuple(prompt), GREEDY))
    sequences = list(engine.waiting)

    results = drain(engine, check=assert_kv_accounting)

    assert sum(seq.num_preemptions for seq in sequences) == 0
    # some rounds drafted, and some went without for want of draft blocks (not only the capped last ones)
    assert any(seq.stats.proposed for seq in sequences)
    assert any(0 in seq.stats.k_history[:-3] for seq in sequences)
    for i, prompt in enumerate(prompts):
        assert_matches_reference(engine, tiny_models["mixtral"], prompt, results[f"r{i}"], NEW_TOKENS)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("urgent_arrives_last", [False, True])
def test_the_preemption_victim_is_the_lowest_priority_latest_request(tiny_models, tiny_draft_models,
                                                                     urgent_arrives_last: bool) -> None:
    """The request first in order fills its blocks first; when it must grow, the other one is preempted, not it."""
    engine = make_engine(tiny_models, tiny_draft_models, "llama", "none", k=0, num_blocks=7)  # 6 usable blocks
    full, short = text_prompts(engine.target.model, 1, offset=0)[0][:12], text_prompts(engine.target.model, 1, 1)[0]
    assert len(short) == 9  # both take 3 blocks; the next round `full` needs a 4th, and none is free
    params = SamplingParams(temperature=0, max_tokens=8)
    if urgent_arrives_last:
        engine.add_request(Request("other", tuple(short), params, priority=0))
        engine.add_request(Request("first", tuple(full), params, priority=1))
    else:
        engine.add_request(Request("first", tuple(full), params))
        engine.add_request(Request("other", tuple(short), params))
    sequences = {seq.request_id: seq for seq in engine.waiting}

    results = drain(engine, check=assert_kv_accounting)

    assert sequences["first"].num_preemptions == 0
    assert sequences["other"].num_preemptions >= 1
    assert results["first"].first_step == 0
    assert_matches_reference(engine, tiny_models["llama"], full, results["first"], 8)
    assert_matches_reference(engine, tiny_models["llama"], short, results["other"], 8)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("draft", ["pair", "none"])
def test_abort_frees_the_blocks_and_the_others_carry_on(tiny_models, tiny_draft_models, draft: str) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, "qwen2", draft, k=3, max_batch_size=2)
    prompts = text_prompts(engine.target.model, 3)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tuple(prompt), GREEDY))
    results = {}
    drain(engine, results, steps=3)  # r0 and r1 run, r2 waits for a free slot in the batch
    assert results["r0"].token_ids and results["r0"].finish_reason is None
    used = engine.target.cache.num_used_blocks

    running = engine.abort("r0")
    waiting = engine.abort("r2")

    assert running is not None and running.finish_reason == FinishReason.ABORT and running.request_id == "r0"
    assert waiting is not None and waiting.finish_reason == FinishReason.ABORT and waiting.token_ids == ()
    assert engine.abort("r0") is None and engine.abort("unknown") is None
    assert not engine.target.cache.has("r0") and engine.target.cache.num_used_blocks < used
    if engine.draft is not None:
        assert not engine.draft.cache.has("r0")
    for delta in (running, waiting):
        results.setdefault(delta.request_id, Result()).finish_reason = delta.finish_reason
    drain(engine, results, start_step=3)  # a delta for an ended request fails inside drain
    assert_matches_reference(engine, tiny_models["qwen2"], prompts[1], results["r1"], NEW_TOKENS)
    assert_all_blocks_free(engine)


def test_higher_priority_request_is_served_before_an_earlier_lower_one(tiny_models, tiny_draft_models) -> None:
    engine = make_engine(tiny_models, tiny_draft_models, "llama", "pair", k=3, max_batch_size=1)
    prompts = text_prompts(engine.target.model, 3)
    engine.add_request(Request("first", tuple(prompts[0]), GREEDY, priority=0))
    engine.add_request(Request("low", tuple(prompts[1]), GREEDY, priority=0))
    results = drain(engine, steps=1)  # "first" is running; "low" waits
    engine.add_request(Request("high", tuple(prompts[2]), GREEDY, priority=5))

    results = drain(engine, results, start_step=1)

    assert results["first"].first_step < results["high"].first_step < results["low"].first_step
    for rid, prompt in zip(("first", "low", "high"), prompts):
        assert_matches_reference(engine, tiny_models["llama"], prompt, results[rid], NEW_TOKENS)
    assert_all_blocks_free(engine)
