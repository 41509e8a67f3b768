"""A step's verification: every emitting request's round decided from the drafts and the target's scores.

Greedy requests are decided together (actors/spec/verify.py `verify_greedy_batch`): one argmax over the step's
logits, the drafts padded into a (B, K) tensor, one comparison and one transfer of the answers, so a batch of
greedy requests costs a handful of tensor operations and a single device-to-host copy however large it is.
Sampled requests go one by one: each has its own parameters (temperature, top-k, top-p) and its own generator.
"""

from __future__ import annotations

import torch

from actors.spec.sampling import probs_from_logits
from actors.spec.verify import verify_greedy_batch, verify_sampled
from actors.step import Drafts, Scores, SpecPlan, Verdict


def verify(plan: SpecPlan, drafts: Drafts, scores: Scores) -> dict[str, Verdict]:
    """Each emitting request's verdict, by request id."""
    emitting = plan.emitting
    greedy = [d for d in emitting if d.work.seq.greedy]
    out = _verify_greedy(greedy, drafts, scores) if greedy else {}
    for d in emitting:
        if not d.work.seq.greedy:
            out[d.request_id] = _verify_one_sampled(d.work.seq, drafts.of(d.request_id), scores.of(d.request_id))
    return out


def _verify_greedy(works, drafts: Drafts, scores: Scores) -> dict[str, Verdict]:
    device = scores.logits.device
    proposals = [drafts.of(d.request_id).tokens for d in works]
    width = max(len(p) for p in proposals)
    padded = torch.tensor([p + [-1] * (width - len(p)) for p in proposals], dtype=torch.long,
                          device=device).reshape(len(works), width)  # (B, K)
    counts = torch.tensor([len(p) for p in proposals], dtype=torch.long, device=device)  # (B,)
    firsts = torch.tensor([scores.rows[d.request_id][0] for d in works], dtype=torch.long, device=device)  # (B,)
    best = scores.logits.argmax(dim=-1)  # (N,)
    positions = (firsts[:, None] + torch.arange(width + 1, device=device)).clamp_max(best.shape[0] - 1)  # (B, K+1)
    accepted, nxt = verify_greedy_batch(padded, counts, best[positions])  # (B,), (B,)
    out = {}
    for d, p, a, t in zip(works, proposals, accepted.tolist(), nxt.tolist()):
        out[d.request_id] = Verdict(len(p), a, tuple(p[:a]) + (t,))
    return out


def _verify_one_sampled(seq, proposal, logits: torch.Tensor) -> Verdict:
    p = probs_from_logits(logits, seq.request.params)  # (k+1, V)
    q = proposal.q(p.shape[-1], p.device)  # (k, V)
    d = torch.tensor(proposal.tokens, dtype=torch.long, device=p.device)  # (k,)
    accepted, token = verify_sampled(d, q, p, seq.generator)
    return Verdict(len(proposal.tokens), accepted, tuple(proposal.tokens[:accepted]) + (token,))
