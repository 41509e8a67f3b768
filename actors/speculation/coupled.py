"""Sampling keyed by position: in deterministic mode a sampled token does not depend on how it was computed.

Deterministic mode (engine.deterministic) makes a token's logits independent of its batch and of k. This module
makes the draw from them independent too. Token t of a request is argmax(log p_t + g_t), where p_t is the
processed distribution (temperature, top-k, top-p) and g_t is Gumbel noise drawn from (the request's seed, t)
alone. The Gumbel-max trick (Gumbel 1954; Maddison, Tarlow and Minka, "A* Sampling", NeurIPS 2014) makes that
token an exact sample of p_t; and since g_t is fixed by the position, the token is the same whether plain decoding
drew it, a round verified it as a draft, or it came as a round's bonus, at any k, in any batch, and after a
migration or a failover (the seed travels with the request). Verification is then greedy matching against these
tokens, and a model draft proposes argmax(log q_t + g_t) with the same noise, so that it agrees with the target
wherever its distribution is close.

The price: the chance that such a draft is accepted, P(argmax(log q + g) = argmax(log p + g)), is in general
below rejection sampling's sum_x min(p(x), q(x)) (Leviathan et al. 2023). A lookup draft (one token, q one-hot)
loses nothing: its token is accepted with probability p(x) either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for one position of one request: splitmix64 (Steele, Lea and Flood, OOPSLA 2014)
    of the request's seed stepped `position + 1` times, so nearby seeds and positions give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise (len(positions), vocab) fp32, each row a function of (seed, its position) alone."""
    rows = []
    for t in positions:
        g = torch.Generator(device=device).manual_seed(position_seed(seed, t))
        rows.append(torch.rand(vocab, generator=g, device=device))  # (V,) in [0, 1)
    u = torch.stack(rows).clamp_min(torch.finfo(torch.float32).tiny)  # (n, V)
    return -torch.log(-torch.log(u))


def coupled_tokens(probs: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """The token at each of `probs`' rows (n, V), rows at positions first_position.. of the request -> (n,).

    A token of probability 0 is never chosen (its log is -inf)."""
    noise = gumbel_noise(seed, range(first_position, first_position + probs.shape[0]), probs.shape[-1],
                         probs.device)  # (n, V)
    return (probs.log() + noise).argmax(dim=-1)
