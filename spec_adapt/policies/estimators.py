"""Estimators of what a step costs and what a draft is worth, as the policies keep them.

- Step time: `LatencyTable`, a measured profile T(B, s), the draft's per-token time and catch-up cost c_prefill(L, B)
  (`spec-adapt profile` writes one per model, draft, dtype and device; `cached_profile` finds it); and least squares
  over a sliding window of observed steps (`WindowFit`), in two forms: `OnlineLatency`, T(B, s) = a + b*B + c*B*s + d*s
  over every batch size, which falls back to a profile until it is ready, and `LineFit`, y = a + d x (one batch-size
  bucket's step time against width, or catch-up time against lag).
- Acceptance: `reach` (which draft positions a step's rows reached and had accepted) and `decay_counts` (counts
  decayed once per observation), which `PositionAcceptance` and Adaptive's per-state counts both keep.
- `TreeShapes`: which tree to grow around a chain, from the goodput each shape measured.
The estimators the core and serving share too (moving averages, `bucket`, `ProbeBackoff`) are in
`spec_adapt.running_estimates`.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..running_estimates import ProbeBackoff, bucket, ema, mean_then_ema
from ..loading import cache_dir


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class LatencyTable:
    step: dict[int, dict[int, float]] = field(default_factory=dict)       # B -> s -> seconds (verify s+1 tokens)
    draft_token: dict[int, float] = field(default_factory=dict)           # B -> seconds per drafted token
    prefill: dict[int, dict[int, float]] = field(default_factory=dict)    # L -> B -> seconds (draft catch-up)
    meta: dict = field(default_factory=dict)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)   # policies ask the same points every step

    def step_time(self, batch: int, s: int, with_draft: bool = True) -> float:
        """Seconds of one step at batch `batch` drafting `s` tokens: verify(s+1) + s draft tokens."""
        key = (batch, s, with_draft)
        if key not in self._memo:
            self._memo[key] = self._step_time(batch, s, with_draft)
        return self._memo[key]

    def _step_time(self, batch: int, s: int, with_draft: bool) -> float:
        sizes = sorted(self.step)
        per_b = [_interp(sorted(self.step[b]), [self.step[b][k] for k in sorted(self.step[b])], s) for b in sizes]
        verify = _interp(sizes, per_b, batch)
        if not with_draft or s == 0 or not self.draft_token:
            return verify
        ds = sorted(self.draft_token)
        return verify + s * _interp(ds, [self.draft_token[b] for b in ds], batch)

    def switch_cost(self, lag: int, batch: int) -> float:
        """c_prefill(L_max, B): seconds for the draft to catch up `lag` tokens at batch `batch`."""
        if not self.prefill or lag <= 0:
            return 0.0
        lags = sorted(self.prefill)
        per_l = [_interp(sorted(self.prefill[l]), [self.prefill[l][b] for b in sorted(self.prefill[l])], batch)
                 for l in lags]
        return max(0.0, _interp([0] + lags, [0.0] + per_l, lag))

    def save(self, path) -> None:
        data = {"step": self.step, "draft_token": self.draft_token, "prefill": self.prefill, "meta": self.meta}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path) -> "LatencyTable":
        data = json.loads(Path(path).read_text())
        ints = lambda d: {int(k): (ints(v) if isinstance(v, dict) else v) for k, v in d.items()}  # noqa: E731
        return cls(ints(data["step"]), ints(data["draft_token"]), ints(data["prefill"]), data.get("meta", {}))


class WindowFit:
    """Least squares over the last `window` samples, kept as running sums of the features' products, so adding or
    dropping a sample costs the same at any window size. Ready once it holds `min_samples` samples at two or more
    distinct values of the variable the fit must see vary (`varying`). A form names its `features` and solves."""

    def __init__(self, size: int, window: int, min_samples: int):
        self.window, self.min_samples = window, min_samples
        self.samples: deque = deque()               # (inputs..., y), oldest first
        self.gram = [[0.0] * size for _ in range(size)]   # sum over the window of f_i f_j
        self.moments = [0.0] * size                 # sum over the window of f_i y
        self.values: dict = {}                      # value of the varying input -> samples in the window

    def features(self, *inputs) -> list[float]:
        raise NotImplementedError

    def varying(self, *inputs):
        raise NotImplementedError

    def add(self, *sample) -> None:
        """One sample: the inputs, then y."""
        self.samples.append(sample)
        self._apply(sample, 1.0)
        while len(self.samples) > self.window:
            self._apply(self.samples.popleft(), -1.0)

    def _apply(self, sample, sign: float) -> None:
        *inputs, y = sample
        f = self.features(*inputs)
        for i in range(len(f)):
            self.moments[i] += sign * f[i] * y
            for j in range(len(f)):
                self.gram[i][j] += sign * f[i] * f[j]
        x = self.varying(*inputs)
        self.values[x] = self.values.get(x, 0) + int(sign)
        if not self.values[x]:
            del self.values[x]

    def ready(self) -> bool:
        return len(self.samples) >= self.min_samples and len(self.values) >= 2


class OnlineLatency(WindowFit):
    """Step-time model fitted online: T(B, s) = a + b*B + c*B*s + d*s over a sliding window of (B, s, seconds),
    refitted every `refit_every` samples; a profiled `table`, then a flat prior, until it is ready."""

    def __init__(self, table: LatencyTable | None = None, window: int = 512, min_samples: int = 12,
                 refit_every: int = 16):
        super().__init__(4, window, min_samples)
        self.table, self.refit_every = table, refit_every
        self.coef: list[float] | None = None
        self._since_fit = 0
        self._floor = math.inf
        self._fitted: bool | None = None      # None: unknown since the last sample

    def features(self, batch, s):
        return [1.0, float(batch), float(batch * s), float(s)]

    def varying(self, batch, s):
        return s                              # all samples at one draft length leave s unidentifiable

    def add(self, batch: int, s: int, seconds: float) -> None:
        super().add(batch, s, seconds)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:   # refitting every step would cost more than the decision budget
            self.coef = None
        if self.coef is None:
            self._fitted = None

    def _fit(self) -> bool:
        """Fit when due; False while there are too few samples, or all at one draft length."""
        if self._fitted is not None:
            return self._fitted
        self._fitted = False
        if self.coef is None:
            if not super().ready():
                return False
            # Normal equations with a tiny ridge: a 4x4 solve from the running sums, far cheaper than a
            # least-squares driver over the samples, within a step's decision budget.
            gram = torch.tensor(self.gram, dtype=torch.float64) + 1e-9 * torch.eye(4, dtype=torch.float64)
            self.coef = torch.linalg.solve(gram, torch.tensor(self.moments, dtype=torch.float64)).tolist()
            self._floor = 0.5 * min(t for _, _, t in self.samples)
            self._since_fit = 0
        self._fitted = True
        return True

    def ready(self) -> bool:
        """True once enough samples at two or more draft lengths are in for a fit."""
        return self._fit()

    def step_time(self, batch: int, s: int) -> float:
        if self._fit():
            value = sum(c * f for c, f in zip(self.coef, self.features(batch, s)))
            return max(value, self._floor)
        if self.table is not None and self.table.step:
            return self.table.step_time(batch, s)
        return 1.0 + 0.1 * s      # flat prior: verification nearly free, so speculation gets tried

    def state_dict(self) -> dict:
        # The fit in use and when it was made, too: a fit is refreshed only every `refit_every` samples, so the
        # samples alone would give a restored copy a newer fit, and different choices, than the original.
        return {"samples": [list(x) for x in self.samples], "coef": self.coef, "since_fit": self._since_fit,
                "floor": self._floor if math.isfinite(self._floor) else None}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(self.table, self.window, self.min_samples, self.refit_every)
        for sample in state["samples"]:
            self.add(*sample)
        self.coef = state.get("coef")
        self._since_fit = state.get("since_fit", self._since_fit)
        self._floor = state["floor"] if state.get("floor") is not None else math.inf
        self._fitted = None


class LineFit(WindowFit):
    """y = a + d x over the last `window` samples, ready once it has `min_samples` at two or more distinct x; d is
    kept >= 0 (a wider step never costs less)."""

    def __init__(self, window: int = 128, min_samples: int = 6):
        super().__init__(2, window, min_samples)

    def features(self, x):
        return [1.0, x]

    def varying(self, x):
        return x

    def slope(self) -> float:
        """d: what one more unit of x adds to y (>= 0)."""
        (n, sx), (_, sxx) = self.gram
        sy, sxy = self.moments
        return max(0.0, (n * sxy - sx * sy) / max(n * sxx - sx * sx, 1e-12))

    def __call__(self, x: float) -> float:
        (n, sx), _ = self.gram
        d = self.slope()
        return (self.moments[0] - d * sx) / n + d * x

    def proportional(self, x: float) -> float:
        """y in proportion to x (sum y / sum x): what the samples say before two distinct x are in."""
        return self.moments[0] / max(self.gram[0][1], 1e-9) * x


def reach(asked: torch.Tensor, accepted: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and draft position i < size: whether the row reached position i + 1 (it asked for more than i drafts
    and had i accepted) and whether that draft was accepted. asked, accepted [B] -> (reached, hits) [B, size] float."""
    pos = torch.arange(size)[None, :]
    reached = (pos < torch.minimum(accepted + 1, asked)[:, None]).float()
    return reached, (pos < accepted[:, None]).float() * reached


