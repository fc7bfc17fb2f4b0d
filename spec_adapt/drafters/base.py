"""The Drafter contract: the propose phase of a speculative step.

A drafter sees the committed tokens of the active rows and proposes up to `gammas[b]` tokens per row. It may propose
fewer (early exit, no n-gram match): `Proposal.lengths` says how many. After verification the loop calls `rollback`
with how much of the row's buffer is still valid, and `select_rows` when finished rows leave the batch, in the same
way for every drafter and for the target's own ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..processors import ScoreProcessor


@dataclass
class DraftRequest:
    tokens: torch.Tensor         # [B, Lmax] long: token buffer of the active rows (left padding, prompt, generated)
    lengths: torch.Tensor        # [B] long: committed tokens per row (buffer prefix)
    gammas: torch.Tensor         # [B] long: tokens to draft per row (0 = none for that row)
    rows: torch.Tensor           # [B] long: the rows' indices in the user's batch
    sampling: bool               # True: return draft probabilities for rejection sampling (or None = point mass)
    process: ScoreProcessor      # the call's logits processors, to apply to draft scores position by position


@dataclass
class Proposal:
    tokens: torch.Tensor              # [B, S] long, S = max(lengths); entries past lengths[b] are ignored
    lengths: torch.Tensor             # [B] long, lengths[b] <= gammas[b]
    probs: torch.Tensor | None = None # [B, S, V] float32 processed draft distributions; None = point mass

    @staticmethod
    def empty(batch: int, device) -> "Proposal":
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return Proposal(torch.zeros(batch, 0, dtype=torch.long, device=device), zeros)

    @staticmethod
    def pack(drafts: list[torch.Tensor], device) -> "Proposal":
        """Per-row 1-D token tensors of different lengths -> a point-mass Proposal (rows padded with 0)."""
        width = max((d.numel() for d in drafts), default=0)
        tokens = torch.zeros(len(drafts), width, dtype=torch.long)
        for b, d in enumerate(drafts):
            tokens[b, : d.numel()] = d
        lengths = torch.tensor([d.numel() for d in drafts], dtype=torch.long)
        return Proposal(tokens.to(device), lengths.to(device))


def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Left-padding length of each row of a prompt batch (its real tokens start there)."""
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    return (attention_mask == 0).sum(dim=1).tolist()


def with_drafts(tokens: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """A copy of the token buffer [B, L] with each row's drafts [B, S] written after its committed tokens."""
    out = tokens.clone()
    if drafts.shape[1]:
        index = (lengths[:, None] + torch.arange(drafts.shape[1], device=tokens.device)).clamp(max=tokens.shape[1] - 1)
        out.scatter_(1, index, drafts)
    return out


class Drafter:
    """Base class. Model-free drafters override `propose` only."""

    def validate(self, target) -> None:
        """Raise a clear error if this drafter cannot serve `target` (tokenizer, vocabulary). Called once per call."""

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Start of a generate call: the (left padded) prompt [B, L] and its mask."""

    def propose(self, request: DraftRequest) -> Proposal:
        raise NotImplementedError

    def lag(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """[B] committed tokens (of `lengths`) this drafter would have to catch up on first; None = no such cost."""
        return None

    def rollback(self, keep_len: torch.Tensor) -> None:
        """Buffer tokens [0, keep_len[b]) of each active row are committed; anything drafted past them is not."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Only these active rows remain (indices into the current active batch)."""

    def end(self, tokens: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> None:
        """End of the call: free per-call state. `tokens` [B0, L] / `lengths` [B0] are the final sequences of the
        user's whole batch (None after a failure), for drafters that learn from outputs."""
