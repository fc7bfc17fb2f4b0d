"""ChainScheduler: SpecRouter's online choice of chain and draft width W.

For each candidate chain C (any ascending subset of the chain's levels, then the target: the first member drafts,
the others verify; [0] alone is the plain 2-level pair, [j] an intermediate model drafting on its own) and W in
`widths`, it predicts the time per committed target token
    T_eff(C, W) = [W d_first + sum_j P(reach j) v_j + T_target(B, s)] / E[tokens the target commits]
with, between consecutive members i -> j of the chain, E[accepted] = sum_{k=1..w} alpha_ij^k (w = what reaches j)
and each intermediate level adding one token of its own. Times come from the step-cost model
(`spec_adapt.policies.cost.StepCost`, per batch-size bucket; the nearest bucket seen stands in for a new one): d_i,
level i's drafting (source "level<i>": one draft step for the whole batch, by tokens drafted per row), v_j, a
verification call of level j (source "level<j>-verify"; a level that has never drafted is assumed to draft a token
for the price of one verification call), a switching cost (Nightjar's c_prefill, here per level: a model left out
of the chain, or idle during target-only steps, must first catch up on the tokens committed meanwhile; measured on
the steps that had it, and kept out of d_i and v_j), and T_target(B, s), the target's verification of s tokens plus
the step's host work. Exponential moving averages count the rest: the fill of the drafting level (tokens it
proposes per token asked: a prompt lookup without a match proposes none). A batch is
verified as wide as its longest row, so s is the chain's measured span (largest proposal / W, per B: a prompt
lookup's average row may propose a fraction of W while some row nearly always proposes W), not the average row's,
alpha_ij per pair of adjacent members, and
SimScore_ij = 1 - E[D_TV(p_i, p_j)] (sampling mode) mapped to alpha through a ratio calibrated on pairs observed
both ways. Pairs never observed start optimistic (0.6), so every chain is tried; afterwards `explore` is the
chance of trying another candidate among those predicted within `explore_margin` of the best (a uniformly random
one can be a wide draft-model step at a large batch, several target steps' worth, for nothing). The target-only
option (W = 0) is always a candidate; since target-only steps observe nothing about the draft, after `probe_every`
of them in a row the best speculative option runs once (without it a noisy low estimate would switch speculation
off for good). A probe that loses to a target-only step (catch-up excluded) doubles the wait before the next one,
up to 16x; one that wins resets it.
`length_policy`, if given, chooses W instead (the two compose: the scheduler then only picks the levels). A length
policy that keeps a step-cost model (`Adaptive`) shares it: it writes each step's verification and host work, and the
scheduler adds only its levels' drafting ("level<i>", "level<j>-verify", their catch-up), which no one else observes.
"""

from __future__ import annotations

import itertools
import math
import random

from ..drafters.chain import ChainDrafter
from ..metrics import StepRecord
from ..running_estimates import ema
from .policy import USUAL_LAG, Plan, Policy, StepInfo, from_json_lists, to_json_lists
from .cost import StepCost
from .estimators import ProbeBackoff


