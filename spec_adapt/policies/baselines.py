"""Adaptive length policies: Nightjar (the paper's contextual bandit) and the baselines it is measured against.

Reward everywhere: goodput of the step = tokens committed by the whole batch / step wall time (rows that finished
during the step count the tokens they committed). All policies accept γ = 0 (plain decoding).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field


from ..running_estimates import ema
from ..metrics import StepRecord
from .estimators import LatencyTable, OnlineLatency, PositionAcceptance, bucket
from .policy import Policy, StepInfo, check_int, from_json_lists, to_json_lists


def goodput(record: StepRecord) -> float:
    return sum(record.committed) / max(record.step_time, 1e-9)


def _arms(max_gamma, arms) -> list[int]:
    if arms is None:
        arms = list(range(check_int("max_gamma", max_gamma, 0) + 1))
    arms = sorted(set(int(a) for a in arms))
    if not arms or arms[0] < 0:
        raise ValueError(f"arms must be non-negative ints, got {arms!r}.")
    return arms


@dataclass
class _Schedule:
    """ADA-BINGREEDY state of one batch-size context (Nightjar, Algorithm 1)."""

    block: int = 1          # j_B
    horizon: int = 1        # H_B = 2^(j_B - 1)
    bin: int = 1            # b_B
    tau: int = 1            # round within the bin
    explore: bool = True    # the mode of the current bin
    means: list = field(default_factory=list)
    counts: list = field(default_factory=list)

    def advance(self) -> None:
        self.tau += 1
        if self.tau > math.sqrt(self.horizon):
            self.bin, self.tau = self.bin + 1, 1
            if self.bin > math.sqrt(self.horizon):
                self.block += 1
                self.horizon, self.bin = 2 ** (self.block - 1), 1


class Nightjar(Policy):
    """Per batch-size context, ADA-BINGREEDY over γ ∈ arms, with a switching cost for re-enabling the draft.

    Choices the paper leaves open, made here:
    - context: B bucketed to powers of two (`bucket`), each with an independent schedule;
    - untried arms: exploitation ranks only arms tried in this context; with none tried, the step explores;
    - exploration bins draw γ uniformly for every step of the bin;
    - switching cost: c_prefill(L_max, B) from a profiled `LatencyTable` (or `switch_cost(lag, B)`), where L_max is
      the largest number of committed tokens the draft has not cached (`StepInfo.draft_lag`); zero when unknown;
    - reward: goodput of the whole step (committed tokens / wall time), finished rows' tokens included;
    - `memory`: the paper's incremental mean (step 1/n) averages over all history, so after a workload shift it
      keeps trusting arms that were good long ago; with `memory` = M the step is max(1/n, 1/M), an exponential
      average over roughly the last M observations of the arm. None gives the paper's exact mean. Exploitation
      refreshes only the arm it picks, so after a shift each stale arm must be tried and decay in turn: the
      recovery takes on the order of (arms x M) steps, hence a short default (16);
    - `exploration`: "uniform" (the paper: any arm) or "local" (an arm within `radius` of the current greedy
      choice). Goodput is unimodal in γ, so local exploration wastes far less on hopeless arms; see the lab.
    """

    def __init__(self, max_gamma: int = 8, arms=None, latency: LatencyTable | None = None, switch_cost=None,
                 memory: int | None = 16, exploration: str = "uniform", radius: int = 2, seed: int = 0):
        self.arms = _arms(max_gamma, arms)
        if exploration not in ("uniform", "local"):
            raise ValueError(f"Nightjar(exploration) must be 'uniform' or 'local', got {exploration!r}.")
        self.exploration, self.radius = exploration, radius
        if memory is not None:
            check_int("Nightjar(memory)", memory, 1)
        self.latency, self.switch_cost, self.memory, self.seed = latency, switch_cost, memory, seed
        self.reset()

    def reset(self):
        self.rng = random.Random(self.seed)
        self.contexts: dict[int, _Schedule] = {}
        self.last_gamma: int | None = None
        self._pending = None

    def _context(self, batch_size) -> _Schedule:
        key = bucket(batch_size)
        if key not in self.contexts:
            self.contexts[key] = _Schedule(means=[0.0] * len(self.arms), counts=[0] * len(self.arms))
        return self.contexts[key]

    def _switch(self, info: StepInfo) -> float:
        lag = int(info.draft_lag.max()) if info.draft_lag is not None and len(info.draft_lag) else 0
        if self.switch_cost is not None:
            return float(self.switch_cost(lag, info.batch_size))
        return self.latency.switch_cost(lag, info.batch_size) if self.latency is not None else 0.0

    def choose(self, info: StepInfo):
        ctx = self._context(info.batch_size)
        if ctx.tau == 1:
            ctx.explore = self.rng.random() < 1.0 / math.sqrt(ctx.bin)
        tried = [i for i, n in enumerate(ctx.counts) if n > 0]
        if ctx.explore or not tried:
            if self.exploration == "local" and tried:
                greedy = self._exploit(ctx, tried, info)
                index = self.rng.randint(max(0, greedy - self.radius), min(len(self.arms) - 1, greedy + self.radius))
            else:
                index = self.rng.randrange(len(self.arms))
        else:
            index = self._exploit(ctx, tried, info)
        self._pending = (info.batch_size, index)
        return self.arms[index]

    def _exploit(self, ctx: _Schedule, tried: list[int], info: StepInfo) -> int:
        """argmin over tried arms of 1/ĝ + 1{γ_prev = 0 and γ > 0} c_prefill / γ."""
        switching = self.last_gamma == 0
        c_prefill = self._switch(info) if switching else 0.0

        def cost(i):
            gamma = self.arms[i]
            penalty = c_prefill / gamma if switching and gamma > 0 else 0.0
            return (1.0 / ctx.means[i] if ctx.means[i] > 0 else math.inf) + penalty

        return min(tried, key=cost)

    def observe(self, record: StepRecord):
        if self._pending is None:
            return
        batch_size, index = self._pending
        ctx = self._context(batch_size)
        ctx.counts[index] += 1
        step = 1.0 / ctx.counts[index] if self.memory is None else max(1.0 / ctx.counts[index], 1.0 / self.memory)
        ctx.means[index] += (goodput(record) - ctx.means[index]) * step
        ctx.advance()
        self.last_gamma, self._pending = self.arms[index], None

    def state_dict(self):
        version, internal, gauss = self.rng.getstate()
        return {"arms": self.arms, "seed": self.seed, "last_gamma": self.last_gamma,
                "contexts": {k: asdict(v) for k, v in self.contexts.items()},
                "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state):
        self.arms, self.seed, self.last_gamma = list(state["arms"]), state["seed"], state["last_gamma"]
        self.contexts = {int(k): _Schedule(**v) for k, v in state["contexts"].items()}
        version, internal, gauss = state["rng"]
        self.rng = random.Random()
        self.rng.setstate((version, tuple(internal), gauss))
        self._pending = None

    def __repr__(self):
        return f"Nightjar(arms={self.arms})"


class BanditSpecUCB(Policy):
    """UCB1 over γ with no batch-size context (BanditSpec): try every arm once, then
    argmax mean/scale + c * sqrt(2 ln t / n), rewards scaled by the largest goodput seen."""

    def __init__(self, max_gamma: int = 8, arms=None, c: float = 1.0):
        if not c >= 0:
            raise ValueError(f"BanditSpecUCB(c) must be >= 0, got {c!r}.")
        self.arms, self.c = _arms(max_gamma, arms), c
        self.reset()

    def reset(self):
        self.means, self.counts = [0.0] * len(self.arms), [0] * len(self.arms)
        self.best, self.t, self._index = 0.0, 0, None

    def scores(self) -> list[float]:
        scale = self.best or 1.0
        return [m / scale + self.c * math.sqrt(2 * math.log(max(self.t, 1)) / n) if n else math.inf
                for m, n in zip(self.means, self.counts)]

    def choose(self, info):
        scores = self.scores()
        self._index = max(range(len(self.arms)), key=lambda i: scores[i])
        return self.arms[self._index]

    def observe(self, record):
        if self._index is None:
            return
        r, i = goodput(record), self._index
        self.t, self.counts[i] = self.t + 1, self.counts[i] + 1
        self.means[i] += (r - self.means[i]) / self.counts[i]
        self.best, self._index = max(self.best, r), None

    def state_dict(self):
        return {"arms": self.arms, "c": self.c, "means": self.means, "counts": self.counts, "best": self.best,
                "t": self.t}

    def load_state_dict(self, state):
        self.arms, self.c = list(state["arms"]), state["c"]
        self.means, self.counts = list(state["means"]), list(state["counts"])
        self.best, self.t, self._index = state["best"], state["t"], None


class GoodputModel(Policy):
    """DSD-style: predict goodput(γ) = B * E[committed | γ] / T(B, γ) from per-position acceptance history and a
    latency model (profiled table, or fitted online), and take the argmax.

    Without exploration it deadlocks as the papers describe: once γ = 0 wins, nothing is drafted, the acceptance
    history stops changing, and speculation never comes back. `explore` > 0 is the fix: with that probability a
    step that would run at γ = 0 probes γ = 1 instead.
    """

    def __init__(self, max_gamma: int = 8, latency: LatencyTable | None = None, explore: float = 0.0,
                 decay: float = 0.98, seed: int = 0):
        if not 0.0 <= explore <= 1.0:
            raise ValueError(f"GoodputModel(explore) must be within [0, 1], got {explore!r}.")
        self.max_gamma = check_int("max_gamma", max_gamma, 0)
        self.table, self.explore, self.decay, self.seed = latency, explore, decay, seed
        self.reset()

    def reset(self):
        self.acceptance = PositionAcceptance(max(self.max_gamma, 1), self.decay)
        self.latency = OnlineLatency(self.table)
        self.rng = random.Random(self.seed)

    def predict(self, batch_size: int) -> list[float]:
        out, expected, run = [], 1.0, 1.0
        for g, p in enumerate([1.0] + self.acceptance.rates()[: self.max_gamma]):
            if g:
                run *= p
                expected += run
            out.append(batch_size * expected / self.latency.step_time(batch_size, g))
        return out

    def choose(self, info):
        predicted = self.predict(info.batch_size)
        gamma = max(range(len(predicted)), key=lambda g: predicted[g])
        if gamma == 0 and self.max_gamma > 0 and self.rng.random() < self.explore:
            gamma = 1
        return gamma

    def observe(self, record):
        self.acceptance.update_many(record.drafted, record.accepted)
        self.latency.add(record.batch_size, max(record.drafted, default=0), record.step_time)

    def state_dict(self):
        return {"max_gamma": self.max_gamma, "explore": self.explore, "tried": self.acceptance.tried,
                "accepted": self.acceptance.accepted, "latency": self.latency.state_dict(),
                "rng": to_json_lists(self.rng.getstate())}

    def load_state_dict(self, state):
        self.max_gamma, self.explore = state["max_gamma"], state["explore"]
        self.reset()
        self.acceptance.tried, self.acceptance.accepted = list(state["tried"]), list(state["accepted"])
        self.latency.load_state_dict(state["latency"])
        if "rng" in state:
            self.rng.setstate(from_json_lists(state["rng"]))


class ElasticEWMA(Policy):
    """Elastic Speculation's adaptive K: per row, an EWMA of the acceptance rate mapped to a small set of lengths
    (longer when recent drafts were mostly accepted, shorter when mostly rejected)."""

    def __init__(self, lengths=(1, 2, 4, 6, 8), alpha: float = 0.3, initial: float = 0.5):
        lengths = sorted(int(x) for x in lengths)
        if not lengths or lengths[0] < 0 or not 0 < alpha <= 1 or not 0 <= initial <= 1:
            raise ValueError("ElasticEWMA needs non-negative lengths, 0 < alpha <= 1 and 0 <= initial <= 1.")
        self.lengths, self.alpha, self.initial = lengths, alpha, initial
        self.rates: dict[int, float] = {}

    def begin(self, batch_size):
        self.rates = {}

    def admit(self, rows):
        for row in rows:
            self.rates.pop(int(row), None)

    def length_for(self, rate: float) -> int:
        return self.lengths[min(int(rate * len(self.lengths)), len(self.lengths) - 1)]

    def choose(self, info):
        return [self.length_for(self.rates.get(int(r), self.initial)) for r in info.rows]

    def observe(self, record):
        for row, d, a in zip(record.rows, record.drafted, record.accepted):
            if d:
                old = self.rates.get(row, self.initial)
                self.rates[row] = ema(old, a / d, self.alpha)

    def reset(self):
        self.rates = {}

    def state_dict(self):
        return {"lengths": self.lengths, "alpha": self.alpha, "initial": self.initial}

    def load_state_dict(self, state):
        self.__init__(state["lengths"], state["alpha"], state["initial"])


class PerRequest(Policy):
    """FASER-style per-request lengths: row i drafts s_i = argmin_s T̂(s; B) / (E_i[committed | s]), where
    E_i comes from the row's own per-position acceptance (Beta counts shrunk towards the batch-wide estimate) and
    T̂ from the latency model. Optimism under uncertainty: acceptance is read at mean + sqrt(beta * variance), the
    acceptance-side equivalent of GP-LCB's lower confidence bound on cost (a simpler bandit than a GP: see the
    closing note of the policies issue for why)."""

    def __init__(self, max_gamma: int = 8, latency: LatencyTable | None = None, beta: float = 1.0,
                 shrink: float = 4.0):
        self.max_gamma = check_int("max_gamma", max_gamma, 0)
        self.table, self.beta, self.shrink = latency, beta, shrink
        self.reset()

    def reset(self):
        self.pooled = PositionAcceptance(max(self.max_gamma, 1))
        self.rows: dict[int, PositionAcceptance] = {}
        self.latency = OnlineLatency(self.table)

    def begin(self, batch_size):
        self.rows = {}

    def admit(self, rows):
        for row in rows:
            self.rows.pop(int(row), None)

    def _optimistic_rates(self, row: int) -> list[float]:
        pooled = self.pooled.rates()
        own = self.rows.get(row)
        out = []
        for i, prior in enumerate(pooled):
            tried = own.tried[i] if own else 0.0
            acc = own.accepted[i] if own else 0.0
            a, b = acc + self.shrink * prior, (tried - acc) + self.shrink * (1 - prior)
            mean, var = a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
            out.append(min(1.0, mean + math.sqrt(self.beta * var)))
        return out

    def choose(self, info):
        times = [self.latency.step_time(info.batch_size, s) for s in range(self.max_gamma + 1)]
        out = []
        for row in info.rows.tolist():
            rates = self._optimistic_rates(row)
            best, best_cost, expected, run = 0, times[0], 1.0, 1.0
            for s in range(1, self.max_gamma + 1):      # E[committed | s] built up incrementally
                run *= rates[s - 1]
                expected += run
                if times[s] / expected < best_cost:
                    best, best_cost = s, times[s] / expected
            out.append(best)
        return out

    def observe(self, record):
        self.pooled.update_many(record.drafted, record.accepted)
        for row, d, a in zip(record.rows, record.drafted, record.accepted):
            own = self.rows.setdefault(row, PositionAcceptance(max(self.max_gamma, 1), prior_weight=0.0))
            own.update(d, a)
        self.latency.add(record.batch_size, max(record.drafted, default=0), record.step_time)

    def state_dict(self):
        # Per-row counts too: within a call they steer each row's length (begin() clears them for a new call).
        rows = [[row, own.tried, own.accepted] for row, own in self.rows.items()]
        return {"max_gamma": self.max_gamma, "beta": self.beta, "tried": self.pooled.tried,
                "accepted": self.pooled.accepted, "latency": self.latency.state_dict(), "rows": rows}

    def load_state_dict(self, state):
        self.max_gamma, self.beta = state["max_gamma"], state["beta"]
        self.reset()
        self.pooled.tried, self.pooled.accepted = list(state["tried"]), list(state["accepted"])
        self.latency.load_state_dict(state["latency"])
        for row, tried, accepted in state.get("rows", []):
            own = self.rows[int(row)] = PositionAcceptance(max(self.max_gamma, 1), prior_weight=0.0)
            own.tried, own.accepted = list(tried), list(accepted)
