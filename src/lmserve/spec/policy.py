"""How many drafts each request verifies in the next step: expected accepted tokens against measured row costs.

A verify row is not free. On a 2-core AVX2 host a step of 1 + 4 rows cost 1.77x a one-row step, so sampled
chat, where n-gram drafts land 22% of the time, ran at 0.85x with four drafts a step; a pause-on-low-acceptance
rule cannot see that, because it never looks at the cost. This policy does, with two running estimates:

- per request, the chance `alpha` that a draft is accepted given the one before it was (a geometric model: a
  run of k drafts keeps i of them with probability alpha^i (1 - alpha)); from exponentially forgotten counts of
  accepted drafts and first rejections, plus a prior, so a request nobody has seen yet tries drafting and one
  that stopped drafting drifts back to the prior and tries again (its evidence fades each step it sits out);
- for the engine, the seconds of a decode-only step by how many rows it ran, T(R), smoothed per R.

With B requests decoding, a plan of m draft rows yields B + (sum of the m rows' acceptance chances) tokens in
T(B + m) seconds. Draft i of a request is worth alpha^i, so the best rows are the most likely ones, and the
plan takes the number m of them with the highest tokens per second. Costs need not be linear (a native kernel
takes up to 8 rows at nearly the cost of one, and oneDNN the rest), so every m is tried, not just a slope.
A row count never measured above the largest measured is priced like it (optimism: so it gets measured once);
between measured counts, linearly. T(B) itself is measured by a step without drafts when there is no recent
measurement of it (every `REMEASURE_STEPS`), since step times drift as contexts grow.

A seeded sampled request is promised the same tokens in any batch, yet rejection sampling draws its random
numbers differently with and without drafts, so its draft counts must depend on its own history alone: it is
planned against a fixed cost curve (`SEEDED_ROW_COST`), never the measured one, and never paused to measure.
Greedy requests give the same tokens with any drafts (verification is exact), so they follow the measured plan.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTED, PRIOR_REJECTED = 0.75, 0.25  # alpha 0.75 with no evidence (worth one run): new requests try drafting
FORGET_PER_RUN = 0.8  # evidence weight kept per verify run (about the last 5 runs count)
FORGET_PER_IDLE_STEP = 0.95  # per step without drafts: ~60 such steps bring alpha back above 0.6
COST_SMOOTHING = 0.2  # weight of a new step time in T(R)
REMEASURE_STEPS = 64  # a T(B) older than this many steps is measured again (one step without drafts)
# seeded sampled requests: a verify row priced at this fraction of a one-row step (measured: 0.19 on a 2-core
# AVX2 host, rows 2-8 nearly free where the native skinny kernel takes them)
SEEDED_ROW_COST = 0.15
MIN_GAIN = 1.02  # drafting must promise 2% more tokens per second than not drafting (noise in T)


@dataclass
class Acceptance:
    """One request's evidence on its drafts: exponentially forgotten accepted drafts and first rejections."""

    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def alpha(self) -> float:
        """Chance that a draft is accepted given that the one before it was."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.accepted + self.rejected + PRIOR_ACCEPTED + PRIOR_REJECTED)

    def record(self, num_draft: int, num_accepted: int) -> None:
        """A verify run: `num_accepted` of `num_draft` drafts kept (a rejection ends the run)."""
        self.accepted = FORGET_PER_RUN * self.accepted + num_accepted
        self.rejected = FORGET_PER_RUN * self.rejected + (num_accepted < num_draft)

    def sat_out(self) -> None:
        """A step without drafts: old evidence fades, so a request that stopped drafting tries again."""
        self.accepted *= FORGET_PER_IDLE_STEP
        self.rejected *= FORGET_PER_IDLE_STEP


class StepCost:
    """Seconds of a decode-only engine step by the number of rows it ran: T(R), smoothed per R."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.measured_at: dict[int, int] = {}  # R -> step number of its last measurement

    def record(self, rows: int, seconds: float, step: int) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * seconds
        self.measured_at[rows] = step

    def is_fresh(self, rows: int, step: int) -> bool:
        """Measured within the last REMEASURE_STEPS steps."""
        return step - self.measured_at.get(rows, -REMEASURE_STEPS - 1) <= REMEASURE_STEPS

    def estimate(self, rows: int) -> float:
        """T(rows) from the measured counts; unmeasured counts above the largest measured cost the same as it."""
        if rows in self.seconds:
            return self.seconds[rows]
        below = max((r for r in self.seconds if r < rows), default=None)
        above = min((r for r in self.seconds if r > rows), default=None)
        if below is None:
            return self.seconds[above]
        if above is None:
            return self.seconds[below]
        t0, t1 = self.seconds[below], self.seconds[above]
        return t0 + (t1 - t0) * (rows - below) / (above - below)


