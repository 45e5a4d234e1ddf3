"""Adaptive speculative width: how many copied proposals a lane is offered each round, from the
acceptance its earlier rounds observed, and whether a round is worth a SPECULATIVE program at all.

    acceptance = DraftAcceptance()                 # per request, kept by the scheduler
    k = acceptance.draft_limit(policy)             # 0: no drafting this round (no host lookup either)
    ... round completes with `offered` proposals, `accepted` of them accepted ...
    acceptance.observe(offered, accepted)
    policy.worth(expected, lanes, width)           # else the round stays plain DECODE

The estimate is a per-token acceptance probability p from decaying counts: after a round that
offered d proposals and accepted a of them, successes += a and failures += 1 when a < d (the
first rejected proposal ends the lane), both scaled by `decay` first; p = (successes + 1) /
(successes + failures + 2). A lane is offered its i-th proposal only while p^i >= `reach` (the
chance the target gets that far); a request none of whose copies was accepted yet is offered
nothing.

Evidence costs no round: a **shadow lookup** (`shadow_offer`) keeps the copies a round would have
offered the request now, and `settle` later compares them with the tokens the request emitted
meanwhile. Verification draws with the same sampling and counter as DECODE, so a copy would have
been accepted exactly when it equals the token plain decode emitted: a settled shadow is observed
as a round that offered it. A request therefore waits for completion feedback (SPEC-47) and runs
a SPECULATIVE round only after its own history showed that copying pays; a workload with nothing
to copy decodes on the pipelined path, paying one host lookup per request per weighing. A lookup
that finds nothing to copy counts as a rejected proposal (`miss`); a round that offers a request
nothing lets its evidence fade by `fade`.

A round of B lanes verified at width W costs `ratio` DECODE steps of B rows: measured (RoundCosts:
decaying averages of each program's seconds per round, as the scheduler observes them) once both
programs ran; before the wider one ran, estimated from the cost per target row of the programs
that did (DECODE rounds of several row counts: a batch that grew); else 1 + row_cost x (W - 1)
(a GPU reading the weights once for all rows; a CPU executor whose rows cost alike measures a
ratio near W and so stops drafting). A round emits
sum over lanes of (1 - p^n) / (1 - p) tokens for lanes of n target rows; it goes speculative
only when it is expected to emit more tokens per cost than DECODE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

# rounds a "not worth it" verdict holds before drafting is weighed again (new requests end it);
# also the most copies a shadow lookup waits for, so a weighing settles the previous shadows
QUIET_ROUNDS = 8
PRIOR_SUCCESSES = 1.0
PRIOR_FAILURES = 1.0


@dataclass(frozen=True)
class WidthPolicy:
    max_drafts: int                 # the selected programs' largest D (lane limit - 1)
    reach: float = 0.3              # offer proposal i while p^i >= reach
    decay: float = 0.7              # weight of older rounds' evidence per observed round
    fade: float = 0.98              # weight of the evidence per round that offered nothing
    row_cost: float = 0.05          # share of a DECODE step each extra target row per lane costs (prior)
    measured: bool = True           # use measured round costs once known (else row_cost always)
    shadow_tokens: int = 3          # equal emitted copies that decide a shadow lookup early
    shadow_lookups: int = 8         # shadow lookups per weighing at most (host work per round stays bounded)

    def drafts_for(self, p: float) -> int:
        """Proposals worth offering at per-token acceptance p (0..max_drafts)."""
        if p <= 0.0 or p < self.reach:
            return 0
        if p >= 1.0:
            return self.max_drafts
        return min(self.max_drafts, int(math.floor(math.log(self.reach) / math.log(p) + 1e-9)))

    def worth(self, expected_tokens: float, lanes: int, width: int, measured_ratio: float | None = None) -> bool:
        """A round of `lanes` lanes at program width `width` expected to emit `expected_tokens`
        beats DECODE (one token per lane per step) per unit of cost; `measured_ratio`: the
        program's measured cost in DECODE steps, used when the policy measures."""
        if lanes <= 0 or width <= 1:
            return False
        ratio = measured_ratio if self.measured and measured_ratio is not None else 1.0 + self.row_cost * (width - 1)
        return expected_tokens / lanes > ratio


