"""Adaptive: the library's default policy. A cost model picks the draft width from the acceptance it counts and the
step times it measures, and switches speculation off, with probes that back off, where it does not pay.

Per step, for the active batch: E_b(s), the tokens row b commits at width s, from per-position acceptance counts kept
per row and per burst state (last step plain, rejected, or fully accepted); T(B, s), the step time at batch size B,
measured per batch-size bucket and asked width (a line fit, a profiled `LatencyTable` or a cautious prior until
then); the width s* = argmax N(s) / T(B, s), where N(s) sums E_b(s) for an open batch (serving) and, for a closed
batch (one generate call, which ends with its slowest row), is the batch's remaining tokens over the steps its
slowest row still needs (`batch_tokens`). A draft model's catch-up after plain steps is charged to the widths that
would pay it; hopeless rows get width 0; spare rows keep the batch shape the hardware runs fastest. With
`trees=True`, a width s* > 0 may become a token tree of 2x or 3x as many nodes at depth s* (`TreeShapes`: measured
goodput per batch-size bucket, held to plain decoding's).
docs/policies.md explains each rule and the measurements behind it.
"""

from __future__ import annotations

import json
import math
import numbers
import random
from pathlib import Path

import torch

from ..running_estimates import Calibration, StopRule, ema
from ..metrics import StepRecord
from .cost import StepCost
from .estimators import LatencyTable, ProbeBackoff, TreeShapes, bucket, cached_profile, decay_counts, reach, state_key
from .policy import MAX_WIDTH, USUAL_LAG, Plan, Policy, StepInfo, check_int, from_json_lists, to_json_lists

PLAIN, MISSED, BURST, STATES = 0, 1, 2, 3   # a row's state after its last step (docs/policies.md, rule 1)


# A probe whose catch-up's share of plain time cannot fall to the budget is due near its floor when that floor is at
# most this many budgets (`Adaptive._probe_due`).
FLOOR_BUDGETS = 5

# The largest batch a vLLM schedule is exported for (the schedule has one entry per power of two up to it).
MAX_EXPORT_BATCH = 1 << 16


