"""Verification of draft tokens against the target: greedy matching and lossless rejection sampling.

Vocabulary (as in vLLM's rejection sampler): the draft proposes k tokens; the target scores k+1
positions in one forward. A draft token the target agrees with is *accepted*. At the first
disagreement the target's own *recovered* token replaces it; if all k are accepted the target adds
a *bonus* token from its last position. Either way a round emits accepted + 1 tokens.

Rejection sampling (Leviathan et al., ICML 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
2302.01318): accept draft token x ~ q with probability min(1, p(x) / q(x)); on rejection draw from
norm(max(0, p - q)). The emitted tokens are then distributed exactly as the target's p.
"""

from __future__ import annotations

import torch


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0. draft_tokens (k,), target_logits (k+1, V) -> (accepted, recovered-or-bonus token)."""
    target = target_logits.argmax(dim=-1)  # (k+1,)
    k = draft_tokens.shape[0]
    accepted = int((draft_tokens == target[:k]).int().cumprod(0).sum()) if k else 0
    return accepted, int(target[accepted])


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Rejection sampling. draft_tokens (k,), draft_probs q (k, V), target_probs p (k+1, V).

    Returns (accepted, recovered-or-bonus token); the output is distributed as the target's p.
    """
    k = draft_tokens.shape[0]
    for j in range(k):
        x = int(draft_tokens[j])
        p, q = target_probs[j, x], draft_probs[j, x]
        u = torch.rand((), generator=generator, device=generator.device)
        if u * q < p:  # u < p / q without dividing; always true where p > q
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_min(0)  # (V,)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[j]
        return j, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
