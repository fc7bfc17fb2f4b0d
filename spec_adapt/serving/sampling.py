"""Per-request sampling parameters inside one running batch.

`RowSampling` is a logits processor that keeps, per slot (a running request's row number), the request's temperature,
top-k and top-p, and applies to each score the parameters of the row it belongs to, as transformers' temperature,
top-k and top-p warpers (in that order) apply them to a whole batch. A greedy request (temperature 0) in a batch that
samples keeps only its argmax (the first maximum, as greedy decoding takes it): a sample from that is the argmax, and
a draft is accepted exactly when it is the argmax, so the row decodes greedily whatever the rows around it do.

The engine samples (the loop's acceptance draws keyed noise) only while some running row samples; a batch of greedy
rows runs the plain greedy path with no processor at all.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters. temperature 0 = greedy; top_k 0 = off; top_p 1 = off; seed None = the
    engine's seed and the request's admission number key its noise (spec_adapt.noise)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}.")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}.")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                                 or not 0 <= seed < 1 << 63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}.")

    @property
    def samples(self) -> bool:
        return self.temperature > 0


GREEDY = Sampling()


class RowSampling:
    """The per-slot parameters (see the module docstring). `set(slots, samplings)` at admission; the loop's score
    processor calls `for_rows(rows)` and then the view on (input_ids, scores), as with any row-aware processor."""

    context_free = True       # reads only the scores: every position of a step is processed in one call

    def __init__(self, device):
        self.temperature = torch.zeros(0, device=device)
        self.top_k = torch.zeros(0, dtype=torch.long, device=device)
        self.top_p = torch.ones(0, device=device)

    def set(self, slots: list[int], samplings: list[Sampling]) -> None:
        grow = max(slots) + 1 - len(self.temperature)
        if grow > 0:
            self.temperature = torch.cat([self.temperature, self.temperature.new_zeros(grow)])
            self.top_k = torch.cat([self.top_k, self.top_k.new_zeros(grow)])
            self.top_p = torch.cat([self.top_p, self.top_p.new_ones(grow)])
        index = torch.tensor(slots, device=self.temperature.device)
        self.temperature[index] = torch.tensor([s.temperature for s in samplings], device=index.device)
        self.top_k[index] = torch.tensor([s.top_k for s in samplings], device=index.device)
        self.top_p[index] = torch.tensor([float(s.top_p) for s in samplings], device=index.device)

    def for_rows(self, rows: torch.Tensor):
        return lambda input_ids, scores: warp(scores, self.temperature[rows], self.top_k[rows], self.top_p[rows])


def warp(scores, temperature, top_k, top_p) -> torch.Tensor:
    """Scores [N, V] of rows with these parameters [N]: greedy rows keep their argmax only; the others are divided
    by their temperature, then cut to their top-k and top-p as transformers' warpers cut them."""
    greedy = temperature == 0
    out = scores / torch.where(greedy, 1.0, temperature)[:, None]
    if bool((top_k > 0).any()):
        k = top_k.clamp(1, scores.shape[-1])
        kth = out.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        out = torch.where((top_k > 0)[:, None] & (out < kth), -math.inf, out)
    if bool((top_p < 1).any()):
        ascending, order = out.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
        drop[:, -1] = False                          # at least one token stays (min_tokens_to_keep = 1)
        drop = drop.scatter(1, order, drop)
        out = torch.where((top_p < 1)[:, None] & drop, -math.inf, out)
    if bool(greedy.any()):
        best = scores.argmax(dim=-1, keepdim=True)
        only = torch.full_like(scores, -math.inf).scatter(1, best, scores.gather(1, best))
        out = torch.where(greedy[:, None], only, out)
    return out