class Adaptive(Policy):
    def __init__(self, max_gamma: int = 8, latency: LatencyTable | None = None, explore: float = 0.05,
                 explore_margin: float = 0.05, probe_every: int = 16, max_probe_gap: int = 256, horizon: int = 128,
                 row_floor: float = 0.1, shrink: float = 4.0, decay: float = 0.98, ema: float = 0.1, seed: int = 0,
                 baseline_steps: int = 2, probe_budget: float = 0.01, shape_margin: float = 0.05,
                 closed_batches: bool = True, trees: bool | tuple = False, recheck_every: int = 64,
                 max_recheck_gap: int = 1024, stop_rule: bool = False):
        self.max_gamma = check_int("Adaptive(max_gamma)", max_gamma, 1, MAX_WIDTH)
        for name, value, low, high in (("explore", explore, 0, 1), ("explore_margin", explore_margin, 0, math.inf),
                                       ("row_floor", row_floor, 0, 1), ("shrink", shrink, 0, math.inf),
                                       ("decay", decay, 0, 1), ("ema", ema, 0, 1),
                                       ("probe_budget", probe_budget, 0, math.inf),
                                       ("shape_margin", shape_margin, 0, math.inf)):
            _check_real(f"Adaptive({name})", value, low, high)
        for name, value, low in (("probe_every", probe_every, 1), ("max_probe_gap", max_probe_gap, 1),
                                 ("horizon", horizon, 1), ("baseline_steps", baseline_steps, 0)):
            check_int(f"Adaptive({name})", value, low)
        if not (0 <= explore <= 1 and explore_margin >= 0 and probe_every >= 1 and max_probe_gap >= probe_every):
            raise ValueError("Adaptive needs 0 <= explore <= 1, explore_margin >= 0 and 1 <= probe_every <= "
                             f"max_probe_gap; got {explore}, {explore_margin}, {probe_every}, {max_probe_gap}.")
        if not (horizon >= 1 and probe_budget >= 0):
            raise ValueError(f"Adaptive needs horizon >= 1 (steps a catch-up is spread over) and probe_budget >= 0 "
                             f"(a fraction of plain time); got {horizon}, {probe_budget}.")
        self.table, self.explore, self.explore_margin = latency, explore, explore_margin
        self.probe_every, self.max_probe_gap, self.horizon = probe_every, max_probe_gap, horizon
        self.row_floor, self.shrink, self.decay, self.ema, self.seed = row_floor, shrink, decay, ema, seed
        if not shape_margin >= 0:
            raise ValueError(f"Adaptive needs shape_margin >= 0 (a fraction of a forward's time); got {shape_margin}.")
        self.baseline_steps, self.probe_budget, self.shape_margin = baseline_steps, probe_budget, shape_margin
        check_int("Adaptive(recheck_every)", recheck_every, 1)
        if not check_int("Adaptive(max_recheck_gap)", max_recheck_gap, 1) >= recheck_every:
            raise ValueError(f"Adaptive needs recheck_every <= max_recheck_gap (drafting steps between plain steps "
                             f"that re-measure plain decoding); got {recheck_every}, {max_recheck_gap}.")
        self.recheck_every, self.max_recheck_gap = recheck_every, max_recheck_gap
        if not isinstance(closed_batches, bool):
            raise ValueError(f"Adaptive(closed_batches) must be True or False, got {closed_batches!r}.")
        self.closed_batches = closed_batches
        if not isinstance(stop_rule, bool):
            raise ValueError(f"Adaptive(stop_rule) must be True or False, got {stop_rule!r}.")
        # stop_rule: a draft model that reports its confidence stops each row inside the step where one more token
        # stops paying (a StopRule from this policy's cost model and its calibration of the draft's confidence).
        self.stop_rule = stop_rule
        trees = tuple(trees) if isinstance(trees, list) else trees     # as saved in JSON
        if not isinstance(trees, (bool, tuple)):
            raise ValueError(f"Adaptive(trees) must be True, False or a tuple of tree factors, got {trees!r}.")
        self.tree_factors = (1, 2, 3) if trees is True else (tuple(trees) if trees else None)
        self.trees = self.tree_factors is not None    # its plans may have a depth (spec_adapt.tree)
        if self.trees:
            TreeShapes(self.tree_factors)             # validates the factors
        self.reset()

    # -- state ------------------------------------------------------------------------------------------------------
    def reset(self):
        size = self.max_gamma
        # Acceptance counts per draft position, decayed once per row-observation: pooled [S] and per row [rows, S]
        # (rows of the current call; `begin` clears them). Tensors, so a decision at B = 64 is a few vector ops.
        # The state axis: the row's last step was 0 plain (or none), 1 drafted with a rejection, 2 all accepted.
        self.tried, self.accepted = torch.ones(STATES, size), torch.full((STATES, size), 0.5)
        # What is left of that first observation (it decays with the rest): its mean is read as the larger of 0.5 and
        # the rate of the position before (`prior_rates`), so a width no row has reached is not read worse than it is.
        self.prior = torch.ones(STATES, size)
        self.begin(0)
        # What a step costs (verification by rows, tokens fed and path, the draft's time per token, its catch-up,
        # host work): the call's one step-cost model, which this policy writes and the router and the gate read.
        self.cost = StepCost(self.table)
        # (bucket, any row in a burst, width asked; 0: any width) -> EMA widest proposal / width asked
        self.span: dict[tuple, float] = {}
        self.rng = random.Random(self.seed)
        self.probes, self.steps = ProbeBackoff(self.probe_every, self.max_probe_gap), 0
        # While the policy drafts, plain steps are not measured; a plain step now and then keeps T(B, 0) current.
        self.rechecks = ProbeBackoff(self.recheck_every, self.max_recheck_gap)
        self._pending: dict | None = None
        self.tree_shapes = TreeShapes(self.tree_factors) if self.trees else None
        self.calibration = Calibration() if self.stop_rule else None    # draft confidence -> acceptance
        self.goodput: dict[int, float] = {}     # bucket -> EMA tokens / s of the drafting steps the rule stopped

    def begin(self, batch_size):
        self.row_tried = torch.zeros(batch_size, STATES, self.max_gamma)      # [rows, state, S]
        self.row_accepted = torch.zeros(batch_size, STATES, self.max_gamma)
        self.row_state = torch.zeros(batch_size, dtype=torch.long)
        # A row's last step, where the draft model's drafts were all accepted: their number (else 0) and the state it
        # was chosen in, so the next step's hindsight on the position after them counts there (`_hindsight`).
        self.row_full = torch.zeros(batch_size, dtype=torch.long)
        self.row_chosen = torch.zeros(batch_size, dtype=torch.long)
        self._refresh()

    def admit(self, rows) -> None:
        """Serving: these slots hold new requests; their rows start from the pooled estimates again."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        self._extend_rows(rows)
        self.row_tried[rows], self.row_accepted[rows], self.row_state[rows] = 0.0, 0.0, PLAIN
        self.row_full[rows] = 0
        self._refresh()

    def _extend_rows(self, rows: torch.Tensor) -> None:
        need = int(rows.max()) + 1 if len(rows) else 0
        have = self.row_tried.shape[0]
        if need > have:
            more = max(need, 2 * have) - have
            self.row_tried = torch.cat([self.row_tried, torch.zeros(more, STATES, self.max_gamma)])
            self.row_accepted = torch.cat([self.row_accepted, torch.zeros(more, STATES, self.max_gamma)])
            self.row_state = torch.cat([self.row_state, torch.zeros(more, dtype=torch.long)])
            self.row_full = torch.cat([self.row_full, torch.zeros(more, dtype=torch.long)])
            self.row_chosen = torch.cat([self.row_chosen, torch.zeros(more, dtype=torch.long)])
            self._refresh()

    # -- the model ---------------------------------------------------------------------------------------------------
    def step_time(self, batch: int, width: int, burst: bool = False) -> float:
        """Predicted seconds of a step at batch size `batch` when `width` drafts are asked (catch-up excluded), from
        the step-cost model: the verification of the widest row's proposal (a batch asked `width` proposes
        `width` x span at its widest), its drafting and the host work."""
        if width == 0:
            return self.cost.step_time(batch, 1)
        key = bucket(batch)
        widest = width * self.span.get((key, burst, width), self.span.get((key, burst, 0), 1.0))
        return self.cost.step_time(batch, 1 + widest, {"model": widest})

    def catchup_time(self, batch: int, lag: int, unknown: float = 0.0) -> float:
        """Seconds a catch-up of `lag` tokens adds to a step at this batch size (the step-cost model's; `unknown`
        before one is seen and with no profile)."""
        return self.cost.catchup_time("model", batch, lag, unknown)

    def expected(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """E[committed | s] for s = 0..max_gamma: [S+1] for a request not yet seen, or [B, S+1] for these rows.
        Row values are recomputed when counts change (`observe`), so a decision only gathers them."""
        if rows is None:
            return _tokens(prior_rates(self.tried.sum(0), self.accepted.sum(0), self.prior.sum(0))[None])[0]
        self._extend_rows(rows)
        return self.row_expected[rows]

    def _refresh(self) -> None:
        """Every row's E[committed | s], shrunk all the way down: everything seen -> the row's state -> the row."""
        self._stale = False
        # One scan over every state's counts and their sum: [STATES + 1, S], the last row everything seen.
        rates = prior_rates(*(torch.cat([x, x.sum(0, keepdim=True)]) for x in (self.tried, self.accepted, self.prior)))
        pooled, overall = rates[:STATES], rates[STATES]
        pooled = (pooled * self.tried + self.shrink * overall) / (self.tried + self.shrink)
        index = torch.arange(self.row_state.shape[0])
        t, a = self.row_tried[index, self.row_state], self.row_accepted[index, self.row_state]   # [R, S]
        prior = pooled[self.row_state]
        # A row with no counts of its own in its state reads the pooled rates (with shrink = 0 the row's own counts
        # alone decide, and a fresh row has none: 0 / 0).
        self.row_expected = _tokens(torch.where(t + self.shrink > 0,
                                                (a + self.shrink * prior) / (t + self.shrink).clamp(min=1e-12), prior))

    def predict(self, batch: int, rows: torch.Tensor | None = None, lag: int = 0, left: int | None = None,
                remaining: torch.Tensor | None = None) -> list[float]:
        """Predicted goodput (tokens / s) of every width 0..max_gamma, hopeless rows (gain < row_floor) counted at
        one token. `left`: the most tokens a row may still generate (bounds the steps a catch-up is spread over).
        `remaining` [B]: the batch is closed and these are its rows' token budgets (see `batch_tokens`)."""
        expected = self.expected(rows) if rows is not None else self.expected()[None].expand(batch, -1)
        tokens = batch_tokens(torch.where(expected >= 1 + self.row_floor, expected, 1.0), remaining)
        key, burst = bucket(batch), self._burst(rows)
        catchup = self.catchup_time(batch, lag) if lag > USUAL_LAG else 0.0
        out = []
        for s, n in enumerate(tokens):
            steps = self.horizon if left is None else min(self.horizon, max(1.0, left * batch / n))
            out.append(n / (self.step_time(batch, s, burst) + (catchup / steps if s else 0.0)))
        return out

    def _probe_due(self, batch: int, lag: int) -> bool:
        """After `probe_gap` plain steps, and once a catch-up the probe must pay is within `probe_budget` of the
        plain time since the last probe."""
        if not self.probes.due():
            return False
        if lag <= USUAL_LAG:
            return True
        # Never measured: the step-cost model's bound (what the target's own prompt forwards took), or with none the
        # worst a draft smaller than the target can cost, one plain step per lag token (a cold probe at a large batch
        # catches every row's prompt up at once, a cost a short call never earns back).
        plain = self.step_time(batch, 0)
        catchup = self.catchup_time(batch, lag, unknown=lag * plain)
        spent = self.probes.idle * plain
        if catchup <= self.probe_budget * spent:
            return True
        # The lag grows by a token per plain step, so the catch-up's share of the plain time since the last probe
        # falls towards what one more lag token adds over a plain step (its floor), never lower: where that floor is
        # above the budget, waiting never brings a probe within it, and one unlucky drafting step kept a draft model
        # off for the rest of the call (the pair's 0.5B catches up at about 0.02 of a plain step per token; the budget
        # is 0.01). Such a probe is due once its share is within twice that floor, while the floor is a small part of a
        # plain step (at most FLOOR_BUDGETS x probe_budget): a draft that catches up as slowly as its target decodes
        # is still never probed through a whole prompt.
        floor = (self.catchup_time(batch, lag + 1, unknown=(lag + 1) * plain) - catchup) / max(plain, 1e-12)
        return floor <= FLOOR_BUDGETS * self.probe_budget and catchup <= 2 * floor * spent

    def _burst(self, rows) -> bool:
        return bool((self.row_state[rows] == BURST).any()) if rows is not None else False

    # -- the Policy contract -----------------------------------------------------------------------------------------
    def choose(self, info: StepInfo):
        batch, rows = info.batch_size, info.rows.cpu()
        lag = int(info.draft_lag.max()) if info.draft_lag is not None and len(info.draft_lag) else 0
        closed = info.closed and self.closed_batches and len(info.remaining)
        remaining = info.remaining.cpu() if closed else None
        values = self.predict(batch, rows, lag, int(info.remaining.max()) if len(info.remaining) else None, remaining)
        width = max(range(len(values)), key=values.__getitem__)
        probing, recheck = False, None     # recheck: a plain step re-measuring T(B, 0), and the goodput it must beat
        if self.cost.samples(batch) < self.baseline_steps:
            # Measure this bucket's plain step first: extrapolated from drafting steps, T(B, 0) can come out high
            # enough at large batches to keep the draft on where plain decoding is faster.
            width = 0
        elif width == 0:
            self.rechecks.used()
            self.probes.wait()
            if self._probe_due(batch, lag):
                width, probing = max(range(1, len(values)), key=values.__getitem__), True
                self.probes.used()
        else:
            self.probes.used()
            self.rechecks.wait()
            if self.rechecks.due() and lag <= USUAL_LAG:
                recheck, width = values[width], 0      # the goodput plain decoding has to beat
            elif self.rng.random() < self.explore:
                near = [s for s in (width - 1, width + 1)
                        if 0 <= s < len(values) and values[s] >= (1 - self.explore_margin) * values[width]]
                width = self.rng.choice(near) if near else width
        self._pending = {"width": width, "lag": lag, "probing": probing, "burst": self._burst(rows), "factor": 1,
                         "recheck": recheck, "stop": False}
        if width == 0 or probing or batch == 1 or self.steps % self.probe_every == 0:
            return self._stopping(self._shaped(width, batch), values, batch)
        hopeless = (self.row_expected[rows, width] < 1 + self.row_floor) & (self.row_tried[rows, :, 0].sum(1) > 0)
        gammas = torch.where(hopeless, 0, width) if bool(hopeless.any()) else width
        return self._stopping(self._shaped(gammas, batch), values, batch)

    @property
    def confident(self) -> bool:
        """Whether the drafter has reported its confidence of tokens it drafted: it stops rows by the rule."""
        return self.calibration is not None and self.calibration.seen

    def _stopping(self, gammas, values, batch: int):
        """With stop_rule, a chain plan of width s > 0 carries where rows stop within it: a row's draft token after
        its first pays when its survival beats G x dT / B, the tokens per row that the step's marginal time dT
        commits at goodput G (docs/policies.md, rule 10). dT is the line fit's time per drafted token (T(B, s) -
        T(B, s - 1) until it is ready); G the goodput the rule's own steps reached (the prediction at s until one
        ran), so a threshold set too high lowers G and with it the next threshold. Only for a drafter that has
        reported its confidence, and then the rule alone ends a row's chain: the plan's width becomes max_gamma, so
        a long run of agreement is not cut at a width chosen before drafting."""
        pending = self._pending
        width = pending["width"]
        if not (self.stop_rule and self.confident) or width == 0 or isinstance(gammas, Plan):
            return gammas
        key, burst = bucket(batch), pending["burst"]
        marginal = max(0.0, self.step_time(batch, width, burst) - self.step_time(batch, width - 1, burst))
        threshold = min(1.0, max(0.0, self.goodput.get(key, values[width]) * marginal / batch))
        pending["stop"] = True
        gammas = torch.where(torch.as_tensor(gammas) > 0, self.max_gamma, 0)
        return Plan(gammas, stop=StopRule(threshold, self.calibration))

    def _shaped(self, gammas, batch: int):
        """With trees: the chain's widths, or a tree of `factor` times as many nodes at the chain's depth, a pooled
        budget when the batch has several rows (TreeShapes learns which factor pays per batch size). A tree runs only
        while it measures faster than plain decoding: tree steps do not feed the chain's model, so the chain keeps
        the say over whether to draft at all (a tree not held to plain's goodput could draft every step of a batch
        size where plain decoding is faster)."""
        pending = self._pending
        if self.tree_shapes is None or pending["width"] == 0 or pending["probing"] or pending["lag"] > USUAL_LAG:
            return gammas
        floor = 1.0 / self.step_time(batch, 0) if self.cost.samples(batch) >= self.baseline_steps else None
        factor = self.tree_shapes.pick(batch, floor)
        pending["factor"] = factor
        if factor == 1:
            return gammas
        return Plan(gammas * factor, depth=pending["width"], pooled=batch > 1)

    def observe(self, record: StepRecord):
        self._hindsight(record)
        self._observe(record)
        if self._stale:           # hindsight counted and the step itself did not refresh
            self._refresh()

    def _observe(self, record: StepRecord):
        pending, self._pending = self._pending, None
        self.steps += 1
        widest = max(record.drafted, default=0)
        free = record.free is not None and any(f and d for f, d in zip(record.free, record.drafted))
        factor = pending.get("factor", 1) if pending is not None else 1
        if pending is None or free or factor != 1:
            # A verification is a verification whoever drafted; the rest of the step is the chain model's only when
            # the policy's own width drafted it (not a free source's rows, not a tree).
            self.cost.observe_verify(record.held or record.batch_size, widest + 1, record.verify_time, record.path)
        if pending is None:
            return
        if free:
            # Rows drafted by a model-free source: the step's time is not a draft model's width, and their counts
            # are not the model's acceptance. The model's rows still count.
            model = _model_rows(record)
            if model.rows:
                self._count(model)
            for source, (tokens, seconds) in ((record.telemetry or {}).get("draft_seconds") or {}).items():
                self.cost.observe_draft(source, record.batch_size, tokens, seconds)   # the drafter timed its source
            return
        if pending["width"] and self.tree_shapes is not None:
            self.tree_shapes.observe(record.batch_size, factor, sum(record.committed) / record.batch_size,
                                     record.step_time)
        if factor != 1:                 # a tree step: its counts and times are not the chain's model
            return
        batch, width, key, burst = record.batch_size, pending["width"], bucket(record.batch_size), pending["burst"]
        ruled = pending.get("stop", False)
        if self.calibration is not None and record.confidence is not None:
            self.calibration.update(record.confidence, record.drafted, record.accepted)
        self._count(record, ruled=ruled)
        if ruled:       # the rule chose the depth: the step's time is that of the widest chain drafted, not asked
            width = widest
        self._measure(record, key, pending["lag"], ruled)
        if width and not ruled:
            for at in ((key, burst, 0), (key, burst, width)):
                self.span[at] = ema(self.span.get(at), widest / width, self.ema)
        if pending.get("recheck") is not None:
            # Plain decoding measured again while drafting: the gap to the next recheck doubles when it lost; when it
            # won, the estimate is stale, and plain runs again at the next drafting choice until it loses or T(B, 0)
            # has moved enough for the choice itself to be plain.
            won = sum(record.committed) / max(record.step_time, 1e-9) > pending["recheck"]
            self.rechecks.result(won)
            if won:
                self.rechecks.again()
        if pending["probing"]:
            # Judged with its catch-up: a probe whose draft first had to catch up on a long lag (a whole prompt,
            # for a draft model the call has not run yet) has to pay for that too, or it keeps being retried.
            lost = record.step_time / max(sum(record.committed) / batch, 1e-9) > self.step_time(batch, 0)
            self.probes.result(won=not lost)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """What the target's prompt forwards cost bounds a draft's catch-up before one is measured
        (`StepCost.catchup_time`)."""
        self.cost.observe_prefill(tokens, seconds)

    def _measure(self, record: StepRecord, key: int, lag: int, ruled: bool) -> None:
        """A step's time into the step-cost model: its verification, its drafting, its host work; on a step whose
        draft first caught up on `lag` tokens, the drafting beyond the usual is the catch-up's cost."""
        batch, seconds, widest = record.batch_size, record.step_time, max(record.drafted, default=0)
        drafting = record.draft_time
        if lag > USUAL_LAG and widest:
            usual = self.cost.draft_time("model", batch, widest)
            self.cost.observe_catchup("model", batch, lag, max(0.0, drafting - usual))
            drafting = min(drafting, usual)
        self.cost.observe_step(batch, widest + 1, seconds - record.draft_time + drafting, record.verify_time,
                               {"model": (widest, drafting)} if widest else None, record.held, record.path)
        if ruled and widest:
            self.goodput[key] = ema(self.goodput.get(key), sum(record.committed) / max(seconds, 1e-9), self.ema)

    def allows_free(self, batch_size: int) -> bool:
        """Model-free drafts only once this batch size's plain step is measured: the goodput every drafting choice is
        held to."""
        return self.cost.samples(batch_size) >= self.baseline_steps

    def batch_rows(self, live: int, held: int) -> int:
        """Rows the target's batch keeps when rows finish (docs/policies.md, rule 9): the size in [live, held] whose
        measured forward is fastest for the mix of proposal widths this batch runs, the smallest within shape_margin
        of the best."""
        # Each width weighted by how often the batch at its current size ran it: which size runs faster can flip with
        # the width (more rows may win at one token and lose at several), so a batch that mostly drafts wide compacts.
        weights = {fed: samples for (path, size, fed), (_, samples) in self.cost.verify.items()
                   if size == held and path == "full"}
        ratios = {live: 1.0}
        for rows in range(live + 1, held + 1):
            ratio = self._shape_ratio(rows, live, weights)
            if ratio is not None:
                ratios[rows] = ratio
        best = min(ratios.values())
        return min(rows for rows, ratio in ratios.items() if ratio <= best * (1 + self.shape_margin))

    def _shape_ratio(self, rows: int, live: int, weights: dict) -> float | None:
        """Weighted T(rows) / T(live) over the widths both sizes ran twice or more; None if there is none."""
        mine = theirs = 0.0
        for fed, weight in weights.items():
            a, b = self.cost.exact(rows, fed), self.cost.exact(live, fed)
            if a is not None and b is not None and a[1] >= 2 and b[1] >= 2:
                mine, theirs = mine + weight * a[0], theirs + weight * b[0]
        return mine / theirs if theirs > 0 else None

    def _count(self, record: StepRecord, ruled: bool = False) -> None:
        """Position i + 1 was reached by a row that asked for more than i drafts and had i accepted; a hit if it
        was accepted. Asked, not drafted: a drafter's empty proposal is a miss, so its fill is in the rates. Under a
        stop rule (`ruled`), drafted: the positions the rule declined were not tried."""
        gammas, accepted = torch.tensor(record.gammas), torch.tensor(record.accepted)
        drafted, rows = torch.tensor(record.drafted), torch.tensor(record.rows)
        self._extend_rows(rows)
        state = self.row_state[rows]                                                     # [B] as chosen
        reached, hits = reach(drafted if ruled else gammas, accepted, self.max_gamma)    # [B, S]
        self._add_counts(rows, state, reached, hits)
        full = (accepted == drafted) & (drafted > 0)
        self.row_state[rows] = torch.where(gammas > 0, torch.where(full, BURST, MISSED), PLAIN)
        # Hindsight can judge the next position only where no asked position is left unjudged (a drafter's fill
        # short of the width asked has counted the rest as misses already), and not past a stop rule's cut: the rule
        # stopped the row where the draft's confidence fell, and counting the position it declined would read the
        # rule's own selection as the draft's acceptance there.
        self.row_full[rows] = torch.where(full & (drafted == gammas), drafted, 0) if not ruled else 0
        self.row_chosen[rows] = state
        self._refresh()

    def _add_counts(self, rows, state, reached, hits) -> None:
        """Rows' observations [n, S] (positions reached, hits there), each in its state [n]: into the pooled counts
        (decayed once per row that reached a position) and the rows' own (a row is one observation)."""
        pooled = torch.zeros(STATES, self.max_gamma)                                     # [STATES, S]
        reached_by_state = pooled.index_add(0, state, reached)
        self.tried, self.accepted = decay_counts(self.tried, self.accepted, reached_by_state,
                                                 pooled.index_add(0, state, hits), self.decay)
        self.prior = self.prior * self.decay ** reached_by_state
        t, a = self.row_tried[rows, state], self.row_accepted[rows, state]
        row_t, row_a = decay_counts(t, a, 1, hits, self.decay)
        own = reached > 0
        self.row_tried[rows, state] = torch.where(own, row_t, t)
        self.row_accepted[rows, state] = torch.where(own, row_a, a)

    def _hindsight(self, record: StepRecord) -> None:
        """The draft model's hindsight on the position after a fully accepted chain: drafting this step, it first reads
        the last token it drafted and the target's token after it, and its own next token there says whether a draft
        one longer would have been accepted (telemetry "hindsight", per row 1 or 0; -1 not known). One observation
        at that position, in the state the accepted step was chosen in. A width the policy keeps is otherwise never
        measured one position further: a state whose next position once read low stayed at its width through long
        runs of full acceptance (width 1 for thirty steps on ShareGPT)."""
        rows = torch.tensor(record.rows, dtype=torch.long)
        self._extend_rows(rows)
        seen = (record.telemetry or {}).get("hindsight")
        width, chosen = self.row_full[rows], self.row_chosen[rows]
        self.row_full[rows] = 0              # the next step's hindsight is about this step's drafts, if any
        if seen is None:
            return
        seen = torch.as_tensor(seen).cpu().long()      # checked where the proposal entered (`check_proposal`)
        known = (seen >= 0) & (width > 0) & (width < self.max_gamma)
        if not bool(known.any()):
            return
        reached = torch.nn.functional.one_hot(width[known], self.max_gamma).float()      # [n, S]: position width + 1
        self._add_counts(rows[known], chosen[known], reached, reached * seen[known, None].float())
        self._stale = True      # `observe` refreshes the rates once, after the step's own counts

    # -- carrying what was learned over ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "config": {"max_gamma": self.max_gamma, "explore": self.explore, "explore_margin": self.explore_margin,
                       "probe_every": self.probe_every, "max_probe_gap": self.max_probe_gap,
                       "horizon": self.horizon, "row_floor": self.row_floor, "shrink": self.shrink,
                       "decay": self.decay, "ema": self.ema, "seed": self.seed,
                       "baseline_steps": self.baseline_steps, "probe_budget": self.probe_budget,
                       "shape_margin": self.shape_margin, "closed_batches": self.closed_batches,
                       "trees": list(self.tree_factors) if self.trees else False,
                       "recheck_every": self.recheck_every, "max_recheck_gap": self.max_recheck_gap,
                       "stop_rule": self.stop_rule},
            "tree_shapes": self.tree_shapes.state_dict() if self.tree_shapes is not None else None,
            "pooled": {"tried": self.tried.tolist(), "accepted": self.accepted.tolist(), "prior": self.prior.tolist()},
            "cost": self.cost.state_dict(),
            "span": [[list(k), v] for k, v in self.span.items()],
            "calibration": self.calibration.state_dict() if self.calibration is not None else None,
            "goodput": [[k, v] for k, v in self.goodput.items()],
            "row_states": [self.row_tried.tolist(), self.row_accepted.tolist(), self.row_state.tolist()],
            "probe_gap": self.probes.gap, "idle": self.probes.idle, "steps": self.steps,
            "recheck_gap": self.rechecks.gap, "recheck_idle": self.rechecks.idle,
            "rng": to_json_lists(self.rng.getstate()),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved. The whole state is checked first (keys, shapes, finite non-negative counts
        and times); a state that fails leaves this policy as it was, with an error that names the problem."""
        try:
            parsed = self._parse_state(state)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, OverflowError, AttributeError) as exc:
            problem = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"Not a valid Adaptive state ({problem}): load a file written by Adaptive.save / "
                             "state_dict of an Adaptive with the same max_gamma.") from exc
        probes, rechecks = parsed.pop("_probes"), parsed.pop("_rechecks")
        self.reset()
        for name, value in parsed.items():
            setattr(self, name, value)
        # Call-local, not saved: no loaded row's last step is known.
        self.row_full, self.row_chosen = torch.zeros_like(self.row_state), torch.zeros_like(self.row_state)
        self.probes.gap, self.probes.idle, self.steps = probes
        self.rechecks.gap, self.rechecks.idle = rechecks
        self._refresh()

    def _parse_state(self, state: dict) -> dict:
        saved = state.get("config", {}).get("max_gamma", self.max_gamma)
        if saved != self.max_gamma:
            raise ValueError(f"saved with max_gamma={saved}, this policy has max_gamma={self.max_gamma}; build "
                             f"Adaptive(max_gamma={saved}) or use Adaptive.load(path)")
        size = (STATES, self.max_gamma)
        tried, accepted = (_counts(state["pooled"][k], size, f"pooled {k}") for k in ("tried", "accepted"))
        if bool((tried <= 0).any()):
            raise ValueError("pooled tried counts must be positive")
        # A state saved before the prior was kept apart: the untouched first observation where no row has reached
        # the position, none left elsewhere (its 0.5 stays in the counts, as it was read when saved).
        prior = _counts(state["pooled"]["prior"], size, "pooled prior") if "prior" in state["pooled"] else \
            ((tried == 1) & (accepted == 0.5)).float()
        # Counts as `decay_counts` keeps them: the prior is one observation at 0.5 that decays with the rest, so
        # 0.5 x prior <= accepted <= tried - 0.5 x prior, which keeps every rate `prior_rates` reads in [0, 1].
        slack = 1e-4 * tried
        if bool(((prior > 1) | (0.5 * prior > accepted + slack) | (accepted + 0.5 * prior > tried + slack)).any()):
            raise ValueError("pooled counts must hold 0.5 x prior <= accepted <= tried - 0.5 x prior, with a prior "
                             "weight of at most 1 (one first observation at 0.5, decayed with the counts)")
        row_tried, row_accepted, row_state = state["row_states"]
        row_tried = _counts(row_tried, None, "row tried").view(-1, *size)
        row_accepted = _counts(row_accepted, None, "row accepted").view(-1, *size)
        row_state = torch.tensor(row_state, dtype=torch.long)
        if row_state.dim() != 1:
            raise ValueError(f"row states must be a flat list of ints, got shape {tuple(row_state.shape)}")
        out_of_range = bool(((row_state < 0) | (row_state >= STATES)).any())
        if not (len(row_tried) == len(row_accepted) == len(row_state)) or out_of_range:
            raise ValueError("row tables of different lengths, or a row state out of range")
        cost = StepCost(self.table)
        cost.load_state_dict(state["cost"])
        gap, idle, steps = (int(state[k]) for k in ("probe_gap", "idle", "steps"))
        if gap < 1 or idle < 0 or steps < 0:
            raise ValueError(f"probe_gap {gap}, idle {idle} and steps {steps} must be >= 1, >= 0, >= 0")
        rechecks = (int(state.get("recheck_gap", self.recheck_every)), int(state.get("recheck_idle", 0)))
        if rechecks[0] < 1 or rechecks[1] < 0:
            raise ValueError(f"recheck_gap {rechecks[0]} and recheck_idle {rechecks[1]} must be >= 1 and >= 0")
        rng = random.Random()
        rng.setstate(from_json_lists(state["rng"]))
        return {"tried": tried, "accepted": accepted, "prior": prior, "cost": cost,
                "span": {state_key(k, (int, bool, int), "span"): _finite(v, what="span")[0] for k, v in state["span"]},
                "calibration": self._parse_calibration(state.get("calibration")),
                "goodput": {state_key([k], (int,), "goodput")[0]: _times([v, 1], "goodput")[0]
                            for k, v in state.get("goodput", [])},
                "row_tried": row_tried, "row_accepted": row_accepted, "row_state": row_state, "rng": rng,
                "_probes": (gap, idle, steps), "_rechecks": rechecks,
                "tree_shapes": self._parse_trees(state.get("tree_shapes"))}

    def _parse_calibration(self, saved) -> Calibration | None:
        if not self.stop_rule:
            return None
        calibration = Calibration()
        if saved is not None:
            calibration.load_state_dict(saved)
        return calibration

    def _parse_trees(self, saved) -> TreeShapes | None:
        if not self.trees:
            return None
        shapes = TreeShapes(self.tree_factors)
        if saved:
            shapes.load_state_dict(saved)
        return shapes

    def save(self, path) -> None:
        """Write what was learned (and the settings) as JSON, for `Adaptive.load` in another process."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.state_dict()))

    @classmethod
    def load(cls, path, latency: LatencyTable | None = None) -> "Adaptive":
        """An Adaptive from a file `save` wrote; a file that is not one is refused with its name and the problem."""
        try:
            state = json.loads(Path(path).read_text())
            if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
                raise ValueError("expected a JSON object with a 'config' object, as Adaptive.save writes")
            policy = cls(latency=latency, **state["config"])
            policy.load_state_dict(state)
        except (OSError, ValueError, TypeError) as exc:      # json.JSONDecodeError is a ValueError
            raise ValueError(f"{path} is not an Adaptive state: {exc}") from exc
        return policy

    @classmethod
    def for_model(cls, model, draft=None, **kwargs) -> "Adaptive":
        """An Adaptive with the latency table `spec-adapt profile` cached for this model, draft, dtype and device
        (none cached: the step times are learned online from the first steps, as without a table)."""
        return cls(latency=cached_profile(model, draft), **kwargs)

    def to_vllm_schedule(self, max_batch: int = 256) -> list[tuple[int, int, int]]:
        """What was learned as vLLM's per-batch-size schedule: [(batch_lo, batch_hi, k), ...] over batch sizes
        1..max_batch (the width this policy would choose at each power-of-two bucket, runs of equal k merged)."""
        check_int("to_vllm_schedule(max_batch)", max_batch, 1, MAX_EXPORT_BATCH)
        out: list[list[int]] = []
        sizes = [1 << i for i in range(int(math.log2(max_batch)) + 1)]
        for lo in sizes:
            hi = min(2 * lo - 1, max_batch)
            values = self.predict(lo)            # pooled acceptance: a new request's expectation
            k = max(range(len(values)), key=values.__getitem__)
            if out and out[-1][2] == k:
                out[-1][1] = hi
            else:
                out.append([lo, hi, k])
        return [tuple(x) for x in out]

    @property
    def probe_gap(self) -> int:
        """Plain steps before the next probe of speculation (docs/policies.md, rule 6)."""
        return self.probes.gap

    def __repr__(self):
        return f"Adaptive(max_gamma={self.max_gamma})"


