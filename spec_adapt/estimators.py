"""Estimators the core, the policies and serving share: moving averages, the batch-size context, probe back-off.

- `ema`: an exponential moving average; `mean_then_ema`: the plain mean of the first samples, then an EMA.
- `bucket`: the batch-size context (powers of two) every per-batch-size estimate is kept under.
- `ProbeBackoff`: when a switched-off option is tried again: after `gap` idle steps; a lost probe doubles the gap.

The estimators only policies use (step-time fits, acceptance counts, tree shapes) are in
`spec_adapt.policies.estimators`.
"""

from __future__ import annotations


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
