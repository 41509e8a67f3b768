"""Verification of draft tokens against the target: greedy matching and lossless rejection sampling, per batch.

Vocabulary (as in vLLM's rejection sampler): the draft proposes k tokens; the target scores k+1
positions in one forward. A draft token the target agrees with is *accepted*. At the first
disagreement the target's own *recovered* token replaces it; if all k are accepted the target adds
a *bonus* token from its last position. Either way a round emits accepted + 1 tokens.

Rejection sampling (Leviathan et al., ICML 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
2302.01318): accept draft token x ~ q with probability min(1, p(x) / q(x)); on rejection draw from
norm(max(0, p - q)). The emitted tokens are then distributed exactly as the target's p.

A step's greedy requests are decided together in tensor operations (`verify_greedy_batch`: one argmax, one
comparison, one cumulative product over the batch, one transfer of the answers), as gpt-fast decides a round.
Sampled requests keep a generator each (a seeded request repeats whatever else shares its batch), so each
draws its own k uniforms and its recovered or bonus token.
"""

from __future__ import annotations

import torch


def verify_greedy_batch(drafts: torch.Tensor, num_drafts: torch.Tensor, target: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0 for a batch. drafts (B, K) (padding past each row's count is ignored), num_drafts (B,),
    target (B, K+1): the target's argmax at each scored position -> accepted (B,), the next token (B,)."""
    k = drafts.shape[1]
    live = torch.arange(k, device=drafts.device) < num_drafts[:, None]  # (B, K)
    match = (drafts == target[:, :k]) & live  # (B, K)
    accepted = match.long().cumprod(1).sum(1)  # (B,)
    return accepted, target.gather(1, accepted[:, None]).squeeze(1)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0, one request. draft_tokens (k,), target_logits (k+1, V) -> (accepted, recovered-or-bonus)."""
    k = draft_tokens.shape[0]
    target = target_logits.argmax(dim=-1)  # (k+1,)
    accepted, token = verify_greedy_batch(draft_tokens.reshape(1, k), torch.tensor([k], device=target.device),
                                          target[None])
    return int(accepted[0]), int(token[0])


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Rejection sampling. draft_tokens (k,), draft_probs q (k, V), target_probs p (k+1, V).

    Draws k uniforms, then one token from the residual (at the first rejection) or from p's last row (all
    accepted). Returns (accepted, recovered-or-bonus token); the output is distributed as the target's p.
    """
    k = draft_tokens.shape[0]
    if k:
        u = torch.rand(k, generator=generator, device=generator.device)  # (k,)
        rows = torch.arange(k, device=target_probs.device)
        p_x, q_x = target_probs[rows, draft_tokens], draft_probs[rows, draft_tokens]  # (k,)
        ok = u * q_x < p_x  # u < p / q without dividing; always true where p > q
        accepted = int(ok.long().cumprod(0).sum())
    else:
        accepted = 0
    if accepted < k:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)  # (V,)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[accepted]
        return accepted, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
