"""A drafter driven by a function: for tests (always right, always wrong, right for exactly j tokens, per row) and
for users who bring their own proposer."""

from __future__ import annotations

from typing import Callable

import torch

from .base import Drafter, DraftRequest, Proposal, left_padding

# script(row, context, gamma) -> up to gamma token ids. `row` is the row's index in the user's batch, `context` the
# row's committed tokens (prompt without padding, then generated tokens).
Script = Callable[[int, list, int], list]


class ScriptedDrafter(Drafter):
    """Proposes whatever `script` returns, as a point-mass draft (no probabilities)."""

    def __init__(self, script: Script):
        self.script = script
        self.pad = None

    def begin(self, input_ids, attention_mask):
        self.pad = left_padding(input_ids, attention_mask)

    def add_rows(self, input_ids, attention_mask):
        self.pad = (self.pad or []) + left_padding(input_ids, attention_mask)

    def propose(self, request: DraftRequest) -> Proposal:
        batch = request.tokens.shape[0]
        drafts = []
        for b in range(batch):
            gamma = int(request.gammas[b])
            row = int(request.rows[b])
            if gamma == 0:
                drafts.append([])
                continue
            context = request.tokens[b, self.pad[row] : int(request.lengths[b])].tolist()
            drafts.append([int(t) for t in self.script(row, context, gamma)][:gamma])
        return Proposal.pack([torch.tensor(d, dtype=torch.long) for d in drafts], request.tokens.device)