class DraftPolicy:
    """Chooses each decoding request's draft count for the next step; learns from every step it sees."""

    def __init__(self) -> None:
        self.cost = StepCost()
        self.acceptance: dict[str, Acceptance] = {}
        self.num_steps = 0

    def record_step(self, rows: int, seconds: float, has_prefill: bool) -> None:
        """After each engine step: a decode-only step's time is a sample of T(rows)."""
        self.num_steps += 1
        if not has_prefill and rows > 0:
            self.cost.record(rows, seconds, self.num_steps)

    def record_run(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        self.acceptance.setdefault(request_id, Acceptance()).record(num_draft, num_accepted)

    def remove(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)

    def plan(self, request_ids: list[str], limits: list[int], num_decoding: int,
             seeded: list[bool] | None = None) -> list[int]:
        """Draft counts for `request_ids` (each at most its limit) when `num_decoding` requests decode next step.

        `seeded[i]`: request i samples with a seed, so its count comes from its own acceptance alone.
        """
        alphas = [self.acceptance.setdefault(r, Acceptance()).alpha for r in request_ids]
        seeded = seeded or [False] * len(request_ids)
        free = [i for i, s in enumerate(seeded) if not s]
        counts = [0] * len(request_ids)
        if free and num_decoding > 0 and self.cost.is_fresh(num_decoding, self.num_steps):
            for i, k in zip(free, best_plan([alphas[i] for i in free], [limits[i] for i in free], num_decoding,
                                            self.cost.estimate)):
                counts[i] = k
        for i in (i for i, s in enumerate(seeded) if s):
            counts[i] = best_plan([alphas[i]], [limits[i]], 1, _fixed_cost)[0]
        for rid, k in zip(request_ids, counts):
            if k == 0:
                self.acceptance[rid].sat_out()
        return counts


def best_plan(alphas: list[float], limits: list[int], num_decoding: int, seconds) -> list[int]:
    """Draft counts maximising expected tokens per second: (B + sum of chosen rows' alpha^i) / T(B + m).

    Candidate rows are ranked by their chance of being kept; as alpha^i falls with i, any prefix of the
    ranking takes each request's first drafts, never a later draft without the earlier ones.
    """
    rows = sorted(((a ** i, j) for j, (a, k) in enumerate(zip(alphas, limits)) for i in range(1, k + 1)),
                  key=lambda row: -row[0])
    base = num_decoding / seconds(num_decoding)
    best_m, best_rate, tokens = 0, base * MIN_GAIN, float(num_decoding)
    for m, (p, _) in enumerate(rows, 1):
        tokens += p
        rate = tokens / seconds(num_decoding + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    counts = [0] * len(alphas)
    for _, j in rows[:best_m]:
        counts[j] += 1
    return counts


def _fixed_cost(rows: int) -> float:
    """The cost curve seeded requests are planned against: each verify row SEEDED_ROW_COST of a step."""
    return 1.0 + SEEDED_ROW_COST * (rows - 1)
