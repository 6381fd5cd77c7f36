"""How many drafts each request verifies next step: the ones expected to pay
for the rows they add.

A verified draft costs a row of the step (its share of the matmuls, the
attention and the head) whether it is accepted or not, and is worth one
token only if it and every draft before it are accepted. Where rows are
nearly free (a GPU reading the weights once for any small batch; one
request on a CPU: the few-row kernels) every draft pays; where they are not
(eight requests on two CPU cores: 40-row products are compute-bound) drafts
that are likely rejected slow the batch down. vLLM's n-gram proposer has no
such rule; this one keeps vLLM's drafts, only shortened:

- the step's cost is measured, not assumed: t = base + per_row x rows, a
  least-squares fit over the recent decode steps (steps with prompt tokens
  left out); until the fit exists every draft is kept (vLLM's behaviour);
- each request's acceptance is counted per draft depth: alpha_j, the rate at
  which its j-th draft is accepted when every draft before it was (with a
  weak prior: with `pooled`, a drafting model's, the prior rate is the one
  pooled over every request so far -- a new request starts from the
  drafter's record, and one whose prior would not pay still drafts where
  the drafter's record says it does), and its j-th draft is worth
  alpha_1 x ... x alpha_j expected tokens. (A chained drafter's later
  drafts are often much worse than its first -- an MTP layer fed its own
  output: 89% of first drafts taken and 17% of second ones, measured on
  Qwen3.5's -- which one rate for every depth, alpha^j, would overvalue.)
- drafts are taken best first while each adds more tokens per second than
  the step makes with those already taken (the ratio tokens / time is
  maximised greedily: a draft of worth w pays iff w > rate x per_row);
- a proposer that always proposes k drafts (a draft model) gives steps of
  one size, which no fit can be made from: while there is no fit and the
  recent steps' rows do not vary, every PROBE_EVERY-th step verifies no
  drafts (a probe), so the fit sees what a step without them costs;
- a drafting model (`passes`: a draft model, an MTP layer) also pays a pass
  per draft depth -- its j-th drafts of every request are one pass, whose
  output head is read whole however few rows it has -- so the fit has a
  third term, t = base + per_row x rows + per_pass x passes (when the recent
  steps separate rows from passes; else per_pass is 0 and the row term
  carries both), and drafts are taken depth by depth: depth j opens (for the
  best prefix of the requests that drafted j - 1, by worth) only if it
  raises the tokens per second with its pass paid.
"""

from __future__ import annotations

from collections import deque

import numpy as np

# The prior on a request's acceptance: PRIOR_ACCEPTED accepted drafts and PRIOR_REJECTED rejections.
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0
POOL_DECAY = 0.99  # the pooled counts' weight per verified row (recent rows count most)
WINDOW = 64  # decode steps in the cost fit
# The rows the fit needs: a range of at least MIN_RANGE and a standard deviation of at least
# MIN_SPREAD (else: the last fit, or none) -- one probe in PROBE_EVERY steps gives both.
MIN_RANGE, MIN_SPREAD = 2, 0.5
PROBE_EVERY = 8  # without a fit and with rows that do not vary: one step in this many drafts nothing