@dataclass
class RoundCosts:
    """Seconds per round of each program, a decaying average of the rounds observed, and an
    estimate for a program not run yet from the others' cost per target row."""
    weight: float = 0.25                    # of the newest observation
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)     # target rows of each observed program

    def observe(self, program: str, seconds: float, tokens: int = 0) -> None:
        old = self.seconds.get(program)
        self.seconds[program] = seconds if old is None else old + self.weight * (seconds - old)
        if tokens > 0:
            self.tokens[program] = tokens

    def estimate(self, tokens: int) -> float | None:
        """Seconds of a program of `tokens` target rows that has not run: the least-squares line
        through the observed programs' (target rows, seconds), its slope at least 0; None until
        two row counts were observed. Where every row costs (a CPU) the line says so before any
        wider round is paid for; where rows are nearly free (a GPU reading the weights once) it
        stays near the DECODE cost."""
        points = [(self.tokens[p], s) for p, s in self.seconds.items() if p in self.tokens]
        if len({x for x, _ in points}) < 2:
            return None
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
        return max(mean_y + slope * (tokens - mean_x), min(y for _, y in points))

    def ratio(self, program: str, baseline: str, tokens: int = 0) -> float | None:
        """`program`'s cost in rounds of `baseline`: measured, else estimated from its `tokens`
        target rows (when given); None until the baseline and one of them are known."""
        a, b = self.seconds.get(program), self.seconds.get(baseline)
        if a is None and tokens > 0:
            a = self.estimate(tokens)
        return a / b if a is not None and b else None


def expected_tokens(p: float, rows: int) -> float:
    """Tokens a lane of `rows` target rows (pending + rows - 1 proposals) emits at acceptance p:
    1 + p + ... + p^(rows-1)."""
    if rows <= 1:
        return 1.0
    if p >= 1.0:
        return float(rows)
    return (1.0 - p ** rows) / (1.0 - p)


@dataclass
class DraftAcceptance:
    """One request's decaying acceptance evidence, and its pending shadow lookup."""
    successes: float = 0.0
    failures: float = 0.0
    shadow: tuple[int, ...] = ()    # copies a lookup found, offered to no round (settle decides them)
    shadow_at: int = -1             # history position of shadow[0]

    @property
    def observed(self) -> bool:
        """Any evidence yet (a verified round, a settled shadow or a miss); fading keeps it."""
        return self.successes + self.failures > 0.0

    @property
    def rate(self) -> float:
        return (self.successes + PRIOR_SUCCESSES) / (self.successes + self.failures
                                                     + PRIOR_SUCCESSES + PRIOR_FAILURES)

    def draft_limit(self, policy: WidthPolicy) -> int:
        """Proposals to offer this round: none until a copy of this request was accepted (in a
        round or a shadow): a round that waits for completion feedback costs the pipeline and a
        SPECULATIVE round its program, and neither is paid on the prior alone, or on lookups that
        found nothing or only rejected copies (p would still be 1/3 after one of them)."""
        return policy.drafts_for(self.rate) if self.successes > 0.0 else 0

    def observe(self, policy: WidthPolicy, offered: int, accepted: int) -> None:
        """A validated round's outcome for this request: `offered` proposals, `accepted` of them."""
        if offered <= 0:
            self.idle(policy)
            return
        self.successes = policy.decay * self.successes + accepted
        self.failures = policy.decay * self.failures + (1.0 if accepted < offered else 0.0)

    def miss(self, policy: WidthPolicy) -> None:
        """A history lookup that found nothing to copy: counted as a rejected proposal (copying
        does not pay for this request now), so a request with nothing to copy soon stops asking
        for completion feedback and decodes on the pipelined path."""
        self.observe(policy, 1, 0)

    def idle(self, policy: WidthPolicy, rounds: int = 1) -> None:
        """`rounds` rounds that offered this request nothing: its evidence fades toward the prior."""
        kept = policy.fade ** rounds
        self.successes *= kept
        self.failures *= kept

    def shadow_offer(self, policy: WidthPolicy, proposals: Sequence[int], at: int) -> None:
        """Keep `proposals` (a lookup over the first `at` tokens of the history) for `settle`; an
        empty lookup is a miss at once."""
        if not proposals:
            self.miss(policy)
            return
        self.shadow, self.shadow_at = tuple(proposals), at

    def settle(self, policy: WidthPolicy, history: Sequence[int]) -> bool:
        """Decide the pending shadow against the history as it grew (a verified copy is accepted
        exactly when it equals the token DECODE draws with the same counter): at the first copy
        that differs from the emitted token it is observed as a round that offered it; once every
        copy, or `shadow_tokens` of them, were emitted equal, as a round that offered those and
        had them accepted. Returns whether a shadow is still pending (too few tokens yet)."""
        if not self.shadow:
            return False
        emitted = history[self.shadow_at:self.shadow_at + len(self.shadow)]
        accepted = 0
        for copy, token in zip(self.shadow, emitted):
            if copy != token:
                break
            accepted += 1
        if accepted == len(emitted) < min(len(self.shadow), policy.shadow_tokens):
            return True
        self.observe(policy, len(self.shadow) if accepted < len(emitted) else accepted, accepted)
        self.drop_shadow()
        return False

    def drop_shadow(self) -> None:
        """A verified round supersedes the pending shadow (its outcome is observed instead)."""
        self.shadow, self.shadow_at = (), -1
