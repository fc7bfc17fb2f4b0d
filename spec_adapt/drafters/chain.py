"""Multi-level chains (SpecRouter): M_1 drafts, each intermediate model verifies the surviving prefix, the target last.

A `ChainDrafter` is itself a Drafter, so the loop does not change. For levels [D_1, M_2, ..., M_{N-1}]:
1. D_1 (any drafter: a model, prompt lookup, ...) proposes up to W tokens;
2. each intermediate model M_j scores [its pending committed tokens, proposal] in one forward pass and applies the
   target's own acceptance rule to the proposal: greedy match against its argmax; sampling, the call's rule: the
   coupled rule (its own argmax of scores plus the step's keyed noise, the noise the target uses next) or rejection
   sampling against the previous level's probabilities. It keeps the accepted prefix and appends its own recovered
   (or bonus) token; in sampling mode the proposal's probabilities become M_j's. Rejections caught early never reach
   the target.
3. what survives goes to the target, which verifies it exactly as any proposal: the output stays the target's own
   (greedy), or has exactly the target's distribution (sampling: the coupled rule commits the target's noisy argmax
   whatever survives; under rejection sampling every surviving token is distributed as its level's q given the
   prefix, which is what the target's rejection test needs).
Every model keeps its own KV ledger and rolls back to the committed prefix with everyone else (per row, holes, no
data movement). An intermediate level that fails (out of memory included) is dropped for the rest of the call,
the proposal of the level below is used instead, and `events` says what happened; nothing committed is lost.
Which members run is the policy's plan (`Plan(gammas, members)` from a ChainScheduler reaches `propose` as
`DraftRequest.members`; `use(members)` sets the default for steps without a plan): indices into `levels`, ascending;
the first member drafts (level 0, or an intermediate model drafting on its own, as in a plain [M_j -> target] pair)
and the rest verify in order. Every chain ending in the target is thus available. Each step's per-level counts and
times go back in `Proposal.telemetry` (the loop hands them to the policy in the StepRecord), and each level's lag
through `level_lags`: nothing a policy reads is an attribute it pokes.
"""

from __future__ import annotations

import time

import torch

from ..acceptance_rules import committed_tokens
from ..acceptor import Acceptor
from .drafter import (CatchUp, Chains, ChecksTarget, Drafter, DraftRequest, Events, JoinsRows, Proposal, TakesInputs,
                   join_rows, lag_of, with_drafts)
from .model import ModelDrafter


class VerifierLevel(ModelDrafter):
    """One intermediate model: scores a proposal in one pass and keeps what its acceptance rule keeps. As a
    ModelDrafter it can also draft on its own (`propose`), over the same KV ledger, when the chain starts at it."""

    def verify(self, request: DraftRequest, proposal: Proposal, gammas: torch.Tensor, stats: dict) -> Proposal:
        device, back = self.ledger.device, request.tokens.device
        tokens, lengths = request.tokens.to(device), request.lengths.to(device)
        drafts, n = proposal.tokens.to(device), proposal.lengths.to(device)
        batch, width = drafts.shape
        pending = lengths - self.ledger.n_cached                                     # >= 1 committed tokens
        chunk_width = int((pending + n).max())
        offset = torch.arange(chunk_width, device=device)[None, :]
        index = (self.ledger.n_cached[:, None] + offset).clamp(max=tokens.shape[1] - 1)
        context = with_drafts(tokens, lengths, drafts)
        chunk = context.gather(1, index)
        # Position i of the proposal is scored by the chunk position just before it.
        pos = (pending[:, None] - 1 + torch.arange(width + 1, device=device)[None, :]).clamp(max=chunk_width - 1)
        logits = self.ledger.forward(chunk, pending + n, columns=pos)                # [B, width + 1, V']
        scores = logits[..., : self.vocab].float()
        scores = request.process.positions(scores, context, lengths, n + 1, request.rows.to(device))
        # The target's own acceptance rule (the call's acceptor), so a level keeps exactly what the target would.
        acceptor = request.acceptor or Acceptor()
        q = proposal.probs.to(device) if request.sampling and proposal.probs is not None else None
        accepted, nxt = acceptor.accept(scores, drafts, q, n, request.sampling, request.noise)
        probs = scores.softmax(-1) if request.sampling else None
        if q is not None and width:
            stats["tv"].append(_total_variation(probs[:, :width], q, n))
        stats["drafted"] += int(n.sum())
        stats["accepted"] += int(accepted.sum())
        stats["tried"] += int((accepted + (accepted < n).long()).sum())   # positions where a decision was made
        self.ledger.rollback(lengths + accepted)        # keep committed + accepted; the new token is pending
        out_len = torch.minimum(accepted + 1, gammas.to(device))
        out_tokens = committed_tokens(drafts, accepted, nxt, fill=0)[:, : max(int(out_len.max()), 0)]
        out_probs = probs[:, : out_tokens.shape[1]] if probs is not None else None
        return Proposal(out_tokens.to(back), out_len.to(back), out_probs.to(back) if out_probs is not None else None)


