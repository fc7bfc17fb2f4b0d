"""ChainScheduler: SpecRouter's online choice of chain and draft width W.

For each candidate chain C (any ascending subset of the chain's levels, then the target: the first member drafts,
the others verify; [0] alone is the plain 2-level pair, [j] an intermediate model drafting on its own) and W in
`widths`, it predicts the time per committed target token
    T_eff(C, W) = [W d_first + sum_j P(reach j) v_j + T_target(B, s)] / E[tokens the target commits]
with, between consecutive members i -> j of the chain, E[accepted] = sum_{k=1..w} alpha_ij^k (w = what reaches j)
and each intermediate level adding one token of its own. Inputs are exponential moving averages updated from what
the chain and the loop measure: d_i per token drafted by level i, v_j per verification call of level j (a level
that has never drafted is assumed to draft a token for the price of one verification call), the fill of the
drafting level (tokens it proposes per token asked: a prompt lookup without a match proposes none), T_target(B, s)
for a step apart from drafting (verification, acceptance, bookkeeping) with s tokens reaching the target (an
online least-squares fit, as Nightjar's, once two widths have been seen; plain averages before), alpha_ij per pair of adjacent members, and
SimScore_ij = 1 - E[D_TV(p_i, p_j)] (sampling mode) mapped to alpha through a ratio calibrated on pairs observed
both ways. Pairs never observed start optimistic (0.6), so every chain is tried; afterwards `explore` is the chance of trying a random candidate. The target-only option (W = 0) is
always a candidate; since target-only steps observe nothing about the draft, after `probe_every` of them in a row
the best speculative option runs once (without it a noisy low estimate would switch speculation off for good).
`length_policy`, if given, chooses W instead (the two compose: the scheduler then only picks the levels).
"""

from __future__ import annotations

import itertools
import random

from ..metrics import StepRecord
from ..profiling import OnlineLatency
from .base import Policy, StepInfo


