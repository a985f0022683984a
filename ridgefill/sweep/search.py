"""Which (split, arm) pairs the sweep measures needles at, and on how many prompts (docs/sweep.md).

A *job* is one (split, arm) whose needle retrieval is measured: prompts drawn in the suite's fixed order, each
giving the pair (exact right, arm right), until the sequential rule (`sequential.Rule`) decides "within" or
"over". `run_pass` measures a set of jobs side by side: every prompt is measured once for all the jobs still
undecided, so they share its exact forward. `Bisection` finds one arm's shallowest split within budget among the
candidates, assuming that an arm within budget at a split is within budget at every deeper one (needle retrieval
has been monotone in the split in every sweep so far): it visits the middle candidate of the splits still open,
and a verdict closes every split on its side. When at most TOGETHER splits are still open it measures them all in
one pass: a pass costs one forward of the early layers per prompt whatever it holds, and a fill about a quarter of
that, so measuring the last few side by side costs less than visiting them in turn. A split whose verdict is known
without needles (its key-token ΔNLL is over budget) costs no prompt. `find_edges` is the sweep's plain search: a
bisection per arm, or every split and arm on every prompt.

    b = Bisection([8, 10, 12, 14], known={8: "over"})
    while splits := b.next_splits():
        for s in splits:
            b.record(s, verdict_of(s))
    b.edge        # the shallowest split within budget (None: none is)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ridgefill.sweep.sequential import Decision, Rule

TOGETHER = 3  # the open splits measured in one pass once no more than this many remain


@dataclass
class Bisection:
    candidates: list[int]
    known: dict = field(default_factory=dict)  # {split: "within" | "over"} decided without needles
    verdicts: dict = field(default_factory=dict)  # every split decided so far, measured or known
    measured: list = field(default_factory=list)  # the splits whose needles were measured, in order

    def __post_init__(self):
        self.candidates = sorted(self.candidates)
        self._lo, self._hi = 0, len(self.candidates)

    def next(self) -> int | None:
        """The next split to measure, or None when the edge is found. Known verdicts are used on the way."""
        while self._lo < self._hi:
            mid = (self._lo + self._hi) // 2
            s = self.candidates[mid]
            v = self.verdicts.get(s) or self.known.get(s)
            if v is None:
                return s
            self.verdicts[s] = v
            if v == "within":
                self._hi = mid
            else:
                self._lo = mid + 1
        # Splits measured side by side may disagree with monotonicity (a deeper one over): the edge lies below no
        # split over, as the exhaustive sweep's does.
        over = [i for i, c in enumerate(self.candidates) if (self.verdicts.get(c) or self.known.get(c)) == "over"]
        self._lo = self._hi = max([self._lo] + [i + 1 for i in over])
        return None

    def next_splits(self) -> list[int]:
        """The splits to measure next, side by side: the middle one still open, or every open one when no more than
        TOGETHER remain; [] when the edge is found."""
        s = self.next()
        if s is None:
            return []
        open_ = [c for c in self.candidates[self._lo : self._hi] if c not in self.verdicts and c not in self.known]
        return open_ if len(open_) <= TOGETHER else [s]

    def record(self, split: int, verdict: str) -> None:
        if verdict not in ("within", "over"):
            raise ValueError(f"a verdict is 'within' or 'over', not {verdict!r}")
        self.verdicts[split] = verdict
        self.measured.append(split)

    @property
    def edge(self) -> int | None:
        """The shallowest candidate within budget (once `next` returned None)."""
        return self.candidates[self._lo] if self._lo < len(self.candidates) else None

    def inferred(self) -> dict:
        """Every candidate's verdict: measured or known where it was, else implied by monotonicity from the edge."""
        edge = self.edge
        return {s: self.verdicts.get(s) or ("within" if edge is not None and s >= edge else "over")
                for s in self.candidates}


def run_pass(jobs, rule: Rule, measure) -> dict:
    """Measure `jobs` (hashable keys) side by side: prompt i = 0, 1, ... is measured for the jobs still undecided,
    `measure(i, jobs) -> (exact right, {job: arm right})`, until each has its decision. -> {job: (Decision, pairs)}.
    """
    pairs = {j: [] for j in jobs}
    done: dict = {}
    for i in range(rule.samples):
        active = [j for j in jobs if j not in done]
        if not active:
            break
        exact, got = measure(i, active)
        for j in active:
            pairs[j].append((bool(exact), bool(got[j])))
            d = rule.decide(pairs[j])
            if d.verdict is not None:
                done[j] = d
    return {j: (done[j], pairs[j]) for j in jobs}