def _total_variation(p, q, n):
    """Mean D_TV(p, q) over the proposal positions that exist (n[b] per row)."""
    tv = 0.5 * (p - q).abs().sum(-1)                                                 # [B, S]
    mask = torch.arange(p.shape[1], device=p.device)[None, :] < n[:, None]
    return float(tv[mask].mean()) if bool(mask.any()) else 0.0


class ChainDrafter(CatchUp, Chains, JoinsRows, Events, ChecksTarget, TakesInputs):
    """levels[0]: any drafter (a model becomes a ModelDrafter); levels[1:]: intermediate verifier models, in order
    of capability. The target is the model `generate` is called on."""

    def __init__(self, levels: list):
        if len(levels) < 1:
            raise ValueError("A chain needs at least one level below the target.")
        first = levels[0]
        self.first = first if isinstance(first, Drafter) else ModelDrafter(first)
        self.verifiers = [VerifierLevel(m) for m in levels[1:]]
        self.members = list(range(len(levels)))   # default chain: indices into levels, the first one drafts
        self.last_members = self.members            # the chain the last step ran
        self.failed: set[int] = set()               # intermediate levels dropped for this call (indices into levels)
        self.events: list[str] = []                 # this call's level failures

    def new_level_stats(self) -> list[dict]:
        """One step's per-level counters: as a verifier (drafted/accepted/tried, seconds and calls, D_TV) and as
        the drafter (draft_seconds, draft_tokens, draft_calls)."""
        return [{"drafted": 0, "accepted": 0, "tried": 0, "seconds": 0.0, "calls": 0, "tv": [],
                 "draft_seconds": 0.0, "draft_tokens": 0, "draft_calls": 0}
                for _ in range(len(self.verifiers) + 1)]

    def use(self, members: list[int]) -> None:
        """Run this chain on steps without a plan: ascending indices into levels ([0] = a plain 2-level draft with
        level 0, [0, 2] = level 0 drafts and level 2 verifies, [1] = level 1 drafts alone)."""
        self.check_members(members)
        self.members = list(members)

    def check_members(self, members) -> None:
        members = list(members)
        if not members or members != sorted(set(members)) or not 0 <= members[0] <= members[-1] <= len(self.verifiers):
            raise ValueError(f"A chain's members are ascending level indices within 0..{len(self.verifiers)}, got "
                             f"{members!r}.")

    def _chain(self, members=None) -> list[int]:
        members = [m for m in (members if members is not None else self.members) if m not in self.failed]
        return members or [0]

    def validate(self, target):
        if isinstance(self.first, ChecksTarget):
            self.first.validate(target)
        for level in self.verifiers:
            level.validate(target)

    def share_inputs(self, inputs):
        for level in (self.first, *self.verifiers):
            if isinstance(level, TakesInputs):
                level.share_inputs(inputs)

    def begin(self, input_ids, attention_mask):
        self.failed.clear()
        self.events = []
        self.first.begin(input_ids, attention_mask)
        for i, level in enumerate(self.verifiers):
            self._guarded(i + 1, level.begin, input_ids, attention_mask)

    def propose(self, request: DraftRequest) -> Proposal:
        level_stats = self.new_level_stats()
        proposal, members = self._draft(request, self._chain(request.members), level_stats)
        for m in members[1:]:
            # A level runs even where the level below proposed nothing (prompt lookup often has no match): it
            # still adds its own next token, which is what a level costs and gives in the scheduler's model.
            if m in self.failed or not bool((request.gammas > 0).any()):
                continue
            start = time.perf_counter()
            stats = level_stats[m]
            checked = self._guarded(m, self.verifiers[m - 1].verify, request, proposal, request.gammas, stats)
            stats["seconds"] += time.perf_counter() - start
            stats["calls"] += 1
            if checked is not None:
                proposal = checked
        self.last_members = [m for m in members if m not in self.failed]
        proposal.telemetry = {"members": list(self.last_members), "levels": level_stats}
        return proposal

    def _draft(self, request: DraftRequest, members: list[int], level_stats) -> tuple[Proposal, list[int]]:
        """The first member drafts; an intermediate model that fails while drafting is dropped and level 0 drafts
        instead. Returns the proposal and the members still to verify it (first one included)."""
        first = members[0]
        start = time.perf_counter()
        proposal = None
        if first > 0:
            proposal = self._guarded(first, self.verifiers[first - 1].propose, request)
            if proposal is None:
                first, members = 0, [0] + [m for m in members if m not in self.failed]
                start = time.perf_counter()
        if proposal is None:
            proposal = self.first.propose(request)
        stats = level_stats[first]
        stats["draft_seconds"] += time.perf_counter() - start
        stats["draft_calls"] += 1
        stats["draft_tokens"] += int(proposal.lengths.sum())
        return proposal, members

    def add_rows(self, input_ids, attention_mask, rows):
        join_rows(self.first, input_ids, attention_mask, rows)
        for i, level in enumerate(self.verifiers, start=1):
            if i not in self.failed:
                self._guarded(i, level.add_rows, input_ids, attention_mask, rows)

    def rollback(self, keep_len):
        self.first.rollback(keep_len)
        for i, level in enumerate(self.verifiers, start=1):
            if i not in self.failed:
                self._guarded(i, level.rollback, keep_len)

    def select_rows(self, index):
        self.first.select_rows(index)
        for i, level in enumerate(self.verifiers, start=1):
            if i not in self.failed:
                self._guarded(i, level.select_rows, index)

    def _lags(self, lengths) -> list:
        return [lag_of(self.first, lengths)] + [None if i in self.failed else level.lag(lengths)
                                            for i, level in enumerate(self.verifiers, start=1)]

    def lag(self, lengths):
        """The lag of the level that drafted last."""
        return self._lags(lengths)[self._chain(self.last_members)[0]]

    def level_lags(self, lengths):
        """Every level's largest lag (0 for a model-free or dropped level): which chain is cheapest depends on who
        must catch up after target-only steps."""
        return [int(x.max()) if x is not None and x.numel() else 0 for x in self._lags(lengths)]

    def end(self, tokens=None, lengths=None):
        self.first.end(tokens, lengths)
        for level in self.verifiers:
            level.end()

    def _guarded(self, i, fn, *args):
        """Run level i's method (i >= 1: an intermediate model); on failure drop that level for the rest of the
        call (committed tokens are safe)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a failing level must not end the user's call
            self.failed.add(i)
            self.verifiers[i - 1].end()                # frees its KV ledger
            self.events.append(f"level {i} dropped: {type(exc).__name__}: {exc}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None
