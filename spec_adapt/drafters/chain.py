"""Multi-level chains (SpecRouter): M_1 drafts, each intermediate model verifies the surviving prefix, the target last.

A `ChainDrafter` is itself a Drafter, so the loop does not change. For levels [D_1, M_2, ..., M_{N-1}]:
1. D_1 (any drafter: a model, prompt lookup, ...) proposes up to W tokens;
2. each intermediate model M_j scores [its pending committed tokens, proposal] in one forward pass and applies the
   target's own acceptance rule to the proposal: greedy match against its argmax, or rejection sampling against the
   previous level's probabilities. It keeps the accepted prefix and appends its own recovered (or bonus) token;
   in sampling mode the proposal's probabilities become M_j's. Rejections caught early never reach the target.
3. what survives goes to the target, which verifies it exactly as any proposal: the output stays the target's own
   (greedy), or has exactly the target's distribution (sampling: every surviving token is distributed as its
   level's q given the prefix, which is what the target's rejection test needs).
Every model keeps its own KV ledger and rolls back to the committed prefix with everyone else (per row, holes, no
data movement). An intermediate level that fails (out of memory included) is dropped for the rest of the call,
the proposal of the level below is used instead, and `events` says what happened; nothing committed is lost.
`use(levels)` selects which levels run (a ChainScheduler calls it): level 0 always drafts.
"""

from __future__ import annotations

import time

import torch

from .. import fast
from ..accept import committed_tokens, sample_randoms
from ..ledger import KVLedger
from .base import Drafter, DraftRequest, Proposal, with_drafts
from .model import ModelDrafter, _vocab_size


class VerifierLevel:
    """One intermediate model: scores a proposal in one pass and keeps what its acceptance rule keeps."""

    def __init__(self, model):
        self.model = model
        self.ledger: KVLedger | None = None
        self.vocab = None

    def begin(self, input_ids, attention_mask):
        self.ledger = KVLedger(self.model)
        self.ledger.prefill(input_ids, attention_mask)

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
        logits = self.ledger.forward(chunk, pending + n)                             # [B, W', V']
        # Position i of the proposal is scored by the chunk position just before it.
        pos = (pending[:, None] - 1 + torch.arange(width + 1, device=device)[None, :]).clamp(max=chunk_width - 1)
        scores = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))[..., : self.vocab].float()
        scores = request.process.positions(scores, context, lengths, n + 1, request.rows.to(device))
        if request.sampling:
            probs = scores.softmax(-1)
            u, e = sample_randoms(batch, width, probs.shape[-1], device)
            q = proposal.probs.to(device) if proposal.probs is not None else None
            accepted, nxt = fast.rejection(probs, drafts, q, n, u, e)
            if q is not None and width:
                stats["tv"].append(_total_variation(probs[:, :width], q, n))
        else:
            probs = None
            accepted, nxt = fast.greedy(scores, drafts, n)
        stats["drafted"] += int(n.sum())
        stats["accepted"] += int(accepted.sum())
        stats["tried"] += int((accepted + (accepted < n).long()).sum())   # positions where a decision was made
        self.ledger.rollback(lengths + accepted)        # keep committed + accepted; the new token is pending
        out_len = torch.minimum(accepted + 1, gammas.to(device))
        out_tokens = committed_tokens(drafts, accepted, nxt, fill=0)[:, : max(int(out_len.max()), 0)]
        out_probs = probs[:, : out_tokens.shape[1]] if probs is not None else None
        return Proposal(out_tokens.to(back), out_len.to(back), out_probs.to(back) if out_probs is not None else None)

    def rollback(self, keep_len):
        self.ledger.rollback(keep_len)

    def select_rows(self, index):
        self.ledger.select_rows(index)

    def lag(self, lengths):
        return lengths.to(self.ledger.device) - self.ledger.n_cached


def _total_variation(p, q, n):
    """Mean D_TV(p, q) over the proposal positions that exist (n[b] per row)."""
    tv = 0.5 * (p - q).abs().sum(-1)                                                 # [B, S]
    mask = torch.arange(p.shape[1], device=p.device)[None, :] < n[:, None]
    return float(tv[mask].mean()) if bool(mask.any()) else 0.0


class ChainDrafter(Drafter):
    """levels[0]: any drafter (a model becomes a ModelDrafter); levels[1:]: intermediate verifier models, in order
    of capability. The target is the model `generate` is called on."""

    def __init__(self, levels: list):
        if len(levels) < 1:
            raise ValueError("A chain needs at least one level below the target.")
        first = levels[0]
        self.first = first if isinstance(first, Drafter) else ModelDrafter(first)
        self.verifiers = [VerifierLevel(m) for m in levels[1:]]
        self.active = list(range(len(self.verifiers)))      # intermediate levels in use (indices into verifiers)
        self.failed: set[int] = set()
        self.events: list[str] = []
        self.reset_stats()

    def reset_stats(self) -> None:
        """Per-level counters since the last reset: drafted/accepted at each verifier, seconds spent, D_TV."""
        self.level_stats = [{"drafted": 0, "accepted": 0, "tried": 0, "seconds": 0.0, "calls": 0, "tokens": 0,
                             "tv": []}
                            for _ in range(len(self.verifiers) + 1)]

    def use(self, levels: list[int]) -> None:
        """Run only these intermediate levels (indices into levels[1:]); [] = a plain 2-level draft."""
        self.active = [i for i in levels if i not in self.failed]

    def validate(self, target):
        self.first.validate(target)
        for level in self.verifiers:
            ModelDrafter(level.model).validate(target)
            level.vocab = _vocab_size(target)

    def begin(self, input_ids, attention_mask):
        self.failed.clear()
        self.first.begin(input_ids, attention_mask)
        for i, level in enumerate(self.verifiers):
            self._guarded(i, level.begin, input_ids, attention_mask)

    def propose(self, request: DraftRequest) -> Proposal:
        start = time.perf_counter()
        proposal = self.first.propose(request)
        first = self.level_stats[0]
        first["seconds"] += time.perf_counter() - start
        first["calls"] += 1
        first["tokens"] += int(proposal.lengths.sum())
        for i in self.active:
            if i in self.failed or not bool((proposal.lengths > 0).any()):
                continue
            start = time.perf_counter()
            stats = self.level_stats[i + 1]
            checked = self._guarded(i, self.verifiers[i].verify, request, proposal, request.gammas, stats)
            stats["seconds"] += time.perf_counter() - start
            stats["calls"] += 1
            if checked is not None:
                proposal = checked
        return proposal

    def rollback(self, keep_len):
        self.first.rollback(keep_len)
        for i, level in enumerate(self.verifiers):
            if i not in self.failed:
                self._guarded(i, level.rollback, keep_len)

    def select_rows(self, index):
        self.first.select_rows(index)
        for i, level in enumerate(self.verifiers):
            if i not in self.failed:
                self._guarded(i, level.select_rows, index)

    def lag(self, lengths):
        return self.first.lag(lengths)

    def end(self, tokens=None, lengths=None):
        self.first.end(tokens, lengths)
        for level in self.verifiers:
            level.ledger = None

    def _guarded(self, i, fn, *args):
        """Run a level's method; on failure drop that level for the rest of the call (committed tokens are safe)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a failing level must not end the user's call
            self.failed.add(i)
            self.active = [j for j in self.active if j != i]
            self.verifiers[i].ledger = None
            self.events.append(f"level {i + 1} dropped: {type(exc).__name__}: {exc}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None