class ChainScheduler(Policy):
    def __init__(self, chain, widths=(1, 2, 4, 6, 8), length_policy: Policy | None = None, ema: float = 0.2,
                 explore: float = 0.05, prior_alpha: float = 0.6, probe_every: int = 16, seed: int = 0,
                 explore_margin: float = 0.25):
        if not 0.0 <= explore <= 1.0 or explore_margin < 0 or probe_every < 1:
            raise ValueError(f"ChainScheduler needs 0 <= explore <= 1, explore_margin >= 0 and probe_every >= 1; got "
                             f"explore={explore}, explore_margin={explore_margin}, probe_every={probe_every}.")
        if not isinstance(chain, ChainDrafter):
            raise TypeError(f"ChainScheduler schedules a ChainDrafter (pass the same one as drafter=), got "
                            f"{type(chain).__name__}. For a single drafter use a length policy such as Nightjar().")
        self.explore_margin = explore_margin
        # The chain is read for its shape only (how many levels); the scheduler steers it through its Plan.
        self.levels = len(chain.verifiers) + 1
        self.widths, self.length_policy = tuple(widths), length_policy
        self.ema, self.explore, self.prior_alpha, self.seed = ema, explore, prior_alpha, seed
        self.probe_every = probe_every
        levels = range(self.levels)
        self.candidates = [tuple(c) for r in range(1, len(levels) + 1) for c in itertools.combinations(levels, r)]
        self.options = [(c, w) for c in self.candidates for w in self.widths] + [((), 0)]   # target-only last
        self.reset()

    def reset(self):
        self.rng = random.Random(self.seed)
        self.alpha: dict[tuple, float] = {}        # (i, j) chain members (indices into the levels, "T" = target)
        self.sim: dict[tuple, float] = {}
        # The target's verification, each level's drafting, verification and catch-up: its own step-cost model, or
        # none where the length policy keeps one (`cost`).
        self._own = None if isinstance(getattr(self.length_policy, "cost", None), StepCost) else StepCost()
        self.step_lags: list[int] = []             # each level's lag when the current step was chosen
        self.fill: dict[int, float] = {}           # tokens a level drafts per token asked (prompt lookup: < 1)
        self.span: dict[tuple, float] = {}         # (members, B): the batch's longest proposal at the target / W
        self.current = (tuple(range(self.levels)), self.widths[-1])
        self.history: list[tuple] = []
        self.probes = ProbeBackoff(self.probe_every, 16 * self.probe_every)   # target-only steps, then a probe
        self.probing = False

    @property
    def cost(self) -> StepCost:
        return self._own if self._own is not None else self.length_policy.cost

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
        return self.cost.verify_time(batch, verified + 1) + self.cost.host_time(batch)

    def predict(self, members: tuple, width: int, batch: int = 1, lags=None) -> float:
        """Predicted seconds per committed target token for this chain (levels, first one drafting) and width;
        `lags` (per level, tokens behind) adds the catch-up the members would need first."""
        if width == 0:
            return self._target_time(batch, 0)
        first = members[0]
        reaching = width * self.fill.get(first, 1.0)
        per_call = self.cost.draft_time(_verifying(first), batch, 1, unknown=0.0)
        cost = self.cost.draft_time(_drafting(first), batch, reaching, unknown=per_call) + \
            self._catch_up(members, batch, lags)
        chain = list(members) + ["T"]
        for a, b in zip(chain, chain[1:]):
            alpha = self._alpha(a, b)
            accepted = sum(alpha ** k for k in range(1, int(round(reaching)) + 1))
            if b == "T":
                verified = max(reaching, width * _at(self.span, tuple(members), batch, 0.0))
                return (cost + self._target_time(batch, verified)) / (accepted + 1.0)
            cost += self.cost.draft_time(_verifying(b), batch, 1, unknown=0.0)
            reaching = min(float(width), accepted + 1.0)
        raise AssertionError("unreachable")

    # -- the Policy contract ------------------------------------------------------------------------------------
    def choose(self, info: StepInfo):
        self.step_lags = list(info.level_lags or [0] * self.levels)
        costs = {o: self.predict(*o, batch=info.batch_size, lags=self.step_lags) for o in self.options}
        levels, width = min(self.options, key=costs.get)
        if self.rng.random() < self.explore:
            bound = costs[(levels, width)] * (1 + self.explore_margin)
            levels, width = self.rng.choice([o for o in self.options if costs[o] <= bound])
        self.probes.wait() if width == 0 else self.probes.used()
        self.probing = width == 0 and self.probes.due()
        if self.probing:
            levels, width = min(self.options[:-1], key=costs.get)
            self.probes.used()
        if self.length_policy is not None:
            width = self.length_policy.choose(info)
        self.current = (levels, width)
        self.history.append((info.batch_size, levels, width if isinstance(width, int) else max(width)))
        return Plan(width, levels or None)          # target-only steps leave the chain as it is

    def prefilled(self, tokens: int, seconds: float) -> None:
        if self._own is not None:      # bounds each level's catch-up before one is measured (else the length policy's)
            self._own.observe_prefill(tokens, seconds)
        if self.length_policy is not None:
            self.length_policy.prefilled(tokens, seconds)

    def observe(self, record: StepRecord):
        if self.length_policy is not None:
            self.length_policy.observe(record)
        telemetry, batch = record.telemetry or {}, record.batch_size
        stats = telemetry.get("levels") or []      # none when nothing was proposed (target-only, or a fallback)
        for level, s in enumerate(stats):
            if s["draft_tokens"]:
                per_row = s["draft_tokens"] / batch             # positions: one draft pass covers every row
                self._timing(_drafting(level), level, batch, s["draft_seconds"], per_row)
        first = next((level for level, s in enumerate(stats) if s["draft_calls"]), None)   # who drafted
        members = [] if first is None else [first] + [m for m in telemetry["members"] if m > first]
        if members and sum(record.gammas):
            self._update(self.fill, first, stats[first]["draft_tokens"] / sum(record.gammas))
            self._update(self.span, (tuple(members), batch), max(record.drafted) / max(record.gammas))
        for a, b in zip(members, members[1:]):
            s = stats[b]
            if s["calls"]:
                self._timing(_verifying(b), b, batch, s["seconds"] / s["calls"], 1)
            if s["tried"]:      # alpha = P(accept | reached): accepted over positions decided, not over drafted
                self._count(a, b, s["accepted"], s["tried"])
            if s["tv"]:
                self._update(self.sim, (a, b), 1.0 - sum(s["tv"]) / len(s["tv"]))
        if self.probing and members:
            self._back_off(record, members)
        tried = sum(a + (a < d) for a, d in zip(record.accepted, record.drafted))
        if sum(record.drafted) and tried:
            self._count(members[-1], "T", sum(record.accepted), tried)
        # The target's verification and the step's host work (drafting, with its catch-up, is the levels' own),
        # unless the length policy writes them.
        if self._own is not None:
            self._own.observe_verify(record.held or batch, max(record.drafted, default=0) + 1, record.verify_time,
                                     record.path)
            self._own.observe_host(batch, max(0.0, record.step_time - record.draft_time - record.verify_time))

    def _back_off(self, record: StepRecord, members: list[int]) -> None:
        """Did the probe beat a target-only step per committed token? Its catch-up is not held against it (it is
        paid once per switch, and charged as such in `predict`)."""
        batch = record.batch_size
        catch_up = self._catch_up(members, batch, self.step_lags)
        per_token = max(0.0, record.step_time - catch_up) / (sum(record.committed) / max(len(record.committed), 1))
        lost = per_token > self._target_time(batch, 0)
        self.probes.result(won=not lost)

    def _catch_up(self, members, batch: int, lags) -> float:
        """Seconds the members need to catch up on what was committed while they sat out."""
        return sum(self.cost.catchup_time(_drafting(m), batch, _behind(lags, m)) for m in members
                   if _behind(lags, m))

    def _timing(self, source: str, level, batch, seconds, units) -> None:
        """A level's drafting (`units` tokens per row) or verification call into the step-cost model, or, on a step
        where the level first had to catch up, what the step took beyond the usual as its catch-up cost, so d_i
        and v_j stay clean."""
        behind = _behind(self.step_lags, level)
        if not behind:
            self.cost.observe_draft(source, batch, units, seconds)
        elif self.cost.knows(source, batch):
            extra = max(0.0, seconds - self.cost.draft_time(source, batch, units))
            self.cost.observe_catchup(_drafting(level), batch, behind, extra)

    def _count(self, a, b, accepted, tried) -> None:
        """alpha is a ratio of moving averages (EMA accepted / EMA decided): an EMA of per-step ratios is biased low
        when runs are long (a step that stops after 1 of 8 reads 0.5, one that stops at once reads 0)."""
        old_accepted, old_tried = self.alpha.get((a, b), (None, None))
        self.alpha[(a, b)] = [ema(old_accepted, accepted, self.ema), ema(old_tried, tried, self.ema)]

    def _update(self, table, key, value):
        table[key] = ema(table.get(key), value, self.ema)

    # The tables are keyed by tuples; JSON has lists, so keys are written as lists and read back as tuples.
    _TABLES = ("alpha", "sim", "span")

    def state_dict(self):
        tables = {name: [[to_json_lists(k), v] for k, v in getattr(self, name).items()] for name in self._TABLES}
        return {**tables, "fill": [[k, v] for k, v in self.fill.items()], "cost": self.cost.state_dict(),
                "current": to_json_lists(self.current),
                "idle": self.probes.idle, "probe_gap": self.probes.gap, "rng": to_json_lists(self.rng.getstate())}

    def load_state_dict(self, state):
        self.reset()
        for name in self._TABLES:
            setattr(self, name, {from_json_lists(k): v for k, v in state[name]})
        self.fill = {k: v for k, v in state["fill"]}
        self.cost.load_state_dict(state["cost"])
        self.current = from_json_lists(state["current"])
        self.probes.idle, self.probes.gap = state["idle"], state["probe_gap"]
        self.rng.setstate(from_json_lists(state["rng"]))


def _behind(lags, level) -> int:
    return max(0, lags[level] - USUAL_LAG) if lags and level < len(lags) else 0


def _drafting(level) -> str:
    return f"level{level}"


def _verifying(level) -> str:
    return f"level{level}-verify"


def _at(table: dict, level, batch: int, default: float) -> float:
    """table[(level, batch)], else the entry for the nearest batch size seen for that level, else default."""
    if (level, batch) in table:
        return table[(level, batch)]
    seen = [b for (lv, b) in table if lv == level]
    if not seen:
        return default
    nearest = min(seen, key=lambda b: abs(math.log(b / batch)))
    return table[(level, nearest)]
