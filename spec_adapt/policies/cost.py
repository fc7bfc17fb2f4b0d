"""The step-cost model: what a speculative step costs, learned from the steps as they run. Every decision that
weighs time reads it: `Adaptive`'s width, `ChainScheduler`'s chain, the several-source router, the
`EarlyExitVerifier` gate, the lab's simulated clock and the bench's hindsight bound.

A step is three parts, each with its own table:

- verification: the target's forward, T_v(B, w), by batch size B and tokens fed per row w (the widest row's drafts
  plus the last committed token), per verification path ("full"; "pruned" for a Top-K early exit). Read from the
  mean of that exact point once it is measured, else a line a + d w through this batch-size bucket's drafting
  steps (past the widest width it has measured, no cheaper per token than the nearest larger bucket that measured
  wider), else a profiled `LatencyTable`, else the one-token time widened by a + b B of itself per extra token
  (`prior_slope` = (a, b): a cautious prior that covers an unmeasured draft's time too);
- drafting: per source ("model", "lookup", "suffix", a chain's "level0", ...) and bucket, a line a + d k in the
  tokens k drafted in a step (a draft model's first forward costs more than the next; `prior_draft` of a one-token
  verification per token until a source is measured, none by default, as the verification prior covers it), and
  the catch-up a source
  pays when it is `lag` tokens behind (a line in the lag; proportional to it after one sample; before that the
  profile's c_prefill(L, B));
- host work: what a step takes beyond its forward and its drafting (acceptance, bookkeeping), a moving average per
  bucket.

T(B, w, drafts) = T_v(B, w) + sum over sources of their drafting time + host work. A time is in seconds; a
step time over STALL x the estimate (after STALL_AFTER samples) counts as STALL x, since one stall (a GC, the OS)
is not what a shape costs.
"""

from __future__ import annotations

import math

from ..running_estimates import bucket, ema, mean_then_ema
from .estimators import LatencyTable, LineFit, state_key

STALL, STALL_AFTER = 3.0, 8
FULL = "full"


