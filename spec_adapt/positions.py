"""Column indices the step compares lengths against: `offsets(width, device)` is [1, width] = 0 .. width - 1.

A step builds such a row several times (which drafts a row uses, where its committed tokens go, which slots its
new columns take); each `torch.arange` is an operation and an allocation, a measurable share of a step when the
forward is fast (docs/execution.md, "Host overhead"). One tensor per (width, device) serves every step. It is never
written: callers only compare and add it, and it is made outside inference mode so that it is an ordinary tensor
in any mode."""

from __future__ import annotations

import torch

_MADE: dict = {}


def offsets(width: int, device) -> torch.Tensor:
    """[1, width] long tensor 0 .. width - 1 on `device` (shared: read it, never write it)."""
    device = torch.device(device)
    key = (width, device)
    row = _MADE.get(key)
    if row is None:
        with torch.inference_mode(False):
            row = torch.arange(width, device=device)[None, :]
        if len(_MADE) < 4096:             # widths are bounded by the plan (MAX_WIDTH); devices are few
            _MADE[key] = row
    return row