class ChainScheduler(Policy):
    def __init__(self, chain, widths=(1, 2, 4, 6, 8), length_policy: Policy | None = None, ema: float = 0.2,
                 explore: float = 0.05, prior_alpha: float = 0.6, probe_every: int = 16, seed: int = 0):
        self.chain, self.widths, self.length_policy = chain, tuple(widths), length_policy
        self.ema, self.explore, self.prior_alpha, self.seed = ema, explore, prior_alpha, seed
        self.probe_every = probe_every
        levels = range(len(chain.verifiers) + 1)
        self.candidates = [tuple(c) for r in range(1, len(levels) + 1) for c in itertools.combinations(levels, r)]
        self.reset()

    def reset(self):
        self.rng = random.Random(self.seed)
        self.alpha: dict[tuple, float] = {}        # (i, j) chain members (indices into the levels, "T" = target)
        self.sim: dict[tuple, float] = {}
        self.t_draft: dict[int, float] = {}        # seconds per drafted token, per level
        self.t_verify: dict[int, float] = {}       # seconds per verification call, per intermediate level
        self.fill: dict[int, float] = {}           # tokens a level drafts per token asked (prompt lookup: < 1)
        self.t_target: float | None = None
        self.t_plain: float | None = None          # a target step with nothing drafted
        # The target's step grows with the tokens it verifies (on a CPU, 9 tokens cost ~1.7x one): once samples
        # at two widths are in, T(B, s) comes from an online fit instead of the two averages above.
        self.latency = OnlineLatency(window=256, min_samples=8, refit_every=8)
        self.current = (tuple(range(len(self.chain.verifiers) + 1)), self.widths[-1])
        self.history: list[tuple] = []
        self.idle = 0                              # target-only steps in a row

    # -- prediction ---------------------------------------------------------------------------------------------
    def _alpha(self, i, j) -> float:
        if (i, j) in self.alpha:
            accepted, tried = self.alpha[(i, j)]
            return accepted / tried if tried > 0 else self.prior_alpha
        if (i, j) in self.sim and self.alpha:
            ratio = sum(self._alpha(*k) / max(self.sim[k], 1e-3) for k in self.alpha if k in self.sim) or None
            if ratio:
                count = sum(1 for k in self.alpha if k in self.sim)
                return min(1.0, self.sim[(i, j)] * ratio / count)
        return self.prior_alpha

    def _target_time(self, batch: int, verified: float) -> float:
        if self.latency.ready():
            return self.latency.step_time(batch, int(round(verified)))
        if verified == 0 and self.t_plain is not None:
            return self.t_plain
        return self.t_target if self.t_target is not None else (self.t_plain or 1.0)

    def predict(self, members: tuple, width: int, batch: int = 1) -> float:
        """Predicted seconds per committed target token for this chain (levels, first one drafting) and width."""
        if width == 0:
            return self._target_time(batch, 0)
        first = members[0]
        per_token = self.t_draft.get(first, self.t_verify.get(first, 0.0))
        reaching = width * self.fill.get(first, 1.0)
        cost = reaching * per_token
        chain = list(members) + ["T"]
        for a, b in zip(chain, chain[1:]):
            alpha = self._alpha(a, b)
            accepted = sum(alpha ** k for k in range(1, int(round(reaching)) + 1))
            if b == "T":
                return (cost + self._target_time(batch, reaching)) / (accepted + 1.0)
            cost += self.t_verify.get(b, 0.0)
            reaching = min(float(width), accepted + 1.0)
        raise AssertionError("unreachable")

    # -- the Policy contract ------------------------------------------------------------------------------------
    def choose(self, info: StepInfo):
        options = [(c, w) for c in self.candidates for w in self.widths] + [((), 0)]
        if self.rng.random() < self.explore:
            levels, width = self.rng.choice(options)
        else:
            levels, width = min(options, key=lambda o: self.predict(*o, batch=info.batch_size))
        self.idle = self.idle + 1 if width == 0 else 0
        if width == 0 and self.idle >= self.probe_every:
            levels, width = min(options[:-1], key=lambda o: self.predict(*o, batch=info.batch_size))
            self.idle = 0
        if self.length_policy is not None:
            width = self.length_policy.choose(info)
        self.current = (levels, width)
        if levels:                                  # target-only steps leave the chain as it is
            self.chain.use(list(levels))
        self.history.append((info.batch_size, levels, width if isinstance(width, int) else max(width)))
        return width

    def observe(self, record: StepRecord):
        if self.length_policy is not None:
            self.length_policy.observe(record)
        stats = self.chain.level_stats
        for level, s in enumerate(stats):
            if s["draft_tokens"]:
                self._update(self.t_draft, level, s["draft_seconds"] / s["draft_tokens"])
        first = next((level for level, s in enumerate(stats) if s["draft_calls"]), None)   # who drafted
        members = [] if first is None else [first] + [
            m for m in self.chain.members if m > first and m not in self.chain.failed]
        if members and sum(record.gammas):
            self._update(self.fill, first, stats[first]["draft_tokens"] / sum(record.gammas))
        for a, b in zip(members, members[1:]):
            s = stats[b]
            if s["calls"]:
                self._update(self.t_verify, b, s["seconds"] / s["calls"])
            if s["tried"]:      # alpha = P(accept | reached): accepted over positions decided, not over drafted
                self._count(a, b, s["accepted"], s["tried"])
            if s["tv"]:
                self._update(self.sim, (a, b), 1.0 - sum(s["tv"]) / len(s["tv"]))
        drafted = sum(record.drafted)
        tried = sum(a + (a < d) for a, d in zip(record.accepted, record.drafted))
        self.latency.add(record.batch_size, max(record.drafted, default=0), record.step_time - record.draft_time)
        if drafted:
            if tried:
                self._count(members[-1], "T", sum(record.accepted), tried)
            # Everything in a step but drafting: verification, acceptance and bookkeeping all grow with steps.
            self.t_target = self._ema(self.t_target, record.step_time - record.draft_time)
        else:
            self.t_plain = self._ema(self.t_plain, record.step_time)
        self.chain.reset_stats()

    def _count(self, a, b, accepted, tried) -> None:
        """alpha is a ratio of moving averages (EMA accepted / EMA decided): an EMA of per-step ratios is biased low
        when runs are long (a step that stops after 1 of 8 reads 0.5, one that stops at once reads 0)."""
        old = self.alpha.get((a, b))
        self.alpha[(a, b)] = [accepted, tried] if old is None else [
            (1 - self.ema) * old[0] + self.ema * accepted, (1 - self.ema) * old[1] + self.ema * tried]

    def _ema(self, old, new):
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def _update(self, table, key, value):
        table[key] = self._ema(table.get(key), value)

    def state_dict(self):
        return {"alpha": [[list(map(str, k)), list(v)] for k, v in self.alpha.items()],
                "t_draft": self.t_draft, "t_verify": self.t_verify, "fill": self.fill, "t_target": self.t_target,
                "t_plain": self.t_plain}