class StepCost:
    def __init__(self, table: LatencyTable | None = None, prior_slope: tuple = (0.1, 0.02), prior_draft: float = 0.0,
                 weight: float = 0.1):
        self.table, self.prior_slope, self.prior_draft, self.weight = table, prior_slope, prior_draft, weight
        self.verify: dict[tuple, list] = {}       # (path, B, w) -> [mean seconds, samples]: exact shapes
        self.near: dict[tuple, list] = {}         # (path, bucket, w) -> [mean seconds, samples]
        self.lines: dict[tuple, LineFit] = {}     # (path, bucket) -> T_v(w) over drafting steps
        self.draft: dict[tuple, LineFit] = {}     # (source, bucket) -> seconds of a step drafting k tokens
        self.catchup: dict[tuple, LineFit] = {}   # (source, bucket) -> seconds a catch-up of `lag` tokens adds
        self.host: dict[int, float] = {}          # bucket -> EMA seconds of a step beyond its forward and drafts
        self.prefill: list | None = None          # [mean seconds, samples] per token of the target's prompt forwards

    # -- observing ---------------------------------------------------------------------------------------------------
    def observe_verify(self, batch: int, fed: int, seconds: float, path: str = FULL) -> None:
        if not (_time(seconds) and fed >= 1):
            return
        key = bucket(batch)
        near = self.near.get((path, key, fed))
        if near is not None and near[1] >= STALL_AFTER:
            seconds = min(seconds, STALL * near[0])
        for table, at in ((self.verify, (path, batch, fed)), (self.near, (path, key, fed))):
            table[at] = mean_then_ema(table.get(at), seconds, self.weight)
        if fed > 1:     # drafting steps only: a long plain run would push every drafting width out of the window
            self.lines.setdefault((path, key), LineFit()).add(fed, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target's forward over `tokens` prompt tokens (rows x padded length) took `seconds`."""
        if tokens >= 1 and _time(seconds):
            self.prefill = mean_then_ema(self.prefill, seconds / tokens, self.weight)

    def observe_draft(self, source: str, batch: int, tokens: int, seconds: float) -> None:
        if tokens > 0 and _time(seconds, zero=True):
            self.draft.setdefault((source, bucket(batch)), LineFit(window=64, min_samples=4)).add(tokens, seconds)

    def observe_catchup(self, source: str, batch: int, lag: int, seconds: float) -> None:
        """A step whose drafting first caught up on `lag` tokens: what it took beyond the usual step."""
        if lag > 0 and _time(seconds, zero=True):
            self.catchup.setdefault((source, bucket(batch)), LineFit(window=32, min_samples=3)).add(lag, seconds)

    def observe_host(self, batch: int, seconds: float) -> None:
        if _time(seconds, zero=True):
            key = bucket(batch)
            self.host[key] = ema(self.host.get(key), seconds, self.weight)

    def observe_step(self, batch: int, fed: int, seconds: float, verify: float, drafts: dict | None = None,
                     held: int | None = None, path: str = FULL) -> None:
        """One step: its verification (`held` rows ran, `fed` tokens each, on `path`), its drafting per source
        {source: (tokens, seconds)}, and the rest of `seconds` as host work."""
        self.observe_verify(held or batch, fed, verify, path)
        spent = verify
        for source, (tokens, drafted) in (drafts or {}).items():
            self.observe_draft(source, batch, tokens, drafted)
            spent += drafted
        self.observe_host(batch, max(0.0, seconds - spent))

    def observe_record(self, record, plain: bool = False) -> None:
        """One step as its `StepRecord` tells it, for a call whose policy keeps no step-cost model (the loop writes
        the call's then): the drafter's own timing per source where it reports one (`draft_seconds`), else, where no
        row drafted from a model-free source, the step's drafting as the draft model's. `plain`: no row drafted (its
        per-row counts are not read: on a GPU each read is a wait)."""
        widest = 0 if plain else max(record.drafted, default=0)
        drafts = (record.telemetry or {}).get("draft_seconds")
        if drafts is None and widest and not any(record.free or ()):
            drafts = {"model": (widest, record.draft_time)}
        spent = sum(seconds for _, seconds in (drafts or {}).values())
        self.observe_step(record.batch_size, widest + 1, record.step_time - record.draft_time + spent,
                          record.verify_time, drafts, record.held, record.path)

    # -- predicting --------------------------------------------------------------------------------------------------
    def verify_time(self, batch: int, fed: float, path: str = FULL) -> float:
        """Seconds of a verification at batch `batch` feeding `fed` tokens per row (fractional: between the two
        widths around it, as a batch that proposes `fed` on average runs a mix of them)."""
        fed = max(1.0, float(fed))
        low = int(fed)
        if fed == low:
            return self._verify_time(batch, low, path)
        below, above = self._verify_time(batch, low, path), self._verify_time(batch, low + 1, path)
        return below + (fed - low) * (above - below)

    def _verify_time(self, batch: int, w: int, path: str) -> float:
        entry = self.verify.get((path, batch, w))
        if entry is not None and (entry[1] >= 3 or w == 1):
            return entry[0]
        key = bucket(batch)
        seen = self._measured(key, w, path, batch)
        if seen is not None:
            return seen
        if self.table is not None and self.table.step:
            return self.table.step_time(batch, w - 1, with_draft=False)
        buckets = {k for (p, k, _) in self.near if p == path}
        if not buckets:
            return 1.0 + (self.prior_slope[0] + self.prior_slope[1] * batch) * (w - 1)   # only ratios are read
        nearest = min(buckets, key=lambda k: abs(math.log2(k / key)))
        return self._measured(nearest, w, path, nearest if nearest != key else batch, prior=True)

    def _measured(self, key: int, w: int, path: str, batch: int, prior: bool = False) -> float | None:
        """This bucket's time for w tokens fed: the exact mean, else the line (never under a one-token step), else,
        with `prior`, the one-token time widened by the prior slope."""
        near = self.near.get((path, key, w))
        if near is not None and (near[1] >= 3 or w == 1):
            return near[0]
        one = self.near.get((path, key, 1))
        line = self.lines.get((path, key))
        if line is not None and line.ready():
            # A line through clustered widths can extrapolate below zero at narrow ones: never under a plain step.
            value = max(line(w), one[0] if one is not None else 1e-6, 1e-6)
            widest = max(line.values)
            if w > widest:     # and flat past them: no cheaper per token than elsewhere (`_slope_beyond`)
                value = max(value, line(widest) + self._slope_beyond(path, key, batch, widest) * (w - widest))
            return value
        if not prior:
            return None
        base = one[0] if one is not None else min(v[0] for (p, k, _), v in self.near.items() if p == path and k == key)
        per_token = self.prior_slope[0] + self.prior_slope[1] * batch
        return base * (1.0 + per_token * (w - 1))

    def _slope_beyond(self, path: str, key: int, batch: int, widest: int) -> float:
        """Seconds one more token per row adds to a verification at this batch size, past the widest width this
        bucket has measured. A line through a few narrow widths can come out flat (a batch that shrank to one row
        after drafting at four), and a flat line makes a 24-token draft look as cheap as a 4-token one. So: the
        per-token slope of the nearest larger bucket whose line reaches wider (seconds per token fed across the
        batch, times this batch's rows). Only a larger batch bounds it: a forward's cost per token fed does not rise
        with the batch, so a smaller batch's would overstate this one's. 0 where none does (the bucket's own line
        then, which its own wider steps correct)."""
        wider = [(k, fit) for (p, k), fit in self.lines.items()
                 if p == path and k > key and fit.ready() and max(fit.values) > widest]
        if not wider:
            return 0.0
        k, fit = min(wider, key=lambda item: item[0])          # the nearest of the larger buckets
        return fit.slope() / k * batch

    def verify_times(self, batch: int, feds) -> list[float]:
        """`verify_time` at each of `feds` (full path)."""
        return [self.verify_time(batch, fed) for fed in feds]

    def draft_time(self, source: str, batch: int, tokens: float, unknown: float | None = None) -> float:
        """Seconds a source takes to draft `tokens` per row in one step (0 for none). A batch-size bucket this source
        has not run at reads the nearest one it has; a source never measured costs `unknown` per token where given,
        else the profile's draft time (the draft model) or `prior_draft` of a one-token verification."""
        if tokens <= 0:
            return 0.0
        fit = self._nearest(self.draft, source, bucket(batch))
        if fit is not None:
            return max(0.0, fit(tokens)) if fit.ready() else fit.proportional(tokens)
        if unknown is not None:
            return tokens * unknown
        if self.table is not None and self.table.draft_token and source == "model":
            return tokens * _table_draft(self.table, batch)
        return tokens * self.prior_draft * self.verify_time(batch, 1)

    def knows(self, source: str, batch: int) -> bool:
        """Whether this source's drafting has been measured (at any batch size)."""
        return self._nearest(self.draft, source, bucket(batch)) is not None

    @staticmethod
    def _nearest(table: dict, source: str, key: int):
        fit = table.get((source, key))
        if fit is not None and fit.samples:
            return fit
        seen = [k for (s, k), f in table.items() if s == source and f.samples]
        return table[(source, min(seen, key=lambda k: abs(math.log2(k / key))))] if seen else None

    def catchup_time(self, source: str, batch: int, lag: int, unknown: float = 0.0) -> float:
        """Seconds a catch-up of `lag` tokens adds to a step: measured; the profile's c_prefill(L, B) for the draft
        model before that; else what the target's own prompt forwards took for `batch` x `lag` tokens (a draft no
        larger than its target catches up no slower: a bound from above, so a short call does not start a draft
        whose catch-up it never pays back); else `unknown`."""
        fit = self._nearest(self.catchup, source, bucket(batch))
        if fit is None:
            if source == "model" and self.table is not None and self.table.prefill:
                return self.table.switch_cost(lag, batch)
            if self.prefill is not None:
                return lag * batch * self.prefill[0]
            return unknown
        return fit(lag) if fit.ready() else fit.proportional(lag)

    def host_time(self, batch: int) -> float:
        """The host work of a step at this batch size (the nearest bucket measured; none measured: 0)."""
        if not self.host:
            return 0.0
        key = bucket(batch)
        return self.host[min(self.host, key=lambda k: abs(math.log2(k / key)))]

    def step_time(self, batch: int, fed: float, drafts: dict | None = None, path: str = FULL) -> float:
        """T(B, w, drafts): a step verifying `fed` tokens per row whose sources draft {source: tokens per row}."""
        drafting = sum(self.draft_time(source, batch, tokens) for source, tokens in (drafts or {}).items())
        return self.verify_time(batch, fed, path) + drafting + self.host_time(batch)

    def samples(self, batch: int, fed: int = 1, path: str = FULL) -> int:
        """Verifications measured at this batch-size bucket and width."""
        entry = self.near.get((path, bucket(batch), fed))
        return entry[1] if entry is not None else 0

    def exact(self, batch: int, fed: int, path: str = FULL) -> list | None:
        """[mean seconds, samples] of this exact shape, or None."""
        return self.verify.get((path, batch, fed))

    def verify_slope(self, batch: int) -> float | None:
        """What one more token per row adds to a verification here, once the line is ready."""
        line = self.lines.get((FULL, bucket(batch)))
        return line.slope() if line is not None and line.ready() else None

    # -- carrying over -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        fits = lambda table: [[list(k), list(map(list, f.samples))] for k, f in table.items()]   # noqa: E731
        return {"verify": [[list(k), v] for k, v in self.verify.items()],
                "near": [[list(k), v] for k, v in self.near.items()],
                "lines": fits(self.lines), "draft": fits(self.draft), "catchup": fits(self.catchup),
                "host": [[k, v] for k, v in self.host.items()], "prefill": self.prefill}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved; the whole state is checked first (a ValueError names the problem), and a
        state that fails leaves this model as it was."""
        verify = {state_key(k, (str, int, int), "verify"): _entry(v, "verify") for k, v in state["verify"]}
        near = {state_key(k, (str, int, int), "near"): _entry(v, "near") for k, v in state["near"]}
        lines = _fits(state["lines"], LineFit, {}, "lines")
        draft = _fits(state["draft"], lambda: LineFit(window=64, min_samples=4), {}, "draft")
        catchup = _fits(state["catchup"], lambda: LineFit(window=32, min_samples=3), {}, "catchup")
        host = {}
        for k, v in state["host"]:
            if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1 and _time(v, zero=True)):
                raise ValueError(f"host time {k!r}: {v!r} is not a bucket (an int >= 1) and a finite time >= 0")
            host[k] = float(v)
        prefill = state.get("prefill")       # absent from states saved before prompt forwards were timed
        prefill = _entry(prefill, "prefill") if prefill is not None else None
        for what, table in (("verify", verify), ("near", near), ("lines", lines), ("draft", draft),
                            ("catchup", catchup)):
            for key in table:      # batch sizes, buckets and tokens fed: a 0 would be read as log2(0) when nearest
                if any(isinstance(v, int) and v < 1 for v in key):
                    raise ValueError(f"{what} key {list(key)!r}: batch sizes, buckets and widths are ints >= 1")
        self.verify, self.near, self.lines, self.draft, self.catchup, self.host, self.prefill = \
            verify, near, lines, draft, catchup, host, prefill


def _table_draft(table: LatencyTable, batch: int) -> float:
    """The profile's seconds per drafted token at this batch size."""
    return table.step_time(batch, 1) - table.step_time(batch, 1, with_draft=False)


def _time(seconds, zero: bool = False) -> bool:
    return isinstance(seconds, (int, float)) and math.isfinite(seconds) and (seconds >= 0 if zero else seconds > 0)


def _entry(value, what: str) -> list:
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        raise ValueError(f"{what} holds {value!r}: expected [mean seconds, samples]")
    seconds, samples = value
    if not (_time(seconds) and isinstance(samples, int) and not isinstance(samples, bool) and samples >= 1):
        raise ValueError(f"{what} holds {value!r}: a time that is not positive or a count below 1")
    return [float(seconds), samples]


def _fits(saved, make, out: dict, what: str) -> dict:
    for key, samples in saved:
        fit = out[state_key(key, (str, int), what)] = make()
        for x, y in samples:
            if not (_time(x, zero=True) and _time(y, zero=True)):
                raise ValueError(f"{what} holds a sample that is not two finite non-negative numbers: {[x, y]}")
            fit.add(x, y)
    return out


class CostReader:
    """A `StepCost` read under the lock of whoever observes into it. The loop hands the call's this way to the
    drafter (`DraftRequest.cost`: the several-source router) and to the verifier (`Verifier.cost`: the early-exit
    gate), so every decision that weighs step times reads the times one writer learned."""

    def __init__(self, cost: StepCost, lock):
        self.cost, self.lock = cost, lock

    def step_time(self, batch: int, fed: float, drafts: dict | None = None, path: str = FULL) -> float:
        with self.lock:
            return self.cost.step_time(batch, fed, drafts, path)

    def verify_times(self, batch: int, feds) -> list[float]:
        with self.lock:
            return self.cost.verify_times(batch, feds)

    def draft_time(self, source: str, batch: int, tokens: float, unknown: float | None = None) -> float:
        with self.lock:
            return self.cost.draft_time(source, batch, tokens, unknown)

    def catchup_time(self, source: str, batch: int, lag: int, unknown: float = 0.0) -> float:
        with self.lock:
            return self.cost.catchup_time(source, batch, lag, unknown)


def share_cost(policy, verifier, lock) -> tuple[StepCost | None, CostReader]:
    """A call's (or a serving engine's) one step-cost model: the policy's `cost` where it keeps one (its `observe`
    writes it), else a fresh one, which the loop writes from each step's record. The verifier gets it to read
    (`Verifier.cost`). Returns (the fresh one, or None where the policy writes its own; the reader for the drafter)."""
    kept = getattr(policy, "cost", None)
    own = None if isinstance(kept, StepCost) else StepCost()
    reader = CostReader(kept if own is None else own, lock)
    verifier.cost = reader
    return own, reader
