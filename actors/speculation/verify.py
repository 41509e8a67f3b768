"""Verification of draft tokens against the target: greedy matching and lossless rejection sampling, per batch.

Vocabulary (as in vLLM's rejection sampler): the draft proposes k tokens; the target scores k+1
positions in one forward. A draft token the target agrees with is *accepted*. At the first
disagreement the target's own *recovered* token replaces it; if all k are accepted the target adds
a *bonus* token from its last position. Either way a round emits accepted + 1 tokens.

Rejection sampling (Leviathan et al., ICML 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
2302.01318): accept draft token x ~ q with probability min(1, p(x) / q(x)); on rejection draw from
norm(max(0, p - q)). The emitted tokens are then distributed exactly as the target's p.

A step's requests are decided together in tensor operations, as gpt-fast's `speculative_decode` decides a round:
greedy ones by `verify_greedy_batch` (one comparison, one cumulative product over the batch), sampled ones by
`verify_sampled_batch` (accept where u * q(x) < p(x), the first rejection by a cumulative product, the residual
max(0, p - q) normalised, then one draw per row). Sampled requests keep a generator each (a seeded request repeats
whatever else shares its batch), so only their noise is drawn per request (`round_noise`: k uniforms, then the V
exponentials of one categorical draw); the decision itself is batched.

The categorical draw is the exponential race: argmax_v p(v) / E_v with E_v ~ Exp(1) i.i.d. picks v with
probability p(v) / sum p (the Gumbel-max trick with the exponential applied). It is what `torch.multinomial` does
for one sample, with the same noise from the same generator, so a seeded request draws the tokens it drew when
it was verified alone.
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


def round_noise(k: int, vocab_size: int, dtype: torch.dtype, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampled request's randomness for a round, drawn from its own generator in a fixed order: k uniforms
    (the acceptance tests) (k,), then V exponentials (the recovered or bonus token's draw) (V,) of `dtype` (the
    distribution's, as torch.multinomial draws them). k = 0 draws no uniform."""
    u = torch.rand(k, generator=generator, device=generator.device) if k else torch.empty(0, device=generator.device)
    e = torch.empty(vocab_size, dtype=dtype, device=generator.device).exponential_(generator=generator)
    return u, e


def verify_sampled_batch(
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    target_first: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_first: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for a batch of B requests with up to K drafts each, rows packed request after request.

    drafts (B, K) (padding past each row's count is ignored), num_drafts k_b (B,); target_probs p (N, V), request
    b's k_b + 1 rows from target_first[b] (B,); draft_probs q (M, V), its k_b rows from draft_first[b] (B,);
    uniforms (B, K) and exponentials (B, V) from `round_noise`. Returns accepted (B,) and the recovered or bonus
    token (B,); each request's tokens are distributed as its target's p (Leviathan et al. 2023, Theorem 1).
    """
    b, k = drafts.shape
    device = drafts.device
    pos = torch.arange(k, device=device)  # (K,)
    live = pos < num_drafts[:, None]  # (B, K)
    token = drafts.clamp_min(0)  # (B, K): padding indexes token 0, masked by `live`
    if k and draft_probs.shape[0]:
        p_x = target_probs[(target_first[:, None] + pos).clamp_max(target_probs.shape[0] - 1), token]  # (B, K)
        q_x = draft_probs[(draft_first[:, None] + pos).clamp_max(draft_probs.shape[0] - 1), token]  # (B, K)
        ok = (uniforms * q_x < p_x) & live  # u < p / q without dividing; always true where p > q
        accepted = ok.long().cumprod(1).sum(1)  # (B,)
    else:
        accepted = torch.zeros(b, dtype=torch.long, device=device)
    rejected = accepted < num_drafts  # (B,)
    last_p = target_probs[target_first + accepted]  # (B, V): the row the emitted token is drawn at
    if draft_probs.shape[0]:
        last_q = draft_probs[(draft_first + accepted).clamp_max(draft_probs.shape[0] - 1)]  # (B, V)
        residual = (last_p - last_q).clamp_min(0)  # (B, V): max(0, p - q) at the first rejection
        total = residual.sum(-1, keepdim=True)  # (B, 1)
        # where the residual has no mass (p <= q everywhere: only by rounding) the target's row is drawn from
        dist = torch.where(rejected[:, None] & (total > 0), residual / total, last_p)  # (B, V)
    else:
        dist = last_p
    return accepted, (dist / exponentials).argmax(-1)


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Rejection sampling for one request. draft_tokens (k,), draft_probs q (k, V), target_probs p (k+1, V).

    Draws k uniforms, then one token from the residual (at the first rejection) or from p's last row (all
    accepted). Returns (accepted, recovered-or-bonus token); the output is distributed as the target's p.
    """
    k, device = draft_tokens.shape[0], target_probs.device
    u, e = round_noise(k, target_probs.shape[-1], target_probs.dtype, generator)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    accepted, token = verify_sampled_batch(draft_tokens.reshape(1, k), torch.tensor([k], device=device),
                                           target_probs, zero, draft_probs, zero, u.reshape(1, k).to(device),
                                           e[None].to(device))
    return int(accepted[0]), int(token[0])