class DraftBudget:
    def __init__(self, pooled: bool = False, passes: bool = False):
        self.pooled, self.passes = pooled, passes
        self.per_pass = 0.0  # seconds per pass (a drafting model's passes after the step)
        self.pool_rows = 0  # verified rows pooled since the last reset_pool
        self.samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.base: float | None = None  # seconds
        self.per_row: float | None = None  # seconds per row
        # req_id -> per depth j (index j - 1): drafts accepted, drafts verified with every one before accepted
        self.accepted: dict[str, list[float]] = {}
        self.tried: dict[str, list[float]] = {}
        self.pool: list[list[float]] = []  # per depth: [decayed accepted, decayed tried]
        self.trimmed = 0  # drafts dropped (instrumentation)
        self.probes = 0  # steps that verified no drafts to measure a plain step (instrumentation)
        self._allotted = 0  # allot() calls since the last probe

    def observe_step(self, rows: int, seconds: float, passes: int = 0) -> None:
        """A decode step's rows (requests + drafts), its time from execute_model
        to its output, and the draft passes run in that time (a drafting model)."""
        self.samples.append((rows, seconds, passes))
        if len(self.samples) < 8:
            return
        r, t, p = (np.array([s[i] for s in self.samples], np.float64) for i in range(3))
        if np.ptp(r) < MIN_RANGE or r.std() < MIN_SPREAD:
            return
        if self.passes and np.ptp(p) >= 1:
            x = np.stack([np.ones_like(r), r, p], axis=1)
            if np.linalg.matrix_rank(x) == 3 and np.linalg.cond(x) < 1e4:
                base, per_row, per_pass = np.linalg.lstsq(x, t, rcond=None)[0]
                if per_row > 0 and per_pass >= 0:
                    self.base, self.per_row, self.per_pass = max(float(base), 0.0), float(per_row), float(per_pass)
                    return
        slope = float(((r - r.mean()) * (t - t.mean())).sum() / ((r - r.mean()) ** 2).sum())
        if slope > 0:
            self.per_row, self.base, self.per_pass = slope, max(float(t.mean() - slope * r.mean()), 0.0), 0.0

    def observe_verify(self, req_id: str, drafted: int, accepted: int) -> None:
        """A verified row: `drafted` drafts, the first `accepted` of them taken (depths 1..accepted + 1
        were tried: each with every draft before it accepted)."""
        tried = min(drafted, accepted + 1)
        acc, seen = self.accepted.setdefault(req_id, []), self.tried.setdefault(req_id, [])
        while len(seen) < tried:
            acc.append(0.0)
            seen.append(0.0)
        while len(self.pool) < tried:
            self.pool.append([0.0, 0.0])
        for j in range(tried):
            seen[j] += 1
            acc[j] += j < accepted
        for j, counts in enumerate(self.pool):
            counts[0] *= POOL_DECAY
            counts[1] *= POOL_DECAY
            if j < tried:
                counts[0] += j < accepted
                counts[1] += 1
        self.pool_rows += 1

    def reset_pool(self) -> None:
        self.pool, self.pool_rows = [], 0

    def acceptance(self, req_id: str, depth: int = 1) -> float:
        """alpha_depth: the rate at which the request's draft at `depth` is taken when every draft
        before it was (its counts and the prior)."""
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
        prior = PRIOR_ACCEPTED / weight
        if self.pooled:  # the prior's weight stays two rows; its rate is the pool's at this depth
            a, t = self.pool[depth - 1] if depth <= len(self.pool) else (0.0, 0.0)
            prior = (a + PRIOR_ACCEPTED) / (t + weight)
        acc, seen = self.accepted.get(req_id, ()), self.tried.get(req_id, ())
        a, t = (acc[depth - 1], seen[depth - 1]) if depth <= len(seen) else (0.0, 0.0)
        return (a + prior * weight) / (t + weight)

    def worth(self, req_id: str, depth: int) -> float:
        """The expected tokens of the request's draft at `depth`: alpha_1 x ... x alpha_depth."""
        w = 1.0
        for j in range(1, depth + 1):
            w *= self.acceptance(req_id, j)
        return w

    def allot(self, proposals: dict[str, int], batch: int) -> dict[str, int]:
        """req_id -> how many of its proposed drafts to keep, for a step of `batch` requests."""
        if self.per_row is None and proposals:
            self._allotted += 1
            rows = [s[0] for s in list(self.samples)[-PROBE_EVERY:]]
            if len(rows) == PROBE_EVERY and np.ptp(rows) < MIN_RANGE and self._allotted >= PROBE_EVERY:
                self._allotted, self.probes = 0, self.probes + 1
                self.trimmed += sum(proposals.values())
                return dict.fromkeys(proposals, 0)
        if self.per_row is None or not proposals:
            return dict(proposals)
        if self.passes:
            return self._allot_by_depth(proposals, batch)
        worth = sorted(((self.worth(r, j), r) for r, n in proposals.items() for j in range(1, n + 1)),
                       reverse=True)
        keep = dict.fromkeys(proposals, 0)
        tokens, rows = float(batch), float(batch)
        for w, r in worth:
            rate = tokens / (self.base + self.per_row * rows)
            if w <= rate * self.per_row:
                break
            keep[r] += 1
            tokens, rows = tokens + w, rows + 1
        self.trimmed += sum(proposals.values()) - sum(keep.values())
        return keep

    def _allot_by_depth(self, proposals: dict[str, int], batch: int) -> dict[str, int]:
        keep = dict.fromkeys(proposals, 0)
        tokens, seconds = float(batch), self.base + self.per_row * batch
        for j in range(1, max(proposals.values()) + 1):
            worth = sorted(((self.worth(r, j), r) for r, n in proposals.items()
                            if n >= j and keep[r] == j - 1), reverse=True)
            best, total = (tokens / seconds, 0, 0.0), 0.0
            for i, (w, _) in enumerate(worth, 1):
                total += w
                rate = (tokens + total) / (seconds + self.per_pass + self.per_row * i)
                if rate > best[0]:
                    best = (rate, i, total)
            if not best[1]:
                break
            for _, r in worth[:best[1]]:
                keep[r] = j
            tokens, seconds = tokens + best[2], seconds + self.per_pass + self.per_row * best[1]
        self.trimmed += sum(proposals.values()) - sum(keep.values())
        return keep

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self.accepted.pop(r, None)
            self.tried.pop(r, None)