def bisect_arms(arms: dict, rule: Rule, measure) -> tuple[dict, dict]:
    """One `Bisection` per arm ({arm: Bisection}), advanced together: each pass measures every arm's next splits.
    -> (arms, {(split, arm): (Decision, pairs)} for every job measured)."""
    results: dict = {}
    while True:
        jobs = [(s, arm) for arm, b in arms.items() for s in b.next_splits()]
        if not jobs:
            return arms, results
        got = run_pass(jobs, rule, measure)
        for (s, arm), (d, pairs) in got.items():
            arms[arm].record(s, d.verdict)
            results[(s, arm)] = (d, pairs)


def rule_of(cfg, mix) -> Rule:
    """The sequential rule of a sweep's settings (a SweepConfig) on its needle mix (`needles.Mix`): the needle budget
    (the tighter of the sweep's and a gate's, `config.budget`), at most `needles` prompts rounded up to whole
    rounds of the mix, looking after every group of rounds, or only at the last in an exhaustive sweep."""
    from ridgefill.sweep.config import budget

    samples = mix.prompts(cfg.needles)
    return Rule(budget=budget(cfg)["needle_drop"][1] / 100.0, samples=samples,
                group=samples if cfg.exhaustive else mix.group)


@dataclass(frozen=True)
class Edges:
    """The plain needle search's outcome, per arm and per (split, arm)."""

    verdicts: dict  # {(split, arm): "within" | "over"}, measured, known or implied
    decided: dict  # {(split, arm): how its verdict was reached, in words}
    jobs: dict  # {(split, arm): (Decision, pairs)} for every job measured
    search: dict  # {arm: {"edge": the shallowest split within budget or None, "measured": the splits measured}}


def find_edges(splits: list[int], arms, key_over: dict, rule: Rule, measure, exhaustive: bool, out) -> Edges:
    """Each arm's edge among `splits`: by bisection with the sequential rule, or every split and arm on every prompt
    (`exhaustive`). A (split, arm) over budget on the documents (`key_over`: {job: the figure over, in words, or
    None}) is over without needles (in an exhaustive sweep it is measured all the same, and over)."""
    if exhaustive:
        out.info(f"needles: every split and arm on all {rule.samples} prompts (--exhaustive)")
        jobs = run_pass([(s, a) for s in splits for a in arms], rule, measure)
        verdicts = {k: ("over" if key_over[k] or d.verdict == "over" else "within") for k, (d, _) in jobs.items()}
        search = {a: {"edge": exhaustive_edge([s for s in splits if verdicts[(s, a)] == "within"], splits),
                      "measured": list(splits)} for a in arms}
    else:
        bis = {a: Bisection(splits, known={s: "over" for s in splits if key_over[(s, a)]}) for a in arms}
        out.info(f"needles: bisection over splits {', '.join(map(str, splits))}, sequential rule "
                 f"(looks at {', '.join(map(str, rule.looks))} prompts)")
        bis, jobs = bisect_arms(bis, rule, measure)
        verdicts = {(s, a): v for a, b in bis.items() for s, v in b.inferred().items()}
        search = {a: {"edge": b.edge, "measured": b.measured} for a, b in bis.items()}
    decided = {k: _decided(k, key_over, jobs, search) for k in verdicts}
    return Edges(verdicts, decided, jobs, search)


def exhaustive_edge(within: list[int], splits: list[int]) -> int | None:
    """The shallowest split from which every deeper candidate is within budget (exhaustive measurements)."""
    edge = None
    for s in reversed(splits):
        if s not in within:
            break
        edge = s
    return edge


def decision_words(d: Decision) -> str:
    """How a job's needles decided it, in words."""
    return f"needles, {d.n} prompts" + (" (sequential rule)" if d.early else "")


def _decided(job, key_over: dict, jobs: dict, search: dict) -> str:
    if key_over[job]:
        return key_over[job]
    if job in jobs:
        return decision_words(jobs[job][0])
    s, arm = job
    edge = search[arm]["edge"]
    return f"implied: {'within from split ' + str(edge) if edge is not None and s >= edge else 'over below the edge'}"


__all__ = ["TOGETHER", "Bisection", "Decision", "Edges", "bisect_arms", "exhaustive_edge", "find_edges", "rule_of",
           "run_pass"]
