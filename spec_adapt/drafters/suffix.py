"""Suffix drafter (SuffixDecoding-style): a frequency index over everything seen in this process, prompts and
outputs of earlier generate calls included, proposing the most frequent continuation of the row's longest suffix.

The index maps every context of up to `depth` tokens to a count of the tokens that followed it (a suffix trie cut
at `depth`, stored as a dict). Proposing walks greedily: find the longest indexed suffix of the row's tokens, take
its most frequent next token, append it, repeat up to gamma times; it stops early when the best continuation's
share of its context's count falls below `min_share` (a confidence early exit that costs nothing to compute).

Under a tree plan the walk branches: best first by the product of shares along the path, a node gets every
continuation whose share of its context is at least `min_share`, until the plan's node budget or depth.

Worked example, depth 2, index built from "a b c a b d a b c": context "x a b" -> longest suffix "a b", seen followed
by c twice and d once -> propose c (share 2/3); then suffix "b c" -> followed by a -> propose a; and so on.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import torch

from .drafter import DraftRequest, JoinsRows, Proposal, Trees, left_padding, pack_trees, place


class SuffixIndex:
    """Counts of next tokens after every context of 1..depth tokens. Shared by drafters; grows as text is added."""

    def __init__(self, depth: int = 8, max_contexts: int = 2_000_000, max_pending: int = 1_000_000):
        self.depth, self.max_contexts, self.max_pending = depth, max_contexts, max_pending
        self.next: dict[tuple, Counter] = defaultdict(Counter)
        self.pending: list[tuple[list[int], int]] = []   # (tokens, start) to index before the next read
        self.pending_tokens = 0

    def add_later(self, tokens: list[int], start: int = 0) -> None:
        """`add`, when the index is next used: a finished call's text costs nothing until a draft needs it (a
        generate call whose policy kept it plain, or a fresh index per call, never pays it), as a draft model's
        prompt is only caught up on when it drafts. Bounded: past `max_pending` tokens it is indexed at once."""
        self.pending.append((tokens, start))
        self.pending_tokens += len(tokens) - start
        if self.pending_tokens > self.max_pending:
            self._flush()

    def _flush(self) -> None:
        pending, self.pending, self.pending_tokens = self.pending, [], 0
        for tokens, start in pending:
            self.add(tokens, start)

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Index the transitions into tokens[start:], each with up to `depth` tokens of left context."""
        if self.pending:
            self._flush()
        if len(self.next) > self.max_contexts:   # bounded memory in a long-lived process: start afresh
            self.next.clear()
        for i in range(max(start, 1), len(tokens)):
            token = tokens[i]
            for n in range(1, min(self.depth, i) + 1):
                self.next[tuple(tokens[i - n : i])][token] += 1

    def continuation(self, context: list[int], gamma: int, min_share: float, min_depth: int = 1) -> list[int]:
        return self.walk(context, gamma, min_share, min_depth)[0]

    def walk(self, context: list[int], gamma: int, min_share: float, min_depth: int = 1) -> tuple[list[int], float]:
        """(the greedy continuation `continuation` proposes, the share its first token had of its context's count;
        0 when there is none)."""
        if self.pending:
            self._flush()
        out, ctx, first = [], list(context[-self.depth:]), 0.0
        while len(out) < gamma:
            counts = self._counts(ctx, min_depth)
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            share = count / sum(counts.values())
            if share < min_share:
                break
            first = first or share
            out.append(token)
            ctx = (ctx + [token])[-self.depth:]
        return out, first


    def tree(self, context: list[int], budget: int, depth: int, min_share: float, min_depth: int = 1):
        """(tokens, parents) of a tree of up to `budget` nodes and `depth` levels, grown best first by the product
        of shares along each path; a node's children are the continuations with share >= min_share."""
        if self.pending:
            self._flush()
        tokens, parents = [], []
        heap = [(-1.0, 0, -1, list(context[-self.depth:]))]       # (-path share, tie, node, its context)
        tie = 1
        while heap and len(tokens) < budget:
            score, _, node, ctx = heapq.heappop(heap)
            level = 0 if node < 0 else _level(parents, node) + 1
            if level >= depth:
                continue
            counts = self._counts(ctx, min_depth)
            if counts is None:
                continue
            total = sum(counts.values())
            for token, count in counts.most_common():
                share = count / total
                if share < min_share or len(tokens) >= budget:
                    break
                tokens.append(token)
                parents.append(node)
                heapq.heappush(heap, (score * share, tie, len(tokens) - 1, (ctx + [token])[-self.depth:]))
                tie += 1
        return tokens, parents

    def _counts(self, ctx, min_depth):
        """The next-token counts of the longest indexed suffix of `ctx` (at least min_depth tokens), or None."""
        for n in range(min(self.depth, len(ctx)), min_depth - 1, -1):
            counts = self.next.get(tuple(ctx[-n:]))
            if counts:
                return counts
        return None


