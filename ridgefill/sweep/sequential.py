"""The sweep's sequential rule: when to stop drawing needle prompts at one (split, arm) (docs/sweep.md).

Each prompt gives a pair (exact right?, arm right?). The arm's needle drop is delta = P(exact right, arm wrong) -
P(arm right, exact wrong): the expected points it loses against exact (/ 100). The budget is a drop of at most
`budget` (a fraction). Prompts are drawn in a fixed order, and the rule looks after every `group` of them:

- at an early look (n < samples prompts), it decides
  * **over** when an exact test rejects delta <= budget at level alpha / (looks - 1): the p-value is the largest
    probability, over every distribution of pairs with delta = budget, of a sum of (exact - arm) at least the one
    seen (`p_over`);
  * **within** when an exact test rejects delta >= WITHIN_FACTOR x budget at that level: delta >= D needs
    P(exact right, arm wrong) >= D, so the p-value is P(Binomial(n, D) <= the prompts the arm missed where exact
    answered) (`p_within`). Drops between the budget and WITHIN_FACTOR x budget form the indifference zone: a
    split there may stop either way, as its 40-prompt point estimate may land either side.
- at the last look (n = samples) it judges the point estimate, exactly as the exhaustive sweep does: within when
  the drop measured on all `samples` prompts is at most the budget.

The levels add up over the early looks (Bonferroni), so for any true drop the chance that an early decision lands
on the wrong side (over when delta <= budget; within when delta >= WITHIN_FACTOR x budget) is at most `alpha`.

    rule = Rule(budget=0.10, samples=40)       # looks at 8, 16, 24, 32 (tests at alpha / 4 each) and 40
    rule.decide(pairs)                         # Decision("over", 8, ...) | Decision(None, ...) to go on
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ALPHA = 0.05  # the chance of a wrong early decision, over all looks of one (split, arm)
GROUP = 8  # prompts between looks: one per needle depth
WITHIN_FACTOR = 2.0  # "within" early rejects a drop of at least this many budgets
GRID = 512  # points of the nuisance P(arm right, exact wrong) over which p_over takes its maximum
TOLERANCE = 1e-9  # the point rule: a drop equal to the budget up to round-off is within


@dataclass(frozen=True)
class Decision:
    verdict: str | None  # "within", "over", or None: draw the next group
    n: int  # prompts the decision rests on
    drop: float  # the measured drop (fraction) on those prompts
    early: bool  # decided by a test before the last look (False: the point estimate on every prompt)
    p_over: float | None = None
    p_within: float | None = None


@dataclass(frozen=True)
class Rule:
    budget: float  # the largest drop within budget, as a fraction (10 points: 0.10)
    samples: int  # the most prompts drawn
    group: int = GROUP
    alpha: float = ALPHA

    def __post_init__(self):
        if not (math.isfinite(self.budget) and self.budget >= 0):
            raise ValueError(f"budget must be a fraction >= 0, got {self.budget}")
        if self.samples < 1 or self.group < 1 or not 0 < self.alpha < 1:
            raise ValueError("samples and group must be >= 1, and alpha in (0, 1)")

    @property
    def looks(self) -> tuple[int, ...]:
        """The prompt counts at which the rule looks: every `group`, and the last at `samples`."""
        return tuple(range(self.group, self.samples, self.group)) + (self.samples,)

    @property
    def level(self) -> float:
        """Each early look's test level: alpha shared equally by the looks before the last."""
        return self.alpha / max(len(self.looks) - 1, 1)

    def decide(self, pairs) -> Decision:
        """The decision after the pairs (exact right, arm right) drawn so far, in order; only their first
        `samples` count. Between looks, and at an early look that decides nothing, the verdict is None."""
        pairs = [(bool(e), bool(a)) for e, a in pairs][: self.samples]
        n = len(pairs)
        diff = sum(e - a for e, a in pairs)
        drop = diff / n if n else 0.0
        if n == self.samples:
            return Decision("within" if drop <= self.budget + TOLERANCE else "over", n, drop, False)
        if n not in self.looks:
            return Decision(None, n, drop, False)
        missed = sum(e and not a for e, a in pairs)
        po, pw = p_over(n, diff, self.budget), p_within(n, missed, WITHIN_FACTOR * self.budget)
        verdict = "over" if po <= self.level else "within" if pw <= self.level else None
        return Decision(verdict, n, drop, verdict is not None, po, pw)

    def bounds(self) -> list[dict]:
        """Per early look: the smallest sum of (exact - arm) that stops "over", and the most prompts the arm may
        miss where exact answered and still stop "within" (None: no count does); for the docs and the report."""
        out = []
        for n in self.looks[:-1]:
            over = next((s for s in range(-n, n + 1) if p_over(n, s, self.budget) <= self.level), None)
            within = max((m for m in range(n + 1) if p_within(n, m, WITHIN_FACTOR * self.budget) <= self.level),
                         default=None)
            out.append({"n": n, "over_at_least": over, "within_at_most": within})
        return out


def p_within(n: int, missed: int, drop: float) -> float:
    """The p-value of "the true drop is at least `drop`" given that the arm missed `missed` of n prompts exact
    answered: P(Binomial(n, drop) <= missed), since a drop of `drop` needs P(exact right, arm wrong) >= drop."""
    if drop >= 1:
        return 0.0 if missed < n else 1.0
    k = np.arange(missed + 1)
    return float(min(1.0, np.exp(_log_binom(n, k) + k * _log(drop) + (n - k) * math.log1p(-drop)).sum()))


def p_over(n: int, diff: int, budget: float) -> float:
    """The p-value of "the true drop is at most `budget`" given a sum `diff` of (exact - arm) over n prompts: the
    largest P(sum >= diff) over every distribution of pairs with drop = budget (the largest over drops <= budget:
    moving probability towards (exact right, arm wrong) only raises the sum), taken on GRID values of the nuisance
    c = P(arm right, exact wrong) in [0, (1 - budget) / 2] and the far end."""
    if budget >= 1:
        return 1.0
    return _p_over(int(n), int(diff), float(budget))


@lru_cache(maxsize=4096)
def _p_over(n: int, diff: int, budget: float) -> float:
    if diff <= -n:
        return 1.0
    c = np.linspace(0.0, (1.0 - budget) / 2.0, GRID)[:, None, None]  # [G, 1, 1]
    b = c + budget
    z = 1.0 - b - c
    nb = np.arange(n + 1)[None, :, None]  # prompts exact right, arm wrong
    nc = np.arange(n + 1)[None, None, :]  # prompts arm right, exact wrong
    ok = (nb + nc <= n) & (nb - nc >= diff)
    nz = np.where(nb + nc <= n, n - nb - nc, 0)
    logp = (_log_multinomial(n, nb, nc, nz) + nb * _log(b) + nc * _log(c) + nz * _log(z))
    probs = np.where(ok, np.exp(np.where(ok, logp, -np.inf)), 0.0).sum(axis=(1, 2))
    return float(min(1.0, probs.max()))


def _log(x):
    """log(x), with 0 * log(0) read as 0 by the callers (x = 0 gives a large negative number, not -inf)."""
    return np.log(np.maximum(x, 1e-300))


def _log_binom(n, k):
    return _lgamma(n + 1) - _lgamma(k + 1) - _lgamma(n - k + 1)


def _log_multinomial(n, a, b, c):
    return _lgamma(n + 1) - _lgamma(a + 1) - _lgamma(b + 1) - _lgamma(c + 1)


_lgamma = np.vectorize(math.lgamma, otypes=[float])
