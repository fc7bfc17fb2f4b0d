"""Prompt lookup: a model-free drafter that copies what followed the latest earlier occurrence of the row's last
n tokens (n-gram match in the prompt and everything generated so far).

Worked example, max_ngram = 2: context [5 8 3 9 4 5 8], last 2 tokens [5 8] occurred at 0..1, followed by
[3 9 4 ...] -> propose [3 9 4] for gamma = 3. With no 2-gram match it tries the last token alone, then gives up
(proposes nothing for that row: the row takes a plain step). A copy that reaches the end of the context goes on
with what it copied: [7 1 2 1 2] matches [1 2] at 1..2, followed by [1 2] and then the copy's own [1 2 ...]:
propose [1 2 1] for gamma = 3.

Under a tree plan every distinct continuation found becomes a branch (most recent match of the longest n-gram
first, then older matches, then shorter n-grams), merged into a tree within the plan's node budget."""

from __future__ import annotations

import torch

from .drafter import DraftRequest, JoinsRows, Proposal, branches_proposal, left_padding, place, Trees


def lookup_continuation(context: torch.Tensor, gamma: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """context [L] long -> up to gamma tokens that followed the most recent earlier match of its longest suffix."""
    tokens, _ = lookup_match(context, gamma, max_ngram, min_ngram)
    return context.new_tensor(tokens) if tokens else context[:0]


def lookup_match(context: torch.Tensor, gamma: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """(up to gamma tokens that followed the most recent earlier match of the context's longest suffix, the length n
    of that suffix); ([], 0) without a match."""
    length = context.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = context[: length - 1].unfold(0, n, 1)             # [L-n, n]: every earlier n-gram
        hits = (windows == context[length - n:]).all(dim=1).nonzero().squeeze(1)
        hits = hits[hits + n < length]
        if len(hits):
            return _copy_on(context, int(hits[-1]) + n, gamma), n
    return [], 0


def lookup_batch(tokens: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, gammas: torch.Tensor,
                 max_ngram: int, min_ngram: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lookup_match` for every row at once, in a fixed number of tensor operations (none per row), on the tokens'
    device. Row b's context is tokens[b, starts[b]:ends[b]]. Returns (drafts [B, max gamma], lengths [B]: gammas[b]
    where a match was found, else 0, matched n-gram length [B]: 0 without a match)."""
    batch, width = tokens.shape
    starts, ends, gammas = starts.long()[:, None], ends.long()[:, None], gammas.long()
    position = torch.arange(width, device=tokens.device)
    follow = torch.full((batch,), -1, dtype=torch.long, device=tokens.device)     # where the copy starts
    matched = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    for n in range(min(max_ngram, width - 1), min_ngram - 1, -1):
        suffix = tokens.gather(1, (ends - n + position[:n]).clamp(min=0))       # the row's last n tokens
        hit = (tokens.unfold(1, n, 1) == suffix[:, None, :]).all(dim=2)         # [B, W-n+1]: the n-gram at s
        s = position[: width - n + 1]
        hit &= (s >= starts) & (s < ends - n)                                  # inside the context, followed by a token
        latest = torch.where(hit, s, -1).amax(dim=1)
        take = (follow < 0) & (latest >= 0)                                    # the longest n-gram wins
        follow = torch.where(take, latest + n, follow)
        matched = torch.where(take, n, matched)
    found = (follow >= 0) & (gammas > 0)
    depth = int(gammas.max()) if batch else 0
    period = (ends[:, 0] - follow).clamp(min=1)                                # a copy reaching the end repeats
    index = follow.clamp(min=0)[:, None] + torch.arange(depth, device=tokens.device) % period[:, None]
    drafts = tokens.gather(1, index.clamp(max=width - 1)) if depth else tokens[:, :0]
    return drafts, torch.where(found, gammas, 0), torch.where(found, matched, 0)


def lookup_branches(context: torch.Tensor, depth: int, max_ngram: int, min_ngram: int, most: int) -> list[list[int]]:
    """Up to `most` distinct continuations of up to `depth` tokens that followed earlier matches of the context's
    suffixes, best first (longer n-gram, then more recent)."""
    length = context.shape[0]
    found: list[list[int]] = []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n:]
        windows = context[: length - 1].unfold(0, n, 1)             # [L-n, n]: every earlier n-gram
        hits = (windows == suffix).all(dim=1).nonzero().squeeze(1)
        for start in reversed((hits[hits + n < length] + n).tolist()):   # followed by something, most recent first
            branch = _copy_on(context, start, depth)
            if branch not in found:
                found.append(branch)
                if len(found) >= most:
                    return found
    return found


def _copy_on(context: torch.Tensor, start: int, depth: int) -> list[int]:
    """`depth` tokens copied from `start` on. A copy that reaches the context's end goes on with what it copied (the
    text from `start` repeats the end, so it repeats what follows too): a run "x x x x" continues "x x x", not
    one token."""
    tokens = context[start : start + depth].tolist()
    period = context.shape[0] - start
    while len(tokens) < depth:
        tokens.append(tokens[len(tokens) - period])
    return tokens


class PromptLookupDrafter(Trees, JoinsRows):
    """Batched, per row: every row searches its own prompt and generated tokens. Proposals are point masses."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"PromptLookupDrafter needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}.")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.pad = None

    def begin(self, input_ids, attention_mask):
        self.pad = left_padding(input_ids, attention_mask)

    def add_rows(self, input_ids, attention_mask, rows):
        self.pad = place(self.pad, rows, left_padding(input_ids, attention_mask))

    def propose(self, request: DraftRequest) -> Proposal:
        if request.depths is not None:
            return self._propose_tree(request)
        starts = torch.tensor([self.pad[row] for row in request.rows.tolist()], device=request.tokens.device)
        drafts, lengths, matched = lookup_batch(request.tokens, starts, request.lengths, request.gammas,
                                                self.max_ngram, self.min_ngram)
        proposal = Proposal(drafts, lengths)
        proposal.telemetry = {"feature": matched.tolist()}   # the matched n-gram's length per row (0: no match)
        return proposal

    def _propose_tree(self, request: DraftRequest) -> Proposal:
        tokens = request.tokens.cpu()
        branches = []
        for b, (row, length, gamma, depth) in enumerate(zip(request.rows.tolist(), request.lengths.tolist(),
                                                            request.gammas.tolist(), request.depths.tolist())):
            context = tokens[b, self.pad[row] : length]
            found = lookup_branches(context, depth, self.max_ngram, self.min_ngram, gamma) if gamma else []
            branches.append(found)
        return branches_proposal(branches, request)