def share_bucket(share: float) -> int:
    """A continuation's first share as a feature: 0 none, 1 below 1/2, 2 below 0.8, 3 below 1, 4 always seen."""
    if share <= 0:
        return 0
    return 1 if share < 0.5 else 2 if share < 0.8 else 3 if share < 1 else 4


def _level(parents: list[int], node: int) -> int:
    level = 0
    while parents[node] >= 0:
        node, level = parents[node], level + 1
    return level


class SuffixDrafter(Trees, JoinsRows):
    """Batched, per row. Every row's prompt and committed tokens are indexed as they appear, so the drafter also
    does prompt lookup; the index outlives the call. Each drafter has its own index unless one is passed: sharing is
    explicit (`index = SuffixIndex(); SuffixDrafter(index); SuffixDrafter(index)`), so one caller's text never
    reaches another's drafts by default."""

    def __init__(self, index: SuffixIndex | None = None, min_share: float = 0.3, min_depth: int = 2):
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"SuffixDrafter(min_share) must be within [0, 1], got {min_share!r}.")
        self.index = index if index is not None else SuffixIndex()
        self.min_share, self.min_depth = min_share, min_depth
        self.pad, self.indexed = None, None

    def begin(self, input_ids, attention_mask):
        self.pad = left_padding(input_ids, attention_mask)
        self.indexed = [0] * len(self.pad)   # per user row: tokens of its context already in the index

    def add_rows(self, input_ids, attention_mask, rows):
        more = left_padding(input_ids, attention_mask)
        self.pad, self.indexed = place(self.pad, rows, more), place(self.indexed, rows, [0] * len(more))

    def propose(self, request: DraftRequest) -> Proposal:
        tokens = request.tokens.cpu()
        drafts, shares = [], []
        for b, (row, length, gamma) in enumerate(
            zip(request.rows.tolist(), request.lengths.tolist(), request.gammas.tolist())
        ):
            context = tokens[b, self.pad[row] : length].tolist()
            self.index.add(context, start=self.indexed[row])
            self.indexed[row] = len(context)
            if request.depths is not None:
                depth = int(request.depths[b])
                drafts.append(self.index.tree(context, gamma, depth, self.min_share, self.min_depth) if gamma
                              else ([], []))
                continue
            found, share = self.index.walk(context, gamma, self.min_share, self.min_depth) if gamma else ([], 0.0)
            drafts.append(torch.tensor(found, dtype=torch.long))
            shares.append(share_bucket(share))
        if request.depths is not None:
            return pack_trees(drafts, request.tokens.device)
        proposal = Proposal.pack(drafts, request.tokens.device)
        proposal.telemetry = {"feature": shares}      # the first token's share of its context, bucketed
        return proposal

    def end(self, tokens=None, lengths=None):
        if tokens is None or self.pad is None:
            return
        for row, (pad, length) in enumerate(zip(self.pad, lengths.tolist())):
            self.index.add_later(tokens[row, pad:length].tolist(), start=self.indexed[row])
        self.pad = self.indexed = None
