"""The Policy contract: the observe phase feeds it, and it chooses the next speculative length.

A policy is an object, never a config string, and keeps its state to itself (never in the user's model):
- `begin(batch_size)`: a generate call starts (reset per-call state such as per-row lengths);
- `choose(info) -> int | sequence/tensor of B ints`: gamma for the whole batch or one per active row; 0 = no draft;
- `observe(record)`: what the step did (a `StepRecord`: gammas, drafted, accepted, committed, times, batch size);
- `reset()`: forget everything learned; `state_dict()` / `load_state_dict()`: save and restore what was learned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..metrics import StepRecord


@dataclass
class StepInfo:
    batch_size: int
    rows: torch.Tensor        # [B] the active rows' indices in the user's batch
    generated: torch.Tensor   # [B] tokens generated so far per row
    remaining: torch.Tensor   # [B] tokens each row may still generate
    step: int                 # verification steps done so far in this call
    draft_lag: torch.Tensor | None = None   # [B] committed tokens a draft model has not cached (catch-up cost)


class Policy:
    def begin(self, batch_size: int) -> None:
        pass

    def choose(self, info: StepInfo):
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        pass

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def check_gammas(policy, value, batch_size: int) -> torch.Tensor:
    """Turn a policy's answer into a [B] long tensor, or raise an error naming the policy and the fix."""
    expected = f"a non-negative int or {batch_size} non-negative ints (one per active row)"
    if isinstance(value, bool):
        value = None
    if isinstance(value, int):
        value = [value] * batch_size
    try:
        gammas = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        gammas = None
    if (
        gammas is None
        or gammas.dtype.is_floating_point
        or gammas.dtype == torch.bool
        or gammas.dim() != 1
        or gammas.numel() != batch_size
        or bool((gammas < 0).any())
    ):
        raise ValueError(f"{type(policy).__name__}.choose returned {value!r}; expected {expected}.")
    return gammas.long()
