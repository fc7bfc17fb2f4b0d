"""The policy lab: replay acceptance traces under a latency table and a batch-size schedule, no model runs.

A trace is, per request, `runs[t]` for every output position t: how many draft tokens in a row the target would
accept if the drafter proposed from position t (unbounded γ). Under greedy decoding the output does not depend on
γ, so a step that drafts γ at position t accepts exactly min(γ, runs[t]) and commits one more token: replaying is
exact. `record_traces` measures runs[t] for a real target and drafter; `synthetic_requests` draws them with a
known acceptance rate, so the best fixed γ is known analytically.

The simulated clock is the step-cost model (`spec_adapt.policies.cost.StepCost`) over the table: a step verifies the
widest row's drafts plus one token (+ with `draft_cost`, the draft model's per-token cost and its catch-up cost
c_prefill(L_max, B) when a row drafts after sitting out steps, or for the first time:
`Request.prompt` is the lag it arrives with, as a draft model that is not prefilled has its prompt to catch up on; a
model-free drafter costs neither). A row drafts min(γ, lengths[t]) tokens and accepts min(that, runs[t]).

Schedules: `Static(B)` keeps B requests running (a finished one is replaced at once, as in serving), `Batches(B)`
runs closed batches of B one after the other (generate calls: a batch ends with its slowest request), `Poisson(rate)`
and `RateCurve([(seconds, rate), ...])` admit arrivals up to `max_batch`.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import torch

from ..metrics import StepRecord
from ..policies.policy import Policy, StepInfo, check_plan
from ..policies.cost import StepCost
from ..policies.estimators import LatencyTable


@dataclass
class Request:
    runs: list[int]                 # runs[t]: draft tokens accepted in a row when drafting at output position t
    arrival: float = 0.0
    name: str = ""
    lengths: list[int] | None = None   # lengths[t]: most tokens the drafter proposes at t (None: as many as asked)
    prompt: int = 0                    # the draft model's lag on arrival: it catches up on the prompt when it first drafts


@dataclass
class Static:
    batch: int

    def arrivals(self, n: int, rng) -> list[float]:
        return [0.0] * n


@dataclass
class Batches:
    """Closed batches of `batch` requests, one after the other, as separate generate calls: a batch is admitted
    whole and the next one only when all of it has finished (policies see `StepInfo.closed`)."""

    batch: int

    def arrivals(self, n: int, rng) -> list[float]:
        return [0.0] * n


@dataclass
class Poisson:
    rate: float                      # requests per second

    def __post_init__(self):
        if not 0 < self.rate < math.inf:
            raise ValueError(f"A Poisson schedule needs a finite positive rate, got {self.rate!r}.")

    def arrivals(self, n, rng):
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(self.rate)
            out.append(t)
        return out


@dataclass
class RateCurve:
    pieces: list[tuple[float, float]]   # (duration seconds, rate) repeated cyclically, e.g. a daily load curve

    def arrivals(self, n, rng):
        t, out, i, piece_end = 0.0, [], 0, self.pieces[0][0]
        while len(out) < n:
            rate = self.pieces[i % len(self.pieces)][1]
            gap = rng.expovariate(rate) if rate > 0 else math.inf
            if t + gap > piece_end:
                t, i = piece_end, i + 1
                piece_end += self.pieces[i % len(self.pieces)][0]
                continue
            t += gap
            out.append(t)
        return out


@dataclass
class SimResult:
    policy: str
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    switches: int = 0
    decision_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    history: list[tuple[float, int, float]] = field(default_factory=list)   # (time, B, mean γ) per step
    regret_curve: list[tuple[int, float]] = field(default_factory=list)     # (step, cumulative extra seconds)

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_latency(self) -> float:
        return sum(self.latencies) / len(self.latencies) if self.latencies else 0.0

    @property
    def decision_time(self) -> float:
        return self.decision_seconds / self.steps if self.steps else 0.0


class Oracle(Policy):
    """Per-step oracle: each row drafts exactly its accepted run (never a rejected token). Needs the lab's view.
    At B = 1 it is an upper bound for any policy; in a batch it is not (a step costs as much as its longest row's
    draft, so drafting every row's whole run can lose to a shorter common γ)."""

    def choose(self, info):
        return info.oracle


def simulate(policy: Policy, requests: list[Request], table: LatencyTable, schedule=Static(1),
             max_batch: int | None = None, seed: int = 0, reference_goodput: float | None = None,
             name: str | None = None, draft_cost: bool = True) -> SimResult:
    """Run `policy` over `requests` (all of them, in order) and return what happened."""
    rng = random.Random(seed)
    closed = isinstance(schedule, Batches)
    queued = isinstance(schedule, (Static, Batches))     # everything is there from the start
    limit = schedule.batch if queued else (16 if max_batch is None else max_batch)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:     # else nothing is ever admitted
        raise ValueError(f"The lab's batch limit (the schedule's batch, else max_batch) must be a positive int, "
                         f"got {limit!r}.")
    arrivals = schedule.arrivals(len(requests), rng)
    pending = sorted(zip(arrivals, range(len(requests))))
    result = SimResult(name or type(policy).__name__)
    clock = StepCost(table)      # never observes: the table's own times
    active: list[dict] = []
    now, last_gamma, extra = 0.0, None, 0.0
    policy.begin(limit)
    while pending or active:
        admit = not (closed and active)      # a closed batch takes new requests only once it is empty
        while admit and pending and len(active) < limit and (pending[0][0] <= now or queued):
            arrival, index = pending.pop(0)
            active.append({"id": index, "pos": 0, "lag": requests[index].prompt, "arrival": max(arrival, 0.0) if not
                           queued else now, "runs": requests[index].runs,
                           "lengths": requests[index].lengths, "seen": -1})
        if not active:
            now = pending[0][0]
            continue
        batch = len(active)
        remaining = torch.tensor([len(r["runs"]) - r["pos"] for r in active])
        # A model-free drafter (draft_cost=False) has nothing to catch up on: the loop reports no lag for it either.
        lags = torch.tensor([r["lag"] for r in active]) if draft_cost else None
        info = StepInfo(batch, torch.tensor([r["id"] for r in active]),
                        torch.tensor([r["pos"] for r in active]), remaining, result.steps, lags, closed=closed)
        info.oracle = [r["runs"][r["pos"]] for r in active]
        start = time.perf_counter()
        gammas = torch.minimum(_chain_widths(policy, policy.choose(info), batch), remaining - 1).tolist()
        result.decision_seconds += time.perf_counter() - start
        drafted = [g if r["lengths"] is None else min(g, r["lengths"][r["pos"]]) for g, r in zip(gammas, active)]
        accepted = [min(d, r["runs"][r["pos"]]) for d, r in zip(drafted, active)]
        committed = [a + 1 for a in accepted]
        top = max(drafted)
        lag = max((r["lag"] for r, g in zip(active, gammas) if g > 0), default=0)
        verify = clock.verify_time(batch, top + 1)
        drafting = clock.draft_time("model", batch, top) + clock.catchup_time("model", batch, lag) if draft_cost else 0.0
        seconds = verify + drafting
        # A draft model's hindsight (`Adaptive._hindsight`): drafting this step, it reads whether one more draft after
        # its last fully accepted chain would have been accepted.
        seen = [r["seen"] if g > 0 and draft_cost else -1 for r, g in zip(active, gammas)]
        record = StepRecord(batch, info.rows.tolist(), gammas, drafted, accepted, committed, seconds, drafting, verify,
                            telemetry={"hindsight": seen} if draft_cost else None)
        start = time.perf_counter()
        policy.observe(record)
        result.decision_seconds += time.perf_counter() - start
        now += seconds
        result.steps += 1
        result.tokens += sum(committed)
        result.switches += int(last_gamma is not None and top != last_gamma)
        last_gamma = top
        result.history.append((now, batch, sum(gammas) / batch))
        if reference_goodput:
            extra += seconds - sum(committed) / reference_goodput
            result.regret_curve.append((result.steps, extra))
        for r, g, d, a, c in zip(active, gammas, drafted, accepted, committed):
            r["seen"] = int(r["runs"][r["pos"]] > d) if 0 < d == a and r["lengths"] is None else -1
            r["pos"] += c
            r["lag"] = 0 if g > 0 else r["lag"] + c
        done = [r for r in active if r["pos"] >= len(r["runs"])]
        result.latencies += [now - r["arrival"] for r in done]
        active = [r for r in active if r["pos"] < len(r["runs"])]
    result.seconds = now
    return result


def best_fixed(requests, table, schedule=Static(1), arms=range(0, 9), max_batch=None, seed=0, draft_cost=True):
    """The best fixed γ in hindsight on this workload: (γ, SimResult)."""
    from ..policies.fixed import FixedLength

    results = {g: simulate(FixedLength(g), requests, table, schedule, max_batch, seed, draft_cost=draft_cost)
               for g in arms}
    best = max(results, key=lambda g: results[g].goodput)
    return best, results[best], results


def compare(policies: dict[str, Policy], requests, table, schedule=Static(1), arms=range(0, 9), max_batch=None,
            seed=0, draft_cost=True) -> dict:
    """Every policy against the best fixed γ in hindsight and against the per-step oracle."""
    gamma, best, fixed = best_fixed(requests, table, schedule, arms, max_batch, seed, draft_cost)
    oracle = simulate(Oracle(), requests, table, schedule, max_batch, seed, name="oracle", draft_cost=draft_cost)
    rows = {}
    for name, policy in policies.items():
        policy.reset()
        r = simulate(policy, requests, table, schedule, max_batch, seed, reference_goodput=best.goodput, name=name,
                     draft_cost=draft_cost)
        rows[name] = {
            "goodput": r.goodput, "mean_latency": r.mean_latency, "switches": r.switches,
            "decision_time": r.decision_time, "vs_best_fixed": r.goodput / best.goodput - 1,
            "vs_oracle": r.goodput / oracle.goodput - 1, "result": r,
        }
    return {"best_fixed_gamma": gamma, "best_fixed": best, "fixed": fixed, "oracle": oracle, "policies": rows}


def synthetic_requests(n: int, length: int, alpha: float, seed: int = 0, cap: int = 64) -> list[Request]:
    """Requests whose runs are i.i.d. geometric: P(run >= k) = alpha^k (acceptance rate alpha at every position)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        runs = []
        for _ in range(length):
            k = 0
            while k < cap and rng.random() < alpha:
                k += 1
            runs.append(k)
        out.append(Request(runs, name=f"synthetic-{alpha}-{i}"))
    return out


def expected_goodput(alpha: float, gamma: int, batch: int, table: LatencyTable) -> float:
    """Analytic goodput of fixed γ on i.i.d. acceptance alpha: B (1 - alpha^(γ+1)) / (1 - alpha) / T(B, γ), T the
    simulated clock's (`StepCost` over the table)."""
    tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1
    return batch * tokens / StepCost(table).step_time(batch, gamma + 1, {"model": gamma})


def record_traces(model, tok, prompts: list[str], drafter, new_tokens: int = 128, max_run: int = 16,
                  batch_size: int = 8, progress: bool = True) -> list[Request]:
    """Measure runs[t] for a real target (greedy) and a drafter: generate each prompt's greedy output, then ask the
    drafter at every output position what it would propose from the true prefix and count the agreement."""
    from tqdm import tqdm

    from ..drafters.drafter import DraftRequest
    from ..processors import ScoreProcessor

    requests = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="recording traces", disable=not progress):
        enc = tok(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        prompt_len = enc["input_ids"].shape[1]
        for b in range(out.shape[0]):
            row = out[b : b + 1]
            mask = torch.cat([enc["attention_mask"][b : b + 1], torch.ones(1, out.shape[1] - prompt_len,
                                                                        dtype=torch.long)], dim=1)
            generated = row[0, prompt_len:].tolist()
            if tok.eos_token_id in generated:
                generated = generated[: generated.index(tok.eos_token_id) + 1]
            drafter.begin(row[:, :prompt_len], mask[:, :prompt_len])
            runs, lengths = [], []
            for t in range(len(generated)):
                request = DraftRequest(row, torch.tensor([prompt_len + t]), torch.tensor([max_run]),
                                       torch.tensor([0]), False, ScoreProcessor(None))
                proposal = drafter.propose(request)
                drafter.rollback(torch.tensor([prompt_len + t]))     # forget the probe's draft tokens
                truth = generated[t : t + max_run]
                guess = proposal.tokens[0, : int(proposal.lengths[0])].tolist()
                run = 0
                while run < min(len(guess), len(truth)) and guess[run] == truth[run]:
                    run += 1
                runs.append(run)
                lengths.append(len(guess))
            drafter.end(row, torch.tensor([prompt_len + len(generated)]))
            requests.append(Request(runs, name=f"prompt-{start + b}", lengths=lengths))
    return requests


def _chain_widths(policy: Policy, answer, batch: int) -> torch.Tensor:
    """[B] the widths a policy's answer drafts here. Recorded traces carry no draft confidences, so a plan's stop
    rule has nothing to read and the rows draft its widths, as a drafter without probabilities does; trees are not
    simulated."""
    plan = check_plan(policy, answer, batch)
    if plan.depth is not None:
        raise ValueError(f"{type(policy).__name__} planned a token tree; the lab simulates chains only (build the "
                         "policy without trees).")
    return plan.gammas
