"""Running estimates the core, the policies and serving update step by step: moving averages, the batch-size
context, probe back-off, and a draft's calibration with the stopping rule read from it.

- `ema`: an exponential moving average; `mean_then_ema`: the plain mean of the first samples, then an EMA.
- `bucket`: the batch-size context (powers of two) every per-batch-size estimate is kept under.
- `ProbeBackoff`: when a switched-off option is tried again: after `gap` idle steps; a lost probe doubles the gap.
- `Calibration`: how often a draft token is accepted, by the draft's confidence in it; `StopRule`: where a row stops
  drafting within a step, from that calibration.

The estimators only policies use (step-time fits, acceptance counts, tree shapes) are in
`spec_adapt.policies.estimators`.
"""

from __future__ import annotations

import numbers


def ema(old, new, weight: float):
    """`new` weighted `weight` against `old` (floats or tensors); with no `old` yet (None), `new` itself."""
    return new if old is None else (1 - weight) * old + weight * new


def mean_then_ema(entry, new: float, weight: float) -> list:
    """[value, samples] after one more sample: the plain mean while 1 / samples exceeds `weight`, an EMA of `weight`
    after, so a slow first sample does not stand for long. `entry`: the previous [value, samples], or None."""
    value, samples = entry if entry is not None else (None, 0)
    samples += 1
    return [ema(value, new, max(weight, 1 / samples)), samples]


def bucket(batch_size: int) -> int:
    """Batch-size context: the power of two at or below B (1, 2, 4, 8, ...)."""
    return 1 << (max(batch_size, 1).bit_length() - 1)


class ProbeBackoff:
    """When to try again an option that lost (speculation switched off, a pruned verification path): after `gap`
    steps without it. A probe that loses doubles the gap, up to `max_gap`; one that wins resets it to `start`.
    An always-losing option thus costs a few steps, then one in `max_gap`."""

    def __init__(self, start: int = 16, max_gap: int = 256):
        if not 1 <= start <= max_gap:
            raise ValueError(f"ProbeBackoff needs 1 <= start <= max_gap, got {start}, {max_gap}.")
        self.start, self.max_gap = start, max_gap
        self.gap, self.idle = start, 0

    def due(self) -> bool:
        return self.idle >= self.gap

    def wait(self) -> None:
        """One more step without the option."""
        self.idle += 1

    def used(self) -> None:
        """The option runs this step (chosen, or probed): the count of steps without it restarts."""
        self.idle = 0

    def result(self, won: bool) -> None:
        """A probe ran (the idle count restarts); it won or lost against the alternative."""
        self.idle = 0
        self.gap = self.start if won else min(2 * self.gap, self.max_gap)

    def again(self) -> None:
        """The option is due again at the next chance (a probe that won and wants confirming)."""
        self.idle = self.gap


