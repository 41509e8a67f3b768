"""Speculation-length policies: how many draft tokens k (0..K) each request gets this step.

`fixed` gives every request K, `off` gives 0, and `goodput` follows SmartSpec (Liu et al., arXiv
2406.14066): pick the ks that maximise the batch's expected emitted tokens per second,

    goodput(k_1..k_n) = sum_i E(alpha_i, k_i) / step_seconds(k_1..k_n),
    E(alpha, k) = 1 + alpha + ... + alpha^k        (accepted drafts + the target's own token),

with alpha_i the request's estimated per-token acceptance and step_seconds from the fitted cost model
(actors/speculation/cost_model.py). For a lookup's drafts E comes from per-position rates of the match's class
instead (`Candidate.expected`, actors/speculation/evidence.py), and a step that carries prefill chunks (with a
draft model, a prompt's last chunk too) is judged as its decode part alone, the drafts charged what they add
(`GoodputPolicy.goodput`). k = 0 is a candidate, so under heavy load or with a poor draft the
policy turns speculation off by itself, per request. The search tries each cap c = 1..K (the cap fixes
how many draft forwards run), starts every request at min(c, its own limit), then lowers single
requests' k while that raises goodput (requests with poor acceptance drop first).

What drafting costs depends on the draft kind: a draft model runs max(k) forwards per step (the cost
model's `draft` part, fitted for that model, int8 or not); a lookup drafter (n-gram, suffix) runs none,
its small cost is in the step's per-request overhead. A draft model does not follow a request while it
gets k = 0; when drafting pays again it first catches up on the tokens it missed (its backlog). That
catch-up is paid once and serves every later round, so the policy charges it spread over the rounds the
request has left (remaining tokens / E(alpha, k)), so that a long pause is ended only if drafting
will pay for its catch-up before the request ends. Those later rounds exist only if the request would
also draft once the batch settles: in a step that carries other requests' prefill chunks a draft looks
cheap, yet the decode-only steps that follow may give it k = 0 (a full batch on this CPU). So the policy
first decides the steady state, every running request decoding one token with no backlog, and a request
that would not draft there pays its whole catch-up in this step (not a request running alone: see
`_one_off`). Measured: the Qwen pair at batch 8 spent a third of its time catching the draft up on prompts
it then never drafted for (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from actors.speculation.cost_model import ATTENTION_UNIT, ForwardShape, StepCostModel
from actors.speculation.guard import MeasuredGuard
from cluster.config import SpeculationConfig
from cluster.rounds import RoundRecord


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round emits on average when each draft token is accepted with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class Acceptance:
    """Exponentially weighted estimate of the per-token acceptance rate alpha.

    A round that proposes k and accepts a is a + [a < k] Bernoulli trials with a successes (drafts
    after the first rejection are never tried), so alpha = successes / trials, both decayed per round.
    """

    successes: float
    trials: float
    decay: float = 0.9

    @classmethod
    def prior(cls, rate: float, weight: float = 2.0, decay: float = 0.9) -> "Acceptance":
        return cls(rate * weight, weight, decay)

    @property
    def rate(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0

    def observe(self, r: RoundRecord) -> None:
        """Fold in one verified round (a round without drafts is no evidence)."""
        self.update(r.proposed, r.accepted)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < proposed else 0)

    def blend(self, prior_rate: float, weight: float = 2.0) -> float:
        """This estimate's evidence over a prior of `weight` trials at `prior_rate`."""
        return (self.successes + weight * prior_rate) / (self.trials + weight)

    def copy(self, weight: float = 2.0) -> "Acceptance":
        """A fresh estimate with this one's rate and a small weight (a new request's starting point)."""
        return Acceptance.prior(self.rate, weight, self.decay)


@dataclass(frozen=True)
class Candidate:
    """One request that emits tokens this step and so may speculate."""

    acceptance: float  # estimated alpha
    max_k: int  # K, capped by the tokens it may still emit and the step's token budget
    new_tokens: int  # target tokens it feeds without drafts (1 for a decode, more for a final prefill chunk)
    context: int  # its context length after this step
    draft_backlog: int = 0  # tokens the draft must catch up on before it drafts for this request
    remaining: int = 1 << 30  # tokens the request may still emit
    # expected tokens a round emits with 0, 1, ... drafts where per-position rates are known (a lookup's match class:
    # actors/speculation/evidence.py); () or a k past its end: E(acceptance, k), every position alike
    expected: tuple[float, ...] = ()

    def emitted(self, k: int) -> float:
        """Tokens a round with k drafts emits on average."""
        return self.expected[k] if k < len(self.expected) else expected_tokens(self.acceptance, k)


@dataclass(frozen=True)
class BatchBase:
    """The rest of the step, whatever the ks: prefill chunks in the target; and how many requests the engine settles
    into (the batch that decodes together once prefills are done: those running and those waiting, up to the batch
    size; 0: just the candidates)."""

    target: ForwardShape = ForwardShape()
    running: int = 0