def decay_counts(tried, accepted, reached, hits, decay: float):
    """Acceptance counts after one step (floats or tensors): decayed once per row that reached the position
    (decay ** reached), so memory is counted in rows, then the step's rows and hits added."""
    factor = decay ** reached
    return factor * tried + reached, factor * accepted + hits


class PositionAcceptance:
    """Per-position acceptance p_i = P(d_i accepted | d_1..d_{i-1} accepted) from decayed counts (`decay_counts`)."""

    def __init__(self, size: int, decay: float = 0.98, prior: float = 0.5, prior_weight: float = 1.0):
        self.tried = [prior_weight] * size
        self.accepted = [prior * prior_weight] * size
        self.decay = decay

    def update(self, drafted: int, accepted: int) -> None:
        self.update_many([drafted], [accepted])

    def update_many(self, drafted: list[int], accepted: list[int]) -> None:
        """One step's rows, each counted up to what it drafted."""
        reached, hits = reach(torch.tensor(drafted), torch.tensor(accepted), len(self.tried))
        for i, (n, h) in enumerate(zip(reached.sum(0).long().tolist(), hits.sum(0).long().tolist())):
            self.tried[i], self.accepted[i] = decay_counts(self.tried[i], self.accepted[i], n, h, self.decay)

    def rates(self) -> list[float]:
        return [a / t for a, t in zip(self.accepted, self.tried)]