def _model_rows(record: StepRecord) -> StepRecord:
    """The record's rows that a model-free source did not draft (the draft model's and plain ones)."""
    keep = [b for b, f in enumerate(record.free) if not f]
    pick = lambda values: [values[b] for b in keep]     # noqa: E731
    return StepRecord(len(keep), pick(record.rows), pick(record.gammas), pick(record.drafted), pick(record.accepted),
                      pick(record.committed), record.step_time, record.draft_time, record.verify_time)


def batch_tokens(expected: torch.Tensor, remaining: torch.Tensor | None = None) -> list[float]:
    """What a step at each width is worth to the batch, in tokens, from E_b(s) [B, S+1].

    Open batch (remaining None): the sum over rows, its throughput. Closed batch (one generate call, `remaining` [B]
    the rows' token budgets): it ends with its slowest row, so a width is worth the batch's remaining tokens over the
    steps its slowest row still needs, sum_b r_b / max_b (r_b / E_b(s)). Tokens a step gives a row that finishes
    early anyway do not shorten the call: drafting that commits more tokens per step on the fast rows can leave the
    call as many steps long as plain decoding, each step dearer. At B = 1, and for rows with equal budgets and
    rates, both are the same."""
    if remaining is None:
        return expected.sum(dim=0).tolist()
    budget = remaining.clamp(min=1).to(expected.dtype)[:, None]
    return (budget.sum() / (budget / expected).max(dim=0).values).tolist()


