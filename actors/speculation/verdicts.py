"""A step's verification: every emitting request's round decided from the drafts and the target's scores.

First each request's rows are processed as plain decoding would process them (actors/speculation/processors.py:
penalties, bias, min_tokens, and its grammar's masks; position j of a round seeing the round's first j drafts).
Greedy requests are then decided together (actors/speculation/verify.py `verify_greedy_batch`): one argmax over the
step's rows, the drafts padded into a (B, K) tensor, one comparison and one transfer of the answers, so a batch of
greedy requests costs a handful of tensor operations and a single device-to-host copy however large it is.
Sampled requests are decided together too (`verify_sampled_batch`): each turns its rows into its distribution
(its own temperature, top-k, top-p) and draws its noise from its own generator, then one batch of tensor
operations decides every round and one transfer brings the answers back. In deterministic mode each position's
token is drawn by noise keyed to it (actors/speculation/coupled.py) and the drafts are matched against those tokens
in one greedy-style batch, so sampled output is the same at any k, in any batch.

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
from actors.speculation.verify import round_noise, verify_greedy_batch, verify_sampled_batch
from actors.speculation.step import Drafts, Scores, SpecPlan, Verdict
from cluster.request import TokenLogprob


def verify(plan: SpecPlan, drafts: Drafts, scores: Scores, coupled: bool = False) -> dict[str, Verdict]:
    """Each emitting request's verdict, by request id. `coupled` (deterministic mode): sampled requests' tokens
    are drawn by position-keyed noise (actors/speculation/coupled.py), not by rejection sampling."""
    emitting = plan.emitting
    logits = _processed(emitting, drafts, scores)
    greedy = [d for d in emitting if d.work.seq.greedy]
    sampled = [d for d in emitting if not d.work.seq.greedy]
    out = _verify_greedy(greedy, drafts, scores, logits) if greedy else {}
    if sampled:
        out.update(_verify_sampled(sampled, drafts, scores, logits, coupled))
    return {d.request_id: out[d.request_id] for d in emitting}  # in the plan's order


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
    padded, counts = _padded(proposals, device)  # (B, K), (B,)
    width = padded.shape[1]
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


def _padded(proposals: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts padded with -1 into (B, K), and their counts (B,)."""
    width = max(len(p) for p in proposals)
    padded = torch.tensor([p + [-1] * (width - len(p)) for p in proposals], dtype=torch.long,
                          device=device).reshape(len(proposals), width)  # (B, K)
    return padded, torch.tensor([len(p) for p in proposals], dtype=torch.long, device=device)  # (B,)


def _verify_sampled(works, drafts: Drafts, scores: Scores, logits: torch.Tensor, coupled: bool
                    ) -> dict[str, Verdict]:
    """Every sampled request's round in one batch: rejection sampling, or (coupled) matching the keyed tokens."""
    proposals = [drafts.of(d.request_id).tokens for d in works]
    ps = []  # each request's distribution (k+1, V), from its own parameters
    for d in works:
        first, n = scores.rows[d.request_id]
        ps.append(probs_from_logits(logits[first:first + n], d.work.seq.request.params))
    padded, counts = _padded(proposals, logits.device)  # (B, K), (B,)
    decide = _coupled if coupled else _rejection_sampled
    accepted, nxt = decide(works, drafts, ps, padded, counts)
    out = {}
    for d, t, x, a, tok in zip(works, proposals, ps, accepted.tolist(), nxt.tolist()):
        emitted = tuple(t[:a]) + (tok,)
        n = d.work.seq.request.params.logprobs
        lp = logprobs_of(x[: len(emitted)].log(), emitted, n) if n is not None else None
        out[d.request_id] = Verdict(len(t), a, emitted, lp)
    return out


def _rejection_sampled(works, drafts: Drafts, ps: list[torch.Tensor], padded: torch.Tensor, counts: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling over the batch: rows packed request after request, each request's noise from its own
    generator (actors/speculation/verify.py `round_noise`) -> accepted (B,), recovered or bonus token (B,)."""
    device, (b, width) = padded.device, padded.shape
    p = torch.cat(ps)  # (N, V)
    vocab = p.shape[-1]
    lengths = torch.tensor([x.shape[0] for x in ps], dtype=torch.long, device=device)  # (B,)
    q = torch.cat([drafts.of(d.request_id).q(vocab, device) for d in works])  # (M, V)
    noise = [round_noise(int(k), vocab, p.dtype, d.work.seq.generator) for d, k in zip(works, counts.tolist())]
    uniforms = torch.stack([torch.cat([u.to(device), torch.ones(width - u.shape[0], device=device)])
                            for u, _ in noise]).reshape(b, width)  # (B, K): padding past k_b is never read
    exponentials = torch.stack([e.to(device) for _, e in noise])  # (B, V)
    return verify_sampled_batch(padded, counts, p, lengths.cumsum(0) - lengths, q, counts.cumsum(0) - counts,
                                uniforms, exponentials)


def _coupled(works, drafts: Drafts, ps: list[torch.Tensor], padded: torch.Tensor, counts: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic mode: the token each row's position draws whatever the round (actors/speculation/coupled.py);
    the drafts must match it, as greedy ones match the argmax -> accepted (B,), next token (B,)."""
    width = padded.shape[1] + 1
    chosen = [coupled_tokens(x, d.work.seq.generator.initial_seed(), len(d.work.seq.token_ids))
              for d, x in zip(works, ps)]  # (k_b + 1,) each
    target = torch.stack([torch.cat([c, c[-1:].expand(width - c.shape[0])]) for c in chosen])  # (B, K+1)
    return verify_greedy_batch(padded, counts, target)


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