# -- profiles cached per model, dtype and device ------------------------------------------------------------------------
def profile_key(model, draft=None) -> str:
    """Names what a latency table depends on: the model (its name and size), the draft, the dtype and the device
    (the CPU's model name and core count, or the GPU's name)."""
    import platform
    import re

    def name(m):
        base = Path(str(getattr(m.config, "_name_or_path", "") or m.config.model_type)).name
        return f"{base}-{sum(p.numel() for p in m.parameters()) // 1_000_000}M"

    device = next(model.parameters()).device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.processor() or platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads"
    def draft_name(d):     # a draft in another dtype, or quantized, costs differently
        quant = "8bit" if getattr(d, "is_loaded_in_8bit", False) else \
            "4bit" if getattr(d, "is_loaded_in_4bit", False) else None
        return f"draft-{name(d)}-{str(d.dtype).removeprefix('torch.')}" + (f"-{quant}" if quant else "") \
            + ("-prepared" if _packed(d) else "")

    parts = [name(model), draft_name(draft) if draft is not None else "nodraft",
             str(next(model.parameters()).dtype).removeprefix("torch.") + ("-prepared" if _packed(model) else ""),
             where]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "__".join(parts))


def _packed(model) -> bool:
    """True when `spec_adapt.prepare` packed some of the model's layers: its step times are another curve."""
    return bool((getattr(model, "_spec_adapt_prepared", None) or {}).get("layers"))


