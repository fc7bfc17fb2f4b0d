"""A drafter driven by a function: for tests (always right, always wrong, right for exactly j tokens, per row) and
for users who bring their own proposer."""

from __future__ import annotations

from typing import Callable

from .drafter import DraftRequest, JoinsRows, Proposal, Trees, branches_proposal, left_padding, place

# script(row, context, gamma) -> up to gamma token ids, or a tree as a list of branches (token lists from the
# last committed token, best first; shared prefixes merge). `row` is the row's index in the user's batch, `context`
# the row's committed tokens (prompt without padding, then generated tokens).
Script = Callable[[int, list, int], list]


class ScriptedDrafter(Trees, JoinsRows):
    """Proposes whatever `script` returns, as a point-mass draft (no probabilities). Under a tree plan (FixedTree),
    branches become a tree of up to gamma nodes and the plan's depth; under a chain plan only the first branch
    counts."""

    def __init__(self, script: Script):
        self.script = script
        self.pad = None

    def begin(self, input_ids, attention_mask):
        self.pad = left_padding(input_ids, attention_mask)

    def add_rows(self, input_ids, attention_mask, rows):
        self.pad = place(self.pad, rows, left_padding(input_ids, attention_mask))

    def propose(self, request: DraftRequest) -> Proposal:
        branches = []
        for b, (gamma, row, length) in enumerate(zip(request.gammas.tolist(), request.rows.tolist(),
                                                     request.lengths.tolist())):
            if gamma == 0:
                branches.append([])
                continue
            context = request.tokens[b, self.pad[row] : length].tolist()
            answer = list(self.script(row, context, gamma))
            tree = bool(answer) and all(isinstance(x, (list, tuple)) for x in answer)
            branches.append([list(x) for x in answer] if tree else [answer])
        return branches_proposal(branches, request)

