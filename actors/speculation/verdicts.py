"""A step's verification: every emitting request's round decided from the drafts and the target's scores.

First each request's rows are processed as plain decoding would process them (actors/speculation/processors.py:
penalties, bias, min_tokens, and its grammar's masks; position j of a round seeing the round's first j drafts).
Greedy requests are then decided together (actors/speculation/verify.py `verify_greedy_batch`): one argmax over the
step's rows, the drafts padded into a (B, K) tensor, one comparison and one transfer of the answers, so a batch of
greedy requests costs a handful of tensor operations and a single device-to-host copy however large it is.
Sampled requests go one by one: each has its own parameters (temperature, top-k, top-p) and its own generator;
in deterministic mode each position's token is drawn by noise keyed to it (actors/speculation/coupled.py) and the drafts
are matched against those tokens, so sampled output is the same at any k, in any batch.

Log-probabilities, for requests that ask, are the target's processed ones at the positions the round emits
(vLLM's "processed" logprobs): after the processors and, for sampled requests, temperature, top-k and top-p; a
greedy request's are the log-softmax of its processed logits. They come from the verification's own rows, so they
cost no forward, and equal what plain decoding reports for the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.speculation.coupled import coupled_tokens
from actors.speculation.processors import process_request, processes
from actors.speculation.sampling import probs_from_logits
from actors.speculation.verify import verify_greedy_batch, verify_sampled
from actors.speculation.step import Drafts, Scores, SpecPlan, Verdict
from cluster.request import TokenLogprob


def verify(plan: SpecPlan, drafts: Drafts, scores: Scores, coupled: bool = False) -> dict[str, Verdict]:
    """Each emitting request's verdict, by request id. `coupled` (deterministic mode): sampled requests' tokens
    are drawn by position-keyed noise (actors/speculation/coupled.py), not by rejection sampling."""
    emitting = plan.emitting
    logits = _processed(emitting, drafts, scores)
    greedy = [d for d in emitting if d.work.seq.greedy]
    out = _verify_greedy(greedy, drafts, scores, logits) if greedy else {}
    for d in emitting:
        if not d.work.seq.greedy:
            first, n = scores.rows[d.request_id]
            out[d.request_id] = _verify_one_sampled(d.work.seq, drafts.of(d.request_id).tokens,
                                                    drafts.of(d.request_id), logits[first:first + n], coupled)
    return out


def _processed(emitting, drafts: Drafts, scores: Scores) -> torch.Tensor:
    """The step's rows (N, V) with each processed request's rows replaced by their processed values."""
    todo = [d for d in emitting if processes(d.work.seq)]
    if not todo:
        return scores.logits
    logits = scores.logits.float().clone()
    for d in todo:
        first, n = scores.rows[d.request_id]
        seq = d.work.seq
        logits[first:first + n] = process_request(seq, logits[first:first + n], drafts.of(d.request_id).tokens,
                                                  seq.output.stop_ids)
    return logits


def _verify_greedy(works, drafts: Drafts, scores: Scores, logits: torch.Tensor) -> dict[str, Verdict]:
    device = logits.device
    proposals = [drafts.of(d.request_id).tokens for d in works]
    width = max(len(p) for p in proposals)
    padded = torch.tensor([p + [-1] * (width - len(p)) for p in proposals], dtype=torch.long,
                          device=device).reshape(len(works), width)  # (B, K)
    counts = torch.tensor([len(p) for p in proposals], dtype=torch.long, device=device)  # (B,)
    firsts = torch.tensor([scores.rows[d.request_id][0] for d in works], dtype=torch.long, device=device)  # (B,)
    best = logits.argmax(dim=-1)  # (N,)
    positions = (firsts[:, None] + torch.arange(width + 1, device=device)).clamp_max(best.shape[0] - 1)  # (B, K+1)
    accepted, nxt = verify_greedy_batch(padded, counts, best[positions])  # (B,), (B,)
    out = {}
    for d, p, a, t in zip(works, proposals, accepted.tolist(), nxt.tolist()):
        tokens = tuple(p[:a]) + (t,)
        n = d.work.seq.request.params.logprobs
        lp = None
        if n is not None:
            first = scores.rows[d.request_id][0]
            lp = logprobs_of(torch.log_softmax(logits[first:first + len(tokens)].float(), dim=-1), tokens, n)
        out[d.request_id] = Verdict(len(p), a, tokens, lp)
    return out


def _verify_one_sampled(seq, tokens: list[int], proposal, logits: torch.Tensor, coupled: bool) -> Verdict:
    p = probs_from_logits(logits, seq.request.params)  # (k+1, V)
    d = torch.tensor(tokens, dtype=torch.long, device=p.device)  # (k,)
    if coupled:  # the token each row's position draws, whatever the round; the drafts must match it
        chosen = coupled_tokens(p, seq.generator.initial_seed(), len(seq.token_ids))  # (k+1,)
        a, t = verify_greedy_batch(d[None], torch.tensor([len(tokens)], device=p.device), chosen[None])
        accepted, token = int(a[0]), int(t[0])
    else:
        accepted, token = verify_sampled(d, proposal.q(p.shape[-1], p.device), p, seq.generator)  # q: (k, V)
    emitted = tuple(tokens[:accepted]) + (token,)
    n = seq.request.params.logprobs
    lp = logprobs_of(p[: len(emitted)].log(), emitted, n) if n is not None else None
    return Verdict(len(tokens), accepted, emitted, lp)


def logprobs_of(logprobs: torch.Tensor, tokens: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
    """Each token's logprob at its row of `logprobs` (T, V), with the `top` most likely of that row."""
    rows = torch.arange(len(tokens), device=logprobs.device)
    chosen = logprobs[rows, torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)].tolist()
    if top:
        values, ids = logprobs.topk(top, dim=-1)  # (T, top)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return tuple(TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alternatives))