class Calibration:
    """How often a draft token is accepted, given the draft's probability of it (its confidence): acceptance counts
    in `bins` equal bins of confidence, each starting from a prior of `prior` pseudo-observations at the bin's
    middle (a draft that is exactly calibrated). Only tokens the verification reached count: the first rejected one
    of a row and those before it.

    A draft that is more (or less) sure of itself than it should be moves its bins away from the diagonal; `__call__`
    reads them. Kept by the policy that plans stopping rules, across calls."""

    def __init__(self, bins: int = 10, prior: float = 4.0):
        import torch

        if not (isinstance(bins, int) and not isinstance(bins, bool) and 1 <= bins <= 1000) or not 0 < prior < 1e6:
            raise ValueError(f"Calibration needs an int 1 <= bins <= 1000 and 0 < prior < 1e6, got {bins!r}, "
                             f"{prior!r}.")
        middle = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        self.bins, self.prior = bins, float(prior)
        self.reached = torch.full((bins,), float(prior), dtype=torch.float64)
        self.accepted = middle * prior

    @property
    def seen(self) -> bool:
        """Whether any drafted token has been counted (beyond the prior)."""
        return float(self.reached.sum()) > self.bins * self.prior

    def _bin(self, confidence):
        return (confidence.double().clamp(0, 1) * self.bins).long().clamp(max=self.bins - 1)

    def __call__(self, confidence):
        """The acceptance probability of draft tokens of these confidences (a tensor of the same shape)."""
        index = self._bin(confidence).cpu()
        return (self.accepted[index] / self.reached[index]).to(confidence.device, confidence.dtype)

    def state_dict(self) -> dict:
        return {"reached": self.reached.tolist(), "accepted": self.accepted.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Counts `state_dict` saved, checked first: as many bins, finite, 0 <= accepted <= reached, reached > 0."""
        import torch

        reached = torch.tensor(state["reached"], dtype=torch.float64)
        accepted = torch.tensor(state["accepted"], dtype=torch.float64)
        if reached.shape != (self.bins,) or accepted.shape != (self.bins,):
            raise ValueError(f"a calibration of {self.bins} bins needs {self.bins} counts each, got "
                             f"{tuple(reached.shape)} and {tuple(accepted.shape)}")
        if not bool(torch.isfinite(reached).all() & torch.isfinite(accepted).all()) or bool((reached <= 0).any()) \
                or bool((accepted < 0).any()) or bool((accepted > reached).any()):
            raise ValueError("calibration counts must be finite, with 0 <= accepted <= reached and reached > 0")
        self.reached, self.accepted = reached, accepted

    def update(self, confidence, drafted, accepted) -> None:
        """One step's outcome: confidence [B, S] of each drafted token, drafted [B] and accepted [B] counts."""
        import torch

        confidence = confidence.detach().cpu()
        position = torch.arange(confidence.shape[1])[None, :]
        drafted, accepted = torch.as_tensor(drafted)[:, None], torch.as_tensor(accepted)[:, None]
        reached = (position < drafted) & (position <= accepted)
        index = self._bin(confidence[reached])
        self.reached.index_add_(0, index, torch.ones(len(index), dtype=torch.float64))
        self.accepted.index_add_(0, index, (position < accepted).expand_as(reached)[reached].double())


class StopRule:
    """Where a row stops drafting within a step: after the first token whose survival (the probability that it and
    every draft before it are accepted, each read from `calibration` at the draft's confidence) falls below the
    threshold of the next position. That token is still proposed: the draft already paid its forward, and the next
    one, which would tell its confidence, is the forward the rule saves. A policy sets the thresholds from its cost
    model: one more draft token pays while the survival so far exceeds the tokens per row that its time would have
    committed otherwise. `threshold`: one number for every position, or one per position from the first (positions
    past the end use the last); each in [0, 1].

    A row asked to draft always drafts its first token (its survival before it is 1): the calibration learns only
    from drafted tokens, and whether drafting pays at all is the policy's call."""

    MAX_POSITIONS = 1024

    def __init__(self, threshold, calibration: Calibration):
        if not isinstance(calibration, Calibration):
            raise TypeError(f"StopRule needs a Calibration, got {type(calibration).__name__}.")
        values = list(threshold) if isinstance(threshold, (list, tuple)) else [threshold]
        if not 1 <= len(values) <= self.MAX_POSITIONS or any(
                isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v <= 1 for v in values):
            raise ValueError(f"StopRule(threshold) must be a number in [0, 1] or 1 to {self.MAX_POSITIONS} of them "
                             f"(one per draft position), got {threshold!r}.")
        self.thresholds, self.calibration = tuple(float(v) for v in values), calibration

    def at(self, position: int) -> float:
        """The threshold of draft position `position` (0 = a row's first token)."""
        return self.thresholds[min(position, len(self.thresholds) - 1)]

    def survival(self, survived, confidence):
        """The survival after one more draft token of `confidence`, given `survived` before it."""
        return survived * self.calibration(confidence)

    def keeps(self, survival, position: int):
        """[B] bool: whether each row drafts its token at `position` (0 = its first), given the survival of the
        tokens before it (1 before the first: a threshold is at most 1, so every row drafts its first token)."""
        return survival >= self.at(position)

    def depths(self, confidence):
        """[B] drafts per row the rule keeps, of a chain of confidences [B, S] (a whole chain at once)."""
        import torch

        survival = torch.cumprod(self.calibration(confidence), dim=1)
        before = torch.cat([torch.ones_like(survival[:, :1]), survival[:, :-1]], dim=1)
        if not confidence.shape[1]:
            return torch.zeros(confidence.shape[0], dtype=torch.long, device=confidence.device)
        kept = torch.stack([self.keeps(before[:, k], k) for k in range(confidence.shape[1])], dim=1)
        return kept.long().cumprod(dim=1).sum(dim=1)