def profile_path(model, draft=None) -> Path:
    return cache_dir() / "profiles" / f"{profile_key(model, draft)}.json"


def cached_profile(model, draft=None) -> LatencyTable | None:
    """The table `spec-adapt profile` cached for this model, draft, dtype and device, or None."""
    path = profile_path(model, draft)
    return LatencyTable.load(path) if path.exists() else None


def state_key(values, kinds: tuple, what: str) -> tuple:
    """A dictionary key read back from a saved state: exactly len(kinds) values, each of its kind (int, bool or str;
    an int is never a bool), ints non-negative."""
    ok = isinstance(values, (list, tuple)) and len(values) == len(kinds) and all(
        isinstance(v, kind) and (kind is not int or not isinstance(v, bool) and v >= 0) for v, kind in zip(values, kinds))
    if not ok:
        names = ", ".join(kind.__name__ for kind in kinds)
        raise ValueError(f"{what} key {values!r}: expected [{names}] (non-negative ints)")
    return tuple(values)


class TreeShapes:
    """Which tree to grow around the chain a length policy chose: per batch-size bucket, a few shapes, each
    `factor` times the chain's width in nodes at the chain's depth (factor 1 is the chain itself), judged by the
    goodput they were measured to give (committed tokens / step seconds, an EMA per bucket and shape). The best
    measured shape runs; every other shape is tried after `start` steps, then after twice as many each time it
    loses again (ProbeBackoff). Shapes not measured yet are tried first, the chain first of all."""

    def __init__(self, factors=(1, 2, 3), ema: float = 0.1, start: int = 16, max_gap: int = 256):
        factors = tuple(factors)
        if not factors or factors[0] != 1 or any(not isinstance(f, int) or isinstance(f, bool) or f < 1
                                                 for f in factors) or len(set(factors)) != len(factors):
            raise ValueError(f"tree factors must be distinct ints >= 1 starting with 1 (the chain), got {factors!r}.")
        self.factors, self.ema, self.start, self.max_gap = factors, ema, start, max_gap
        self.value: dict[tuple, list] = {}          # (bucket, factor) -> [EMA goodput, samples]
        self.probes: dict[tuple, ProbeBackoff] = {}  # (bucket, factor) -> when to try that shape again
        self._probing: tuple | None = None

    def pick(self, batch: int, floor: float | None = None) -> int:
        """The shape to run. `floor`: the goodput of plain decoding at this batch size (tokens per row and second);
        a tree that measured no better runs as the chain, whose own policy then decides whether to draft at all."""
        key = bucket(batch)
        self._probing = None
        for factor in self.factors:                  # everything measured twice first
            if self.value.get((key, factor), (0, 0))[1] < 2:
                return factor
        best = self.best(batch)
        if best != 1 and floor is not None and self.value[(key, best)][0] <= floor:
            best = 1
        for factor in self.factors:
            if factor == best:
                continue
            backoff = self.probes.setdefault((key, factor), ProbeBackoff(self.start, self.max_gap))
            backoff.wait()
            if backoff.due():
                self._probing = (key, factor, best)
                return factor
        return best

    def best(self, batch: int) -> int:
        key = bucket(batch)
        measured = [(self.value[(key, f)][0], -f) for f in self.factors if (key, f) in self.value]
        return -max(measured)[1] if measured else 1

    def observe(self, batch: int, factor: int, tokens: float, seconds: float) -> None:
        key = bucket(batch)
        goodput = tokens / max(seconds, 1e-9)
        self.value[(key, factor)] = mean_then_ema(self.value.get((key, factor)), goodput, self.ema)
        probing, self._probing = self._probing, None
        if probing is not None and probing[1] == factor:
            self.probes[probing[:2]].result(won=goodput > self.value[(key, probing[2])][0])

    def state_dict(self) -> dict:
        return {"factors": list(self.factors), "value": [[list(k), v] for k, v in self.value.items()],
                "gaps": [[list(k), [p.gap, p.idle]] for k, p in self.probes.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Checked whole before anything changes: keys (bucket, factor), finite non-negative values, and probe gaps
        within [1, max_gap] (a gap below 1 would re-probe a losing shape at every chance)."""
        factors = tuple(state["factors"])
        value = {state_key(k, (int, int), "tree shape"): [float(v[0]), int(v[1])] for k, v in state["value"]}
        if factors != self.factors or any(not math.isfinite(v[0]) or v[0] < 0 or v[1] < 0 for v in value.values()):
            raise ValueError(f"tree shapes saved for factors {factors} with bad values, this policy has {self.factors}")
        probes = {}
        for k, (gap, idle) in state["gaps"]:
            if not (1 <= int(gap) <= self.max_gap and int(idle) >= 0):
                raise ValueError(f"tree shape probe gap {gap} / idle {idle}: expected a gap in [1, {self.max_gap}] "
                                 "and idle >= 0")
            probe = ProbeBackoff(self.start, self.max_gap)
            probe.gap, probe.idle = int(gap), int(idle)
            probes[state_key(k, (int, int), "tree shape probe")] = probe
        self.value, self.probes = value, probes


def chained_rates(reached: list[float], accepted: list[float], prior: float, weight: float) -> torch.Tensor:
    """Per position i: (accepted_i + r_{i-1} x weight) / (reached_i + weight), r_{-1} = prior."""
    out, rate = [], prior
    for r, a in zip(reached, accepted):
        rate = (a + rate * weight) / (r + weight)
        out.append(rate)
    return torch.tensor(out)


class SourceAcceptance:
    """Per drafting source and feature bucket (a lookup's match length, a suffix count's share, a draft's state):
    decayed counts, per draft position, of drafts that reached the position and of those accepted. The survival rate
    at position i is (accepted_i + r_{i-1} x weight) / (reached_i + weight), shrunk toward the rate at the position
    before it (the first toward `prior`): a position rarely reached keeps its neighbour's rate instead of falling
    back to the prior, so a copy that has survived 8 tokens is not predicted to stop at the 9th as often as a fresh
    draft. `expected(source, feature, k)` is the tokens a step commits when the row drafts k tokens from it: 1 + sum
    over j <= k of the product of the first j rates."""

    def __init__(self, positions: int = 32, prior: float = 0.5, weight: float = 2.0, decay: float = 0.99):
        self.positions, self.prior, self.weight, self.decay = positions, prior, weight, decay
        self.counts: dict[tuple, torch.Tensor] = {}     # (source, feature) -> [2, positions]: reached, accepted
        self._rates: dict[tuple, torch.Tensor] = {}     # the rates of the counts as they are (cleared on a change)

    def rates(self, source: str, feature: int) -> torch.Tensor:
        key = (source, int(feature))
        counts = self.counts.get(key)
        if counts is None:
            return torch.full((self.positions,), self.prior)
        if key not in self._rates:
            self._rates[key] = chained_rates(counts[0].tolist(), counts[1].tolist(), self.prior, self.weight)
        return self._rates[key]

    def expected(self, source: str, feature: int, most: int, row: torch.Tensor | None = None,
                 shrink: float = 4.0, optimism: float = 0.0) -> torch.Tensor:
        """[most + 1]: the tokens committed when drafting k = 0..most tokens. `row`: the row's own [2, positions]
        counts for this source (`step_counts` summed), shrunk by `shrink` observations toward the feature's rate at
        each position, or the row's own rate a position earlier where that is lower (`_row_rates`).
        `optimism`: each rate raised by that many standard errors of its estimate (`expected_rows`)."""
        return self.expected_rows(source, [feature], most, [row], shrink, optimism)[0]

    def expected_rows(self, source: str, features: list[int], most: int, rows: list, shrink: float = 4.0,
                      optimism: float = 0.0) -> torch.Tensor:
        """[B, most + 1]: `expected` for B rows at once (row b: its feature, its own counts rows[b] or None), at any
        `most`: the estimate grows to it (`grow`), and a row's counts shorter than that read unreached beyond.

        `optimism` > 0 is for a source judged only on the steps it drafts (a draft model: what it would have drafted
        is unknown where another source drafted). Each rate r is raised by optimism x sqrt(r (1 - r) / (n + 1)), n
        the position's observations (the feature's and the row's): an upper confidence bound, as a bandit explores.
        Without it such a source, rated low from a few early steps, loses every comparison to a source judged in
        hindsight on every offer, and never drafts again to show it has become right."""
        self.grow(most)
        by_feature = {f: self.rates(source, f) for f in set(features)}
        rates = torch.stack([by_feature[f] for f in features])[:, :most]
        seen = torch.stack([self._reached(source, f, most) for f in features]) if optimism else None
        own = [b for b, counts in enumerate(rows) if counts is not None]
        if own:
            counts = torch.stack([widened(rows[b], self.positions) for b in own])[:, :, :most]
            rates[own] = _row_rates(counts, rates[own], shrink)
            if optimism:
                seen[own] += counts[:, 0]
        if optimism:
            rates = (rates + optimism * (rates * (1 - rates) / (seen + 1)).sqrt()).clamp(max=1.0)
        survive = rates.cumprod(dim=1)
        return torch.cat([torch.ones(len(features), 1), 1.0 + survive.cumsum(dim=1)], dim=1)

    def _reached(self, source: str, feature: int, most: int) -> torch.Tensor:
        """[most]: the feature's decayed count of drafts that reached each position (0 where none were seen)."""
        counts = self.counts.get((source, int(feature)))
        return counts[0, :most].clone() if counts is not None else torch.zeros(min(most, self.positions))

    def grow(self, positions: int) -> None:
        """Serve drafts up to `positions` tokens long. The new positions start unreached (a position never reached
        reads the rate of the one before it), so the rates are those of an estimate made that wide from the start
        with the same observations: a state shared by drafters and calls of different widths serves the widest."""
        if positions <= self.positions:
            return
        self.counts = {key: widened(counts, positions) for key, counts in self.counts.items()}
        self._rates.clear()
        self.positions = positions

    def step_counts(self, drafted: int, accepted: int) -> torch.Tensor:
        """[2, positions]: the positions one step reached (it drafted `drafted`, `accepted` of them were accepted)
        and the ones accepted."""
        pos = torch.arange(self.positions)
        return torch.stack([(pos < min(accepted + 1, drafted)).float(), (pos < accepted).float()])

    def observe(self, source: str, feature: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        key = (source, int(feature))
        counts = self.counts.get(key)
        counts = counts * self.decay if counts is not None else torch.zeros(2, self.positions)
        self.counts[key] = counts + self.step_counts(drafted, accepted)
        self._rates.pop(key, None)


def widened(counts: torch.Tensor, positions: int) -> torch.Tensor:
    """[2, positions] counts: those given, the positions they lack unreached (a row's counts kept from before its
    state grew, `SourceAcceptance.grow`)."""
    missing = positions - counts.shape[-1]
    return torch.nn.functional.pad(counts, (0, missing)) if missing > 0 else counts


def _row_rates(counts: torch.Tensor, feature: torch.Tensor, shrink: float) -> torch.Tensor:
    """[R, S] survival rates of rows with their own counts [R, 2, S] (reached, accepted), position by position: each
    shrunk by `shrink` observations toward the feature's rate there, or toward the row's own rate at the position
    before where that is lower. So a row whose drafts from this source keep failing early is not expected to ride
    the feature's long tail at the positions it never reached (a copy that holds in other rows does not hold here)."""
    out = torch.empty_like(feature)
    before = torch.ones(feature.shape[0])
    for i in range(feature.shape[1]):
        toward = torch.minimum(feature[:, i], before)
        before = out[:, i] = (counts[:, 1, i] + shrink * toward) / (counts[:, 0, i] + shrink)
    return out