class FixedPolicy:
    """k = K for every request (capped by its own limit)."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        self.k = k

    def allows(self, batch: int) -> bool:
        return True

    def observe_step(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        pass

    def declined(self, batch: int) -> None:
        pass

    def choose(self, cands: list[Candidate], base: BatchBase, budget: int) -> list[int]:
        ks = []
        for c in cands:
            ks.append(min(self.k, c.max_k, budget))
            budget -= ks[-1]
        return ks



class OffPolicy:
    """k = 0: plain decoding."""

    name = "off"

    def allows(self, batch: int) -> bool:
        return False

    def observe_step(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        pass

    def declined(self, batch: int) -> None:
        pass

    def choose(self, cands: list[Candidate], base: BatchBase, budget: int) -> list[int]:
        return [0] * len(cands)


class GoodputPolicy:
    """Per request k in 0..K maximising expected emitted tokens per second of the whole batch (SmartSpec)."""

    name = "goodput"

    def __init__(self, k: int, cost: StepCostModel, draft_forwards: bool = True,
                 guard: MeasuredGuard | None = None) -> None:
        self.k = k
        self.cost = cost
        self.draft_forwards = draft_forwards  # False: a lookup drafter, no draft forwards to pay for
        self.guard = guard  # None: the cost model alone decides
        self._catch_up: dict[tuple[int, int], float] = {}  # (backlog, context) -> seconds, for the current fit

    def allows(self, batch: int) -> bool:
        """Whether a step of `batch` emitting requests may speculate (False: the plain path, k = 0 for all, no
        search): the guard's word, from what drafting and plain steps measured at this batch size."""
        return self.guard is None or self.guard.allows(batch)

    def observe_step(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step's outcome (tokens emitted in `seconds` of wall time), for the guard."""
        if self.guard is not None:
            self.guard.observe(batch, drafted, tokens, seconds)

    def declined(self, batch: int) -> None:
        """This step's search gave every request k = 0. With a draft model the guard then skips the search until
        its next exploration (MeasuredGuard.declined). Not with a lookup: its candidates change every step (a
        4-gram match may come next), and a step without any match skips the search already."""
        if self.guard is not None and self.draft_forwards:
            self.guard.declined(batch)

    def catch_up_seconds(self, c: Candidate, k: int, one_off: bool = False) -> float:
        """The share of this step in the draft's catch-up for `c`: its cost over the rounds the request has left,
        or all of it if it is `one_off` (the request would not draft in later rounds)."""
        if not self.draft_forwards or k == 0 or c.draft_backlog <= 1:
            return 0.0  # a backlog of one token (the last round's bonus) rides in the first draft forward
        b = c.draft_backlog
        seconds = self._catch_up.get((b, c.context))
        if seconds is None:  # one forward over the backlog: the same for every k, so computed once per step
            if len(self._catch_up) > 4096:
                self._catch_up.clear()
            seconds = self._catch_up[b, c.context] = self.cost.draft.predict(
                ForwardShape(1, b, b * c.context / ATTENTION_UNIT))
        rounds = 1.0 if one_off else max(1.0, c.remaining / c.emitted(k))
        return seconds / rounds

    def goodput(self, cands: list[Candidate], base: BatchBase, ks: list[int],
                one_off: frozenset[int] = frozenset(), offset: float | None = None) -> float:
        """Expected tokens per second of a step with these ks (`one_off`: candidates whose catch-up this step pays
        in full).

        A step that carries prefill chunks is judged as the decode step its emitting requests would make alone,
        with the drafts charged what they add to this step. Per-step tokens per second would otherwise favour
        drafting exactly where the step is long: a step mostly spent on a prompt emits few tokens per second, so
        any draft lifts its average, however poorly it pays for the time it adds (docs/scheduler.md). Where a
        forward's time is linear in its rows this is the decode step's own choice; where it bends, the drafts
        pay the marginal rate of the bigger forward. `offset`: `_prefill_offset(cands, base)`, if already known
        (the search evaluates many ks of one step)."""
        seconds = self._seconds(cands, base.target, ks, one_off)
        seconds += self._prefill_offset(cands, base) if offset is None else offset
        return sum(c.emitted(k) for c, k in zip(cands, ks)) / max(seconds, 1e-9)

    def _prefill_offset(self, cands: list[Candidate], base: BatchBase) -> float:
        """Seconds that turn a step with prefill into its decode part alone, without drafts: the decode-alone step's
        time minus this step's (0 for a step of decodes alone). The same for every ks of the step.

        Prefill is `base`'s chunks and, with a draft model, an emitting request's own prompt before its last token
        (its last chunk emits one token, as a decode does). A draft model that drafts there also catches up on the
        whole prompt, and judged by the long step's own rate that looked cheap: the Qwen pair at batch 8 drafted
        k = 4 for all 8 on such steps, two or three times a run, 7% of its time (docs/scheduler.md). A lookup keeps
        its chunk in its candidate: its drafts on a prompt's tail cost only their rows, and judging them as a
        decode's cost n-gram goodput at batch 8 about 4%."""
        own = self.draft_forwards and any(c.new_tokens > 1 for c in cands)
        if not base.target.tokens and not own:
            return 0.0
        plain = [0] * len(cands)
        decode = [replace(c, new_tokens=1) for c in cands] if own else cands
        return self._seconds(decode, ForwardShape(), plain) - self._seconds(cands, base.target, plain)

    def _seconds(self, cands: list[Candidate], base: ForwardShape, ks: list[int],
                 one_off: frozenset[int] = frozenset()) -> float:
        """Predicted seconds of a step of `base` (prefill chunks) and the candidates with these ks."""
        tokens, attention = base.tokens, base.attention
        d_attention, catch_up = 0.0, 0.0
        for i, (c, k) in enumerate(zip(cands, ks)):
            tokens += c.new_tokens + k
            attention += (c.new_tokens + k) * c.context / ATTENTION_UNIT
            d_attention += k * c.context / ATTENTION_UNIT
            catch_up += self.catch_up_seconds(c, k, i in one_off)
        # draft forward j feeds one token of each request still drafting at position j
        sizes = [sum(k > j for k in ks) for j in range(max(ks, default=0))] if self.draft_forwards else []
        draft = ForwardShape(len(sizes), sum(sizes), d_attention, tuple(sizes))
        return self.cost.predict(ForwardShape(1, tokens, attention), draft, requests=len(cands)) + catch_up

    def choose(self, cands: list[Candidate], base: BatchBase, budget: int) -> list[int]:
        self._catch_up.clear()  # the cost model may have been refitted since the last step
        if not self.cost.fitted:
            return [0] * len(cands)
        return self._search(cands, base, budget, self._one_off(cands, base, budget))

    def _one_off(self, cands: list[Candidate], base: BatchBase, budget: int) -> frozenset[int]:
        """Candidates with a backlog that would get k = 0 in the steady state: every running request decoding one
        token, caught up, with no prefill in the step (requests not among the candidates are taken as average).

        Not for a request running alone: it has no batch to settle into, its steady state rests on its own estimate,
        and there spreading the catch-up is what lets it draft on its prompt's last chunk and gather evidence (paying
        in full, a lone request whose first round was rejected never drafted again: the Qwen pair at batch 1 fell
        to 0.77x of the spread charge's tokens/s)."""
        behind = [i for i, c in enumerate(cands) if c.draft_backlog > 1]
        if not self.draft_forwards or not behind or max(base.running, len(cands)) <= 1:
            return frozenset()
        steady = [Candidate(c.acceptance, max(0, min(self.k, c.remaining - 1)), 1, c.context, 0, c.remaining,
                            c.expected) for c in cands]
        if base.running > len(cands):
            mean = Candidate(sum(c.acceptance for c in cands) / len(cands), self.k, 1,
                             sum(c.context for c in cands) // len(cands))
            steady += [mean] * (base.running - len(cands))
        ks = self._search(steady, BatchBase(), max(budget, sum(c.max_k for c in steady)), frozenset())
        return frozenset(i for i in behind if ks[i] == 0)

    def _search(self, cands: list[Candidate], base: BatchBase, budget: int, one_off: frozenset[int]) -> list[int]:
        """The ks of the best goodput found: per cap c = 1..K, every request at min(c, its limit), then single
        requests lowered while that helps."""
        offset = self._prefill_offset(cands, base)
        best_ks, best = [0] * len(cands), self.goodput(cands, base, [0] * len(cands), one_off, offset)
        for cap in range(1, self.k + 1):
            ks = [min(cap, c.max_k) for c in cands]
            while sum(ks) > budget:  # trim the requests with the lowest acceptance first
                i = min((i for i, k in enumerate(ks) if k > 0), key=lambda i: (cands[i].acceptance, -ks[i]))
                ks[i] -= 1
            value = self.goodput(cands, base, ks, one_off, offset)
            improved = True
            while improved:
                improved = False
                for i in sorted(range(len(ks)), key=lambda i: cands[i].acceptance):
                    if ks[i] == 0:
                        continue
                    ks[i] -= 1
                    v = self.goodput(cands, base, ks, one_off, offset)
                    if v > value:
                        value, improved = v, True
                    else:
                        ks[i] += 1
            if value > best:
                best_ks, best = list(ks), value
        return best_ks


SpecPolicy = FixedPolicy | OffPolicy | GoodputPolicy


def make_policy(cfg: SpeculationConfig, has_draft: bool, cost: StepCostModel, draft_forwards: bool = True) -> SpecPolicy:
    """The policy the config names; without a drafter every policy is `off`. `draft_forwards`: whether the
    drafter runs forwards (a draft model) or not (a lookup)."""
    if not has_draft or cfg.policy == "off" or cfg.k == 0:
        return OffPolicy()
    if cfg.policy == "fixed":
        return FixedPolicy(cfg.k)
    g = cfg.guard
    guard = MeasuredGuard(g.explore_every, g.decay, g.min_samples, g.recheck_margin) if g.enabled else None
    return GoodputPolicy(cfg.k, cost, draft_forwards, guard)
