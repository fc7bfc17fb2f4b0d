"""Several drafting sources in one step: a draft model beside model-free sources (prompt lookup, the suffix index),
chosen per row and per step and verified together in one forward.

Each step, for each row:
1. every model-free source proposes what it finds for the row (a search of its tokens: no forward), with a feature:
   the matched n-gram's length for prompt lookup, the first token's share of its context for the suffix index;
2. the router predicts for each option the tokens the row commits and the step's seconds, and takes the option with
   the most tokens per second:
   - the draft model at the width the policy asked (only where it asked for drafts);
   - a model-free proposal, cut to its best length (up to `max_free` tokens, even where the policy asked none);
   - nothing (a plain step for the row).
   Tokens: `SourceAcceptance`, the survival per draft position learned per source and feature. Seconds:
   `StepCost`, the verification at that width and batch size, plus the draft model's time per token when it drafts;
3. the draft model runs only for the rows that chose it: none, and the step runs no draft forward;
4. the rows' drafts become one Proposal (`Proposal.free` marks the model-free rows).

Exactness, the rule: a row's source is chosen from its committed tokens and from what earlier steps taught, never
from a random draw of this step. The model-free sources are deterministic functions of the committed tokens and
propose point masses (q = 1 at each drafted token); the draft model's rows carry the draft's own distributions. So
each row's drafts come from one proposal distribution fixed before anything is sampled, and rejection sampling
against it keeps the target's distribution exactly. Greedy output is the target's greedy tokens whatever is drafted.

Learning: a model-free source is judged on every row it offered something for, chosen or not, in hindsight: at the
next step its offer is compared with the tokens the target committed. The draft model is judged on the rows it
drafted. Both are kept in a `SourceState`, which the default drafter of a target shares across calls.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from ..policies.estimators import SourceAcceptance, StepCost
from .base import Drafter, DraftRequest, Proposal
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .suffix import SuffixDrafter

PLAIN, MODEL = -1, 0      # a row's choice: no drafts, the draft model; i >= 1: free source i - 1


class SourceState:
    """What the router learned, shareable by several drafters and calls (thread-safe): per source and feature the
    survival per draft position, and the step-cost model."""

    def __init__(self, max_free: int = 32):
        self.acceptance = SourceAcceptance(positions=max(max_free, 16))
        self.cost = StepCost()
        self.lock = threading.Lock()


class MultiSourceDrafter(Drafter):
    """The draft model and model-free sources, chosen per row and step (module docstring).

    `model`: a draft model (or a `ModelDrafter`, or any Drafter whose drafts cost time per token: the source the
    router charges draft time for), or None for model-free sources only. `free`: the model-free
    drafters (default: `PromptLookupDrafter()` and `SuffixDrafter()`). `max_free`: the most tokens a row takes from
    a model-free source in one step. `state`: a `SourceState` to learn into (shared across calls by the default)."""

    def __init__(self, model=None, free: list | None = None, max_free: int = 32, state: SourceState | None = None):
        if isinstance(max_free, bool) or not isinstance(max_free, int) or not 1 <= max_free <= 256:
            raise ValueError(f"MultiSourceDrafter(max_free) must be an int in [1, 256], got {max_free!r}.")
        if isinstance(model, torch.nn.Module) and hasattr(model, "get_output_embeddings"):
            model = ModelDrafter(model)
        if model is not None and not isinstance(model, Drafter):
            raise TypeError(f"MultiSourceDrafter(model) must be a draft model or a Drafter that drafts with one, "
                            f"got {type(model).__name__}.")
        free = [PromptLookupDrafter(), SuffixDrafter()] if free is None else list(free)
        for source in free:
            if not isinstance(source, Drafter) or isinstance(source, ModelDrafter):
                raise TypeError(f"MultiSourceDrafter(free) takes model-free Drafters (prompt lookup, the suffix "
                                f"index), got {type(source).__name__}.")
        if model is None and not free:
            raise ValueError("MultiSourceDrafter needs a draft model or at least one model-free source.")
        self.model_drafter, self.free, self.max_free = model, free, max_free
        self.names = [_name(s) for s in free]
        self.state = state if state is not None else SourceState(max_free)
        self.trees = model.trees if model is not None else all(s.trees for s in free)
        self._offers = None      # the last step's model-free offers, judged at the next step against what committed
        self._chosen = None      # the last step's choice per row and the model's time
        self.row_counts: dict = {}    # (source, user row) -> [2, positions] decayed counts of this call's steps

    @property
    def model(self):
        """The draft model (None: model-free sources only)."""
        return getattr(self.model_drafter, "model", None)

    @property
    def sources(self) -> list[Drafter]:
        return ([self.model_drafter] if self.model_drafter is not None else []) + self.free

    # -- the lifecycle: every source follows the rows -------------------------------------------------------------
    def validate(self, target) -> None:
        for source in self.sources:
            source.validate(target)

    def share_inputs(self, inputs) -> None:
        for source in self.sources:
            source.share_inputs(inputs)

    def begin(self, input_ids, attention_mask) -> None:
        self._offers = self._chosen = None
        self.row_counts = {}
        for source in self.sources:
            source.begin(input_ids, attention_mask)

    def add_rows(self, input_ids, attention_mask, rows) -> None:
        for key in [k for k in self.row_counts if k[1] in {int(r) for r in rows}]:    # a slot's new request
            del self.row_counts[key]
        for source in self.sources:
            source.add_rows(input_ids, attention_mask, rows)

    def available(self) -> bool:
        return True       # a model away (offloaded) leaves the free sources

    def lag(self, lengths):
        """The draft model's catch-up on rows it has never read (their prompt): a row that drafted from a free source
        for a while catches up on a few tokens in the forward it drafts with, which the router's measured draft
        time already holds."""
        ledger = getattr(self.model_drafter, "ledger", None)     # a Drafter in the model slot may keep none
        if ledger is None:
            return None
        lag = lengths.to(ledger.device) - ledger.n_cached
        return torch.where(ledger.n_cached == ledger.pad, lag, 0)

    def rollback(self, keep_len) -> None:
        for source in self.sources:
            source.rollback(keep_len)

    def keep_tree(self, path) -> None:
        for source in self.sources:
            source.keep_tree(path)

    def select_rows(self, index) -> None:
        for source in self.sources:
            source.select_rows(index)

    def end(self, tokens=None, lengths=None) -> None:
        self._offers = self._chosen = None
        for source in self.sources:
            source.end(tokens, lengths)

    # -- the step -------------------------------------------------------------------------------------------------
    def propose(self, request: DraftRequest) -> Proposal:
        self._judge_offers(request)
        if request.depths is not None or request.free is None:
            return self._single(request)
        batch, device = len(request.gammas), request.tokens.device
        free_request = dataclasses.replace(request, gammas=request.free, free=None, stop=None, members=None)
        offers = [source.propose(free_request) for source in self.free]
        features = [(offer.telemetry or {}).get("feature") or [0] * batch for offer in offers]
        gammas = request.gammas if self.model_drafter is not None else torch.zeros_like(request.gammas)
        choice, cut = self.route(batch, gammas.tolist(), [o.lengths.tolist() for o in offers], features,
                                 request.rows.tolist())
        self._offers = {"rows": request.rows.clone(), "lengths": request.lengths.clone(),
                        "offers": [(o.tokens.cpu(), o.lengths.cpu(), f) for o, f in zip(offers, features)]}
        model, seconds = self._model_proposal(request, choice)
        self._chosen = {"choice": choice, "features": features, "model_seconds": seconds}
        return self._merge(request, choice, cut, offers, model, batch, device)

    def route(self, batch: int, gammas: list[int], lengths: list[list[int]], features: list[list[int]],
              rows: list[int] | None = None):
        """Per row, the option with the most predicted tokens per second: (choice [B] list: PLAIN, MODEL or free
        source i + 1; cut [B] list: the drafts it takes). `gammas`: the policy's width per row (0: no model);
        `lengths[i][b]`, `features[i][b]`: free source i's offer for row b; `rows`: the user's row numbers (each
        row's own record with each source counts, shrunk toward the source's rates for the feature)."""
        rows = rows if rows is not None else list(range(batch))
        cost, acceptance = self.state.cost, self.state.acceptance
        with self.state.lock:
            verify = [cost.verify_time(batch, w + 1) for w in range(self.max_free + 1)]
            per_token = cost.draft_time("model", batch, 1)
            choice, cut = [], []
            for b in range(batch):
                best = (1.0 / verify[0], PLAIN, 0)
                g = min(gammas[b], self.max_free)
                if g > 0:
                    tokens = float(acceptance.expected("model", 0, g, self.row_counts.get(("model", rows[b])))[g])
                    best = (tokens / (verify[g] + per_token * g), MODEL, gammas[b])
                for i, name in enumerate(self.names):
                    n = min(lengths[i][b], self.max_free)
                    if n <= 0:
                        continue
                    own = self.row_counts.get((name, rows[b]))
                    rates = acceptance.expected(name, features[i][b], n, own) / torch.tensor(verify[: n + 1])
                    k = int(rates.argmax())
                    if k > 0 and float(rates[k]) > best[0]:
                        best = (float(rates[k]), i + 1, k)
                choice.append(best[1])
                cut.append(best[2])
        return choice, cut

    def _single(self, request: DraftRequest) -> Proposal:
        """Tree plans and loops that allow no free drafts: the draft model (else the first free source) as one
        source would draft."""
        source = self.model_drafter if self.model_drafter is not None else self.free[0]
        request = dataclasses.replace(request, free=None)
        proposal = source.propose(request)
        name = "model" if source is self.model_drafter else self.names[0]
        proposal.telemetry = {**(proposal.telemetry or {}),
                              "source": [name if g else None for g in request.gammas.tolist()]}
        self._chosen = None
        return proposal

    def _model_proposal(self, request: DraftRequest, choice: list[int]):
        """The draft model's proposal for the rows that chose it (None when none did), and its seconds."""
        wants = torch.tensor([c == MODEL for c in choice], device=request.gammas.device)
        if self.model_drafter is None or not bool(wants.any()):
            return None, 0.0
        start = time.perf_counter()
        gammas = torch.where(wants, request.gammas, 0)
        proposal = self.model_drafter.propose(dataclasses.replace(request, gammas=gammas, free=None))
        return proposal, time.perf_counter() - start

    def _merge(self, request, choice, cut, offers, model, batch, device) -> Proposal:
        """One Proposal: each row's drafts from its chosen source; under sampling the draft model's distributions
        for its rows and point masses (one-hot) for the free rows."""
        lengths = torch.zeros(batch, dtype=torch.long)
        rows_tokens = []
        for b, (c, k) in enumerate(zip(choice, cut)):
            if c == MODEL:
                n = int(model.lengths[b])
                rows_tokens.append(model.tokens[b, :n].cpu())
            elif c > 0:
                n = min(k, int(offers[c - 1].lengths[b]))
                rows_tokens.append(offers[c - 1].tokens[b, :n].cpu())
            else:
                n = 0
                rows_tokens.append(torch.zeros(0, dtype=torch.long))
            lengths[b] = n
        width = int(lengths.max()) if batch else 0
        tokens = torch.zeros(batch, width, dtype=torch.long)
        for b, row in enumerate(rows_tokens):
            tokens[b, : len(row)] = row
        free = torch.tensor([c > 0 for c in choice], dtype=torch.bool)
        tokens, lengths, free = tokens.to(device), lengths.to(device), free.to(device)
        probs = confidence = None
        if model is not None and model.probs is not None:
            probs = torch.nn.functional.one_hot(tokens, model.probs.shape[-1]).float()
            mine = ~free & (lengths > 0)
            span = min(width, model.probs.shape[1])
            probs[mine, :span] = model.probs[mine, :span].to(probs.dtype)
        if model is not None and model.confidence is not None:
            confidence = torch.zeros(batch, width, device=device)
            span = min(width, model.confidence.shape[1])
            confidence[:, :span] = torch.where(free[:, None], 0.0, model.confidence[:, :span].to(device))
        names = ["model" if c == MODEL else self.names[c - 1] if c > 0 else None for c in choice]
        return Proposal(tokens, lengths, probs, {"source": names}, None, confidence, free)

    # -- learning -------------------------------------------------------------------------------------------------
    def observe(self, record) -> None:
        for source in self.sources:
            source.observe(record)
        cost = self.state.cost
        chosen, self._chosen = self._chosen, None
        widest = max(record.drafted, default=0)
        with self.state.lock:
            cost.observe_verify(record.batch_size, widest + 1, record.verify_time)
            if chosen is None:
                return
            model_rows = [b for b, c in enumerate(chosen["choice"]) if c == MODEL]
            if model_rows:
                drafted = max(record.drafted[b] for b in model_rows)
                cost.observe_draft("model", record.batch_size, drafted, chosen["model_seconds"])
                for b in model_rows:
                    self._learn("model", record.rows[b], 0, record.drafted[b], record.accepted[b])

    def _judge_offers(self, request: DraftRequest) -> None:
        """The last step's model-free offers against the tokens the target committed since (hindsight): each
        source's survival per position learns from every row it offered something for."""
        offers, self._offers = self._offers, None
        if offers is None:
            return
        now = {int(r): b for b, r in enumerate(request.rows.tolist())}
        tokens = request.tokens.cpu()
        with self.state.lock:
            for j, row in enumerate(offers["rows"].tolist()):
                b = now.get(int(row))
                if b is None:
                    continue
                start = int(offers["lengths"][j])
                done = int(request.lengths[b]) - start        # tokens committed since the offer
                for i, (drafts, counts, features) in enumerate(offers["offers"]):
                    n = min(int(counts[j]), done)
                    if n <= 0:
                        continue
                    same = (drafts[j, :n] == tokens[b, start : start + n]).long()
                    matched = int(same.cumprod(0).sum())
                    drafted = matched if matched == n else n      # all matched: nothing is known beyond n
                    self._learn(self.names[i], int(row), features[j], drafted, matched)

    def _learn(self, source: str, row: int, feature: int, drafted: int, accepted: int) -> None:
        """One row's step with a source: into the shared rates per feature and the row's own counts."""
        if drafted <= 0:
            return
        acceptance = self.state.acceptance
        acceptance.observe(source, feature, drafted, accepted)
        old = self.row_counts.get((source, row))
        step = acceptance.step_counts(drafted, accepted)
        self.row_counts[(source, row)] = step if old is None else old * acceptance.decay + step


def _name(source: Drafter) -> str:
    if isinstance(source, PromptLookupDrafter):
        return "lookup"
    if isinstance(source, SuffixDrafter):
        return "suffix"
    return type(source).__name__
