"""Latency models for the policies: a profiled table (T(B, s), draft cost, c_prefill(L, B)) and an online fit.

- `LatencyTable`: what `spec-adapt profile` measures on this machine, saved as JSON; `step_time(B, s)` interpolates
  linearly between grid points (and extrapolates from the last two), `switch_cost(L, B)` likewise.
- `OnlineLatency`: least squares on the step times the loop observes, T ~ a + b*B + c*B*s + d*s (the verify pass
  grows with the tokens it scores, drafting grows with s), used where no table was measured; falls back to the table
  (or a flat prior) until it has enough varied samples.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


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


class OnlineLatency:
    """Step-time model fitted online: T(B, s) = a + b*B + c*B*s + d*s, least squares over a sliding window."""

    def __init__(self, table: LatencyTable | None = None, window: int = 512, min_samples: int = 12,
                 refit_every: int = 16):
        self.table, self.window, self.min_samples, self.refit_every = table, window, min_samples, refit_every
        self.samples: list[tuple[int, int, float]] = []
        self.coef: torch.Tensor | None = None
        self._since_fit = 0
        self._floor = math.inf
        self._fitted: bool | None = None      # None: unknown since the last sample
        self._xtx = [[0.0] * 4 for _ in range(4)]   # running sums over the window: refits are a 4x4 solve
        self._xty = [0.0] * 4
        self._lengths: dict[int, int] = {}          # draft length -> samples in the window

    def _accumulate(self, sample, sign: float) -> None:
        batch, s, seconds = sample
        f = self._features(batch, s)
        for i in range(4):
            self._xty[i] += sign * f[i] * seconds
            for j in range(4):
                self._xtx[i][j] += sign * f[i] * f[j]
        self._lengths[s] = self._lengths.get(s, 0) + int(sign)
        if not self._lengths[s]:
            del self._lengths[s]

    def add(self, batch: int, s: int, seconds: float) -> None:
        self.samples.append((batch, s, seconds))
        self._accumulate(self.samples[-1], 1.0)
        while len(self.samples) > self.window:
            self._accumulate(self.samples.pop(0), -1.0)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:   # refitting every step would cost more than the decision budget
            self.coef = None
        if self.coef is None:
            self._fitted = None

    def _features(self, batch, s):
        return [1.0, float(batch), float(batch * s), float(s)]

    def _fit(self) -> bool:
        """Fit when due; False while there are too few samples, or all at one draft length (s unidentifiable)."""
        if self._fitted is not None:
            return self._fitted
        self._fitted = False
        if self.coef is None:
            if len(self.samples) < self.min_samples or len(self._lengths) < 2:
                return False
            # Normal equations with a tiny ridge: four coefficients (lstsq/gelsd took ~40 ms here).
            gram = torch.tensor(self._xtx, dtype=torch.float64) + 1e-9 * torch.eye(4, dtype=torch.float64)
            self.coef = torch.linalg.solve(gram, torch.tensor(self._xty, dtype=torch.float64)).tolist()
            self._floor = 0.5 * min(t for _, _, t in self.samples)
            self._since_fit = 0
        self._fitted = True
        return True

    def ready(self) -> bool:
        """True once enough samples at two or more draft lengths are in for a fit."""
        return self._fit()

    def step_time(self, batch: int, s: int) -> float:
        if self._fit():
            value = sum(c * f for c, f in zip(self.coef, self._features(batch, s)))
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


def profile(model, draft=None, batch_sizes=(1, 4, 16), lengths=(0, 1, 2, 4, 8), lags=(32, 128, 512),
            context: int = 256, repeats: int = 5, progress: bool = True) -> LatencyTable:
    """Measure T(B, s) for `model`, the draft's per-token time and catch-up cost c_prefill(L, B) on this machine."""
    from tqdm import tqdm

    from .ledger import KVLedger

    def timed(fn) -> float:
        fn()                                                  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def primed(m, batch, length):
        ledger = KVLedger(m)
        ids = torch.randint(3, m.config.vocab_size, (batch, length))
        ledger.prefill(ids, None)
        return ledger

    def forward_then_rollback(ledger, width):
        tokens = torch.randint(3, ledger.model.config.vocab_size, (ledger.slots.shape[0], width))
        keep = ledger.n_cached.clone()
        ledger.forward(tokens, torch.full((tokens.shape[0],), width))
        ledger.rollback(keep)

    table = LatencyTable(meta={"context": context, "repeats": repeats, "batch_sizes": list(batch_sizes)})
    jobs = [("step", b, s) for b in batch_sizes for s in lengths]
    if draft is not None:
        jobs += [("draft", b, 1) for b in batch_sizes] + [("prefill", b, l) for b in batch_sizes for l in lags]
    with torch.no_grad():
        for kind, batch, n in tqdm(jobs, desc="profiling", disable=not progress):
            if kind == "step":
                ledger = primed(model, batch, context)
                table.step.setdefault(batch, {})[n] = timed(lambda: forward_then_rollback(ledger, n + 1))
            elif kind == "draft":
                ledger = primed(draft, batch, context)
                table.draft_token[batch] = timed(lambda: forward_then_rollback(ledger, 1))
            else:
                ledger = primed(draft, batch, context)
                table.prefill.setdefault(n, {})[batch] = timed(lambda: forward_then_rollback(ledger, n))
    return table


# -- profiles cached per model, dtype and device ------------------------------------------------------------------------
def profile_key(model, draft=None) -> str:
    """Names what a latency table depends on: the model (its name and size), the draft, the dtype and the device
    (the CPU's model name and core count, or the GPU's name)."""
    import os
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
        from .models import quantization_of

        quant = quantization_of(d)
        return f"draft-{name(d)}-{str(d.dtype).removeprefix('torch.')}" + (f"-{quant}" if quant else "")

    parts = [name(model), draft_name(draft) if draft is not None else "nodraft",
             str(next(model.parameters()).dtype).removeprefix("torch."), where]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "__".join(parts))


def profile_path(model, draft=None) -> Path:
    from .models import cache_dir

    return cache_dir() / "profiles" / f"{profile_key(model, draft)}.json"


def cached_profile(model, draft=None) -> LatencyTable | None:
    """The table `spec-adapt profile` cached for this model, draft, dtype and device, or None."""
    path = profile_path(model, draft)
    return LatencyTable.load(path) if path.exists() else None
