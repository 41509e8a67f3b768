"""Logits processors of one request, applied at every position a step scores: penalties, bias, min_tokens, grammar.

A speculative round scores k + 1 positions at once; position j must be processed exactly as plain decoding
would process it after emitting the round's first j drafts. So every processor here sees, per position, the
request's tokens so far plus `drafts[:j]`: counts for the penalties are cumulative over the drafts, min_tokens
counts them as generated, and the grammar mask of position j is the matcher's after consuming them
(actors/speculation/grammar.py). The same function processes the draft model's logits while it proposes (the draft
position then sees the tokens it proposed before), so the draft samples from what it will be verified against.

Semantics, as vLLM and the OpenAI API define them, applied in vLLM's order (repetition, then frequency and presence,
then bias):
- presence_penalty / frequency_penalty (OpenAI): subtract `presence * [count > 0] + frequency * count`, counts over
  the generated tokens only;
- repetition_penalty (HF, Keskar et al. 2019, CTRL): a token seen in the prompt or the output has its logit divided
  by the penalty when positive, multiplied when negative;
- logit_bias: added to the logit of each listed token;
- min_tokens: end-of-sequence and stop token ids are impossible while fewer tokens than that were generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cluster.request import SamplingParams


def needs_processing(params: SamplingParams) -> bool:
    """Whether any processor of `params` changes logits (the common request skips this module entirely)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.min_tokens)


def process(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
            drafts: Sequence[int], stop_ids: Sequence[int]) -> torch.Tensor:
    """Processed logits (P, V) for P = len(drafts) + 1 consecutive positions after `prompt + output`: position j
    also sees `drafts[:j]` as generated. `stop_ids`: the ids min_tokens holds back (EOS and stop_token_ids).
    Returns a new tensor; `logits` is not changed."""
    p, v = logits.shape
    device = logits.device
    out = logits.float().clone()
    drafted = torch.tensor(list(drafts[: p - 1]), dtype=torch.long, device=device)  # (P-1,)
    # generated-token counts per position (P, V): the output so far, then each draft counted from the next position
    steps = torch.zeros(p, v, device=device)
    if drafted.numel():
        steps[1:].scatter_(1, drafted[:, None], 1.0)
    counts = steps.cumsum(0)  # (P, V)
    if output:
        counts += torch.bincount(torch.tensor(list(output), dtype=torch.long, device=device), minlength=v)[:v]
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt:
            seen[:, torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        penalized = penalized.clamp(min=torch.finfo(out.dtype).min, max=torch.finfo(out.dtype).max)  # no inf: a
        # tiny penalty must not make a distribution of NaNs (only the masks below make -inf)
        out = torch.where(seen, penalized, out)
    if params.frequency_penalty or params.presence_penalty:
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=out.dtype, device=device)
        out[:, ids] += bias
    early = [j for j in range(p) if len(output) + j < params.min_tokens]  # positions before min_tokens were generated
    if early and stop_ids:
        rows = torch.tensor(early, dtype=torch.long, device=device)[:, None]  # (E, 1)
        out[rows, torch.tensor(list(stop_ids), dtype=torch.long, device=device)[None]] = float("-inf")
    return out


def processes(seq) -> bool:
    """Whether a request's logits go through this module (processors or a grammar)."""
    return seq.grammar is not None or needs_processing(seq.request.params)


def process_request(seq, logits: torch.Tensor, drafts: Sequence[int], stop_ids: Sequence[int],
                    before: Sequence[int] = ()) -> torch.Tensor:
    """A request's processed logits (P, V) for P = len(drafts) + 1 positions after its tokens and `before` (the
    draft tokens a draft model proposed earlier this round). Its grammar, if any, is in the state after those
    tokens (the drafter steps it as it proposes); position j is masked by the state after `drafts[:j]` too."""
    params = seq.request.params
    out = logits
    if needs_processing(params):
        out = process(out, params, seq.request.prompt_token_ids, list(seq.output.token_ids) + list(before), drafts,
                      stop_ids)
    if seq.grammar is not None:
        allowed = seq.grammar.masks(drafts).to(out.device)  # (P, V)
        out = out.float().masked_fill(~allowed, float("-inf"))
    return out