def prior_rates(tried: torch.Tensor, accepted: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """Acceptance rates [..., S] from decayed counts that hold `prior` [..., S] of a first observation at 0.5, read
    with that observation's mean moved up to the rate of the position before where that is higher (0.5 stays for
    the first position, and where the position before reads lower).

    Acceptance given that the drafts before were accepted barely changes with the position (0.88-0.92 at every
    position on HumanEval-chat, 0.80-0.83 on ShareGPT, for Qwen2.5-Coder 0.5B drafting for 1.5B): a position no row
    has reached is better guessed from the one before it than at 0.5. At 0.5 the policy kept its width at what it
    had measured (each wider width looked worse than it is, and the +-1 exploration only tries a width within its
    margin): width 2 for a hundred steps of full acceptance on HumanEval-chat. Never below 0.5: the rate before
    read low (right after a rejection, say) is no evidence that the next position is worse still, and reading it
    lower locked a policy at width 1 on ShareGPT. Counts of rows that reached the position outweigh the prior as
    they come (its weight decays with them), so an optimistic guess costs the few steps that measure it."""
    # Each position reads the one before it: a scan over a few dozen numbers, cheaper in Python floats than as a
    # tensor operation per position (this runs after every step).
    size = tried.shape[-1]
    rows = zip(*(x.reshape(-1, size).tolist() for x in (tried, accepted, prior)))
    out = []
    for row_tried, row_accepted, row_prior in rows:
        before = 0.5
        for t, a, p in zip(row_tried, row_accepted, row_prior):
            before = (a + p * (max(before, 0.5) - 0.5)) / t
            out.append(before)
    return torch.tensor(out, dtype=tried.dtype).reshape(tried.shape)


def _tokens(rates: torch.Tensor) -> torch.Tensor:
    """Acceptance rates [N, S] -> E[committed | s] [N, S+1] = 1 + sum_{i<=s} prod_{j<=i} p_j."""
    return torch.cat([torch.ones(rates.shape[0], 1), 1 + rates.cumprod(dim=1).cumsum(dim=1)], dim=1)


def _check_real(name: str, value, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r}.")
    return value


def _counts(values, shape, what: str) -> torch.Tensor:
    out = torch.tensor(values, dtype=torch.float32)
    if shape is not None and tuple(out.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(out.shape)}, expected {shape}")
    if not bool(torch.isfinite(out).all()) or bool((out < 0).any()):
        raise ValueError(f"{what} must be finite and non-negative")
    return out


def _finite(*values, what: str) -> tuple:
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ValueError(f"{what} holds a value that is not a finite number: {values}")
    return values


def _times(value, what: str) -> list:
    seconds, samples = value
    _finite(seconds, samples, what=what)
    if seconds <= 0 or samples < 0:      # no step takes no time: goodput divides by it
        raise ValueError(f"{what} holds a time that is not positive or a negative count: {value}")
    return [seconds, samples]
