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
(successes + failures + 2) (a uniform prior, p = 0.5 for a request never observed). A lane is
offered its i-th proposal only while p^i >= `reach` (the chance the target gets that far); a
round that offers nothing lets the evidence fade by `fade`, so a request whose copies stopped
matching is probed again after a while rather than never; a lookup that finds nothing to copy
counts as a rejected proposal (`miss`). Only lanes with a positive limit run the history lookup,
and only a round that may pay waits for completion feedback (SPEC-47): the others decode on
the pipelined path, so a workload with nothing to copy costs one probe every dozen rounds or so.

A round of B lanes verified at width W costs `ratio` DECODE steps of B rows: measured (RoundCosts:
decaying averages of each program's seconds per round, as the scheduler observes them) once both
programs ran, else 1 + row_cost x (W - 1) (a GPU reading the weights once for all rows; a CPU
executor whose rows cost alike measures a ratio near W and so stops drafting). A round emits
sum over lanes of (1 - p^n) / (1 - p) tokens for lanes of n target rows; it goes speculative
only when it is expected to emit more tokens per cost than DECODE, which bounds how much a
workload with nothing to copy can lose to probing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# rounds a "not worth it" verdict holds before drafting is weighed again (new requests end it)
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
    """Seconds per round of each program, a decaying average of the rounds observed."""
    weight: float = 0.25                    # of the newest observation
    seconds: dict[str, float] = field(default_factory=dict)

    def observe(self, program: str, seconds: float) -> None:
        old = self.seconds.get(program)
        self.seconds[program] = seconds if old is None else old + self.weight * (seconds - old)

    def ratio(self, program: str, baseline: str) -> float | None:
        """`program`'s cost in rounds of `baseline`; None until both were observed."""
        a, b = self.seconds.get(program), self.seconds.get(baseline)
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
    """One request's decaying acceptance evidence."""
    successes: float = 0.0
    failures: float = 0.0

    @property
    def rate(self) -> float:
        return (self.successes + PRIOR_SUCCESSES) / (self.successes + self.failures
                                                     + PRIOR_SUCCESSES + PRIOR_FAILURES)

    def draft_limit(self, policy: WidthPolicy) -> int:
        return policy.drafts_for(self.rate)

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
