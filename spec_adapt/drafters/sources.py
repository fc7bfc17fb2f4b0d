"""Several drafting sources in one step: a draft model beside model-free sources (prompt lookup, the suffix index),
chosen per row and per step and verified together in one forward.

Each step, for each row:
1. every model-free source proposes what it finds for the row (a search of its tokens: no forward), with a feature:
   the matched n-gram's length for prompt lookup, the first token's share of its context for the suffix index, each
   learned apart on a row's opening step (where a copy of the prompt most often goes wrong);
2. the router predicts for each row's options the tokens it commits, and for the step its seconds, and takes the
   step with the most tokens per second. A row's options:
   - the draft model at the width the policy asked (only where it asked for drafts);
   - a model-free proposal, cut to a length (up to `max_free` tokens, even where the policy asked none);
   - nothing (a plain step for the row; not for a row the policy asked to draft).
   Tokens: `SourceAcceptance`, the survival per draft position learned per source and feature. Seconds:
   the call's `StepCost` (`DraftRequest.cost`, read only: the router learns no times), the verification
   of the widest row's drafts at this batch size, plus the draft model's time to draft the widest model row's
   width (a line a + d k). One verification serves the batch, so a long offer has to pay for every row's longer
   step, not just its own (`route`);
3. the draft model runs only for the rows that chose it: none, and the step runs no draft forward;
4. the rows' drafts become one Proposal (`Proposal.free` marks the model-free rows).

Exactness, the rule: a row's source is chosen from its committed tokens and from what earlier steps taught, never
from a random draw of this step. The model-free sources are deterministic functions of the committed tokens and
propose point masses (q = 1 at each drafted token); the draft model's rows carry the draft's own distributions. So
each row's drafts come from one proposal distribution fixed before anything is sampled, and rejection sampling
against it keeps the target's distribution exactly. Greedy output is the target's greedy tokens whatever is drafted.

Learning: a model-free source is judged on every row it offered something for, chosen or not, in hindsight: at the
next step its offer is compared with the tokens the target committed. The draft model is judged on the rows it
drafted only, so its rates are read optimistically (`MODEL_OPTIMISM`). Both are kept in a `SourceState`, which the
default drafter of a target shares across calls.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import torch

from ..policies.policy import USUAL_LAG
from ..policies.cost import CostReader, StepCost
from ..policies.estimators import SourceAcceptance, widened
from .drafter import (CatchUp, ChecksTarget, Drafter, DraftRequest, Features, Forwards, FreeSources, JoinsRows, Observes,
                   Offloads, Proposal, ReadsTarget, TakesInputs, Trees, join_rows, lag_of, place)
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .suffix import SuffixDrafter

PLAIN, MODEL = -1, 0      # a row's choice: no drafts, the draft model; i >= 1: free source i - 1
PRIOR_DRAFT = 0.25        # an unmeasured draft model: a quarter of a one-token verification per token
# The draft model is judged only on the steps it drafts, so its rates are read optimistically, by this many standard
# errors (`SourceAcceptance.expected_rows`); the free sources are judged on every offer and are read as learned.
MODEL_OPTIMISM = 2.0


class SourceState:
    """What the router learned, shareable by several drafters and calls (thread-safe): per source and feature the
    survival per draft position. `cost`: the step costs `route` reads when it is handed none (a router used outside
    a call, which hands it the call's); nothing in the router writes it."""

    def __init__(self, max_free: int = 32):
        self.acceptance = SourceAcceptance(positions=max(max_free, 16))
        self.cost = StepCost(prior_draft=PRIOR_DRAFT)
        self.lock = threading.Lock()


class MultiSourceDrafter(Forwards, Trees, Features, ReadsTarget, JoinsRows, CatchUp, FreeSources, Observes,
                         ChecksTarget, TakesInputs):
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
        with self.state.lock:       # a state kept across calls serves this drafter's width too, wider or not
            self.state.acceptance.grow(max_free)
        self._trees = isinstance(model, Trees) if model is not None else all(isinstance(s, Trees) for s in free)
        self._offers = None      # the last step's model-free offers, judged at the next step against what committed
        self._chosen = None      # the last step's choice per row and the model's time
        self.row_counts: dict = {}    # (source, user row) -> [2, positions] decayed counts of this call's steps
        self.prompt_end: list[int] = []   # per user row: where its prompt ends in the buffer

    @property
    def model(self):
        """The draft model (None: model-free sources only)."""
        return getattr(self.model_drafter, "model", None)

    @property
    def sources(self) -> list[Drafter]:
        return ([self.model_drafter] if self.model_drafter is not None else []) + self.free

    # Trees where its sources draft them; a model source that drafts from the target's own states (a Gemma 4
    # assistant: the target's hidden states and keys) asks the loop for them through the drafter it is given.
    def offers(self, capability) -> bool:
        if capability is Trees:
            return self._trees
        if capability in (Features, ReadsTarget):
            return isinstance(self.model_drafter, capability)
        return True

    @property
    def reads_target(self) -> int:
        return self.model_drafter.reads_target if self.model_drafter is not None else 0

    def take_hidden(self, hidden, count) -> None:
        if isinstance(self.model_drafter, Features):
            self.model_drafter.take_hidden(hidden, count)

    # -- the lifecycle: every source follows the rows -------------------------------------------------------------
    def _each(self, method: str, *args, having: type = Drafter) -> None:
        for source in self.sources:
            if isinstance(source, having):
                getattr(source, method)(*args)

    def validate(self, target) -> None:
        self._each("validate", target, having=ChecksTarget)

    def share_inputs(self, inputs) -> None:
        self._each("share_inputs", inputs, having=TakesInputs)

    def begin(self, input_ids, attention_mask) -> None:
        self._offers = self._chosen = None
        self.row_counts = {}
        self.prompt_end = [input_ids.shape[1]] * len(input_ids)
        self._each("begin", input_ids, attention_mask)

    def add_rows(self, input_ids, attention_mask, rows) -> None:
        for key in [k for k in self.row_counts if k[1] in {int(r) for r in rows}]:    # a slot's new request
            del self.row_counts[key]
        self.prompt_end = place(self.prompt_end, rows, [input_ids.shape[1]] * len(input_ids))
        for source in self.sources:
            join_rows(source, input_ids, attention_mask, rows)

    def lag(self, lengths):
        """The draft model's catch-up per row: its prompt where it has not read it, and the tokens free sources and
        plain steps committed since it last drafted. The policy learns that catch-up apart from the model's time per
        drafted token (`Adaptive._measure`), and the router charges it beyond the usual token or two."""
        return lag_of(self.model_drafter, lengths) if self.model_drafter is not None else None

    def rollback(self, keep_len) -> None:
        self._each("rollback", keep_len)

    def keep_tree(self, path) -> None:
        self._each("keep_tree", path, having=Trees)

    def select_rows(self, index) -> None:
        self._each("select_rows", index)

    def end(self, tokens=None, lengths=None) -> None:
        self._offers = self._chosen = None
        self._each("end", tokens, lengths)

    # -- the step -------------------------------------------------------------------------------------------------
    def propose(self, request: DraftRequest) -> Proposal:
        self._judge_offers(request)
        if request.depths is not None or request.free is None:
            return self._single(request)
        batch, device = len(request.gammas), request.tokens.device
        free_request = dataclasses.replace(request, gammas=request.free, free=None, stop=None, members=None)
        offers = [source.propose(free_request) for source in self.free]
        features = [(offer.telemetry or {}).get("feature") or [0] * batch for offer in offers]
        features = self._with_opening(features, request)
        model_here = self.model_drafter is not None and _available(self.model_drafter)   # not while offloaded
        gammas = request.gammas if model_here else torch.zeros_like(request.gammas)
        lags = self.lag(request.lengths) if model_here else None
        choice, cut = self.route(batch, gammas.tolist(), [o.lengths.tolist() for o in offers], features,
                                 request.rows.tolist(), request.cost, lags.tolist() if lags is not None else None)
        self._offers = {"rows": request.rows.clone(), "lengths": request.lengths.clone(),
                        "offers": [(o.tokens.cpu(), o.lengths.cpu(), f) for o, f in zip(offers, features)]}
        model, seconds = self._model_proposal(request, choice, cut)
        self._chosen = {"choice": choice, "features": features}
        proposal = self._merge(request, choice, cut, offers, model, batch, device)
        if model is not None:      # the draft model's own seconds at the width it drafted, for a policy to learn
            proposal.telemetry["draft_seconds"] = {"model": (int(model.lengths.max()), seconds)}
        return proposal

    def route(self, batch: int, gammas: list[int], lengths: list[list[int]], features: list[list[int]],
              rows: list[int] | None = None, cost=None, lags: list[int] | None = None):
        """The step with the most predicted tokens per second: (choice [B] list: PLAIN, MODEL or free source i + 1;
        cut [B] list: the drafts each row takes). `gammas`: the policy's width per row (0: the draft model is not
        asked; a row it asked drafts from the model or a free source, never nothing); `lengths[i][b]`,
        `features[i][b]`: free source i's offer for row b; `rows`: the user's row numbers (each row's own record
        with each source, shrunk position by position toward the source's rates for the feature, or toward the
        row's own rate a position earlier where that is lower: `SourceAcceptance.expected_rows`); `cost`: the
        call's step-cost model (`DraftRequest.cost`; None: `SourceState.cost`); `lags`: per
        row, the tokens the draft model has to read before it drafts (its prompt, on a row it has never drafted
        for; `lag`).

        One verification serves the whole batch, so the choice is the batch's: for each step width W (the widest
        row's drafts) and with or without the draft model, every row takes its option committing the most tokens
        within W, and the step's time is the verification of W + 1 tokens at this batch size plus, with the model,
        its time to draft the widest model row's width and to catch up on the longest lag of a model row (a prompt it
        has not read costs a forward over it: the call's step-cost model measures it). A row that drafts long makes
        every row's step longer: its tokens must pay for the whole batch's extra time."""
        rows = rows if rows is not None else list(range(batch))
        cost = cost if cost is not None else CostReader(self.state.cost, self.state.lock)
        verify = torch.tensor(cost.verify_times(batch, range(1, self.max_free + 2)))
        unknown = PRIOR_DRAFT * float(verify[0])    # an unmeasured draft model, per token
        drafting = torch.tensor([cost.draft_time("model", batch, k, unknown=unknown) for k in range(self.max_free + 1)])
        with self.state.lock:
            tokens, asked = self._option_tokens(batch, gammas, lengths, features, rows)
        model_widths = torch.tensor(gammas).clamp(max=self.max_free)
        cases = (False, True) if asked.any() else (False,)
        value = torch.empty(len(cases), batch, self.max_free + 1)
        option = torch.empty(len(cases), batch, self.max_free + 1, dtype=torch.long)
        for i, with_model in enumerate(cases):               # every step width at once: [B, options, widths]
            table = tokens if with_model else torch.cat([tokens[:, :-1], torch.full_like(tokens[:, -1:], -math.inf)], 1)
            value[i], option[i] = table.max(dim=1)            # first best: free before model, plain first
        model_rows = option == tokens.shape[1] - 1                                      # [cases, B, widths]
        model_width = torch.where(model_rows, model_widths[None, :, None], 0).amax(dim=1)   # [cases, widths]
        # The draft model's time at the widest model row's width: a line a + d k, so its first token's overhead
        # (a forward, the catch-up on what committed since) is paid once, not once per token.
        catchup = self._catchup(cost, batch, lags)                        # [B] seconds, were the row's model to draft
        catchup = torch.where(model_rows, catchup[None, :, None], 0.0).amax(dim=1)       # [cases, widths]
        rate = value.sum(dim=1) / (verify + drafting[model_width] + catchup)   # -inf: a row has no option there
        best = int(rate.flatten().argmax())                 # the first best, in the order: without the model first
        case, width = divmod(best, self.max_free + 1)
        option = option[case, :, width]
        return self._choices(option, width, gammas, lengths)

    @staticmethod
    def _catchup(cost, batch: int, lags) -> torch.Tensor:
        """[B]: the seconds the draft model's catch-up on each row's lag adds to a step (none within the usual lag
        of a token or two, which its draft time holds)."""
        lags = lags or [0] * batch
        return torch.tensor([cost.catchup_time("model", batch, int(lag)) if lag > USUAL_LAG else 0.0 for lag in lags])

    def _option_tokens(self, batch, gammas, lengths, features, rows):
        """tokens [B, options, max_free + 1]: what row b commits with each option at step width w (-inf where the
        option is not open to it); options: plain, each free source (cut to w), the draft model (at the width the
        policy asked, so open from that width on). And which rows the policy asked to draft [B] bool."""
        acceptance, most = self.state.acceptance, self.max_free
        tokens = torch.full((batch, len(self.names) + 2, most + 1), -math.inf)
        asked = torch.tensor([g > 0 for g in gammas], dtype=torch.bool)
        tokens[~asked, 0] = 1.0                                 # a plain row commits the target's one token
        widths = torch.arange(1, most + 1)
        offers = [(name, lengths[i], features[i]) for i, name in enumerate(self.names)]
        offers.append(("model", [g if a else 0 for g, a in zip(gammas, asked.tolist())], [0] * batch))
        for slot, (name, offered, feature) in enumerate(offers, start=1):
            n = torch.tensor(offered).clamp(max=most)
            live = n > 0
            if not bool(live.any()):
                continue
            expected = acceptance.expected_rows(name, feature, most, [self.row_counts.get((name, r)) for r in rows],
                                                optimism=MODEL_OPTIMISM if name == "model" else 0.0)
            at_width = expected.gather(1, torch.minimum(widths[None, :], n[:, None]))     # a cut offer, or all of it
            tokens[live, slot, 1:] = at_width[live]
        # The model drafts the width the policy asked (its counts judge that width): open from it.
        model_width = torch.tensor(offers[-1][1]).clamp(max=most)
        tokens[:, -1] = torch.where(torch.arange(most + 1)[None, :] < model_width[:, None], -math.inf, tokens[:, -1])
        return tokens, asked

    def _choices(self, option, width, gammas, lengths):
        """The chosen step as (choice, cut) lists per row."""
        choice, cut = [], []
        for b, o in enumerate(option.tolist()):
            if o == 0:
                choice.append(PLAIN)
                cut.append(0)
            elif o == len(self.names) + 1:
                choice.append(MODEL)
                cut.append(gammas[b])
            else:
                choice.append(o)
                cut.append(min(lengths[o - 1][b], width))
        return choice, cut

    def _single(self, request: DraftRequest) -> Proposal:
        """Tree plans and loops that allow no free drafts: the draft model (else the first free source) as one
        source would draft."""
        model = self.model_drafter is not None and (_available(self.model_drafter) or not self.free)
        source = self.model_drafter if model else self.free[0]
        request = dataclasses.replace(request, free=None)
        proposal = source.propose(request)
        name = "model" if source is self.model_drafter else self.names[0]
        proposal.telemetry = {**(proposal.telemetry or {}),
                              "source": [name if g else None for g in request.gammas.tolist()]}
        self._chosen = None
        return proposal

    def _model_proposal(self, request: DraftRequest, choice: list[int], cut: list[int]):
        """The draft model's proposal for the rows that chose it (None when none did), and its seconds."""
        wants = torch.tensor([c == MODEL for c in choice], device=request.gammas.device)
        if self.model_drafter is None or not bool(wants.any()):
            return None, 0.0
        start = time.perf_counter()
        gammas = torch.where(wants, torch.tensor(cut, device=request.gammas.device), 0)
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
        telemetry = {"source": names}
        seen = (model.telemetry or {}).get("hindsight") if model is not None else None
        if seen is not None:      # the draft model's, on its rows (the others read -1: it did not catch up there)
            telemetry["hindsight"] = seen
        return Proposal(tokens, lengths, probs, telemetry, None, confidence, free)

    # -- learning -------------------------------------------------------------------------------------------------
    def observe(self, record) -> None:
        self._each("observe", record, having=Observes)
        chosen, self._chosen = self._chosen, None
        if chosen is None:          # a step the router did not choose (plain, a tree, a single source)
            return
        with self.state.lock:      # the draft model's acceptance; its times are the call's writer's (`draft_seconds`)
            for b, c in enumerate(chosen["choice"]):
                if c == MODEL:
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

    def _with_opening(self, features, request: DraftRequest):
        """Each free source's feature, doubled, plus 1 on a row's opening step (it has committed only the token its
        prefill chose): an answer's opening is where a copy of the prompt most often goes wrong (the latest match of
        a chat answer's first token is usually the prompt's own end), so it is learned apart from the copies after."""
        done = [int(n) - self.prompt_end[r] for n, r in zip(request.lengths.tolist(), request.rows.tolist())]
        return [[2 * int(f) + (d <= 1) for f, d in zip(fs, done)] for fs in features]

    def _learn(self, source: str, row: int, feature: int, drafted: int, accepted: int) -> None:
        """One row's step with a source: into the shared rates per feature and the row's own counts."""
        if drafted <= 0:
            return
        acceptance = self.state.acceptance
        acceptance.observe(source, feature, drafted, accepted)
        old = self.row_counts.get((source, row))
        step = acceptance.step_counts(drafted, accepted)
        self.row_counts[(source, row)] = step if old is None else widened(old, step.shape[-1]) * acceptance.decay + step


def _name(source: Drafter) -> str:
    if isinstance(source, PromptLookupDrafter):
        return "lookup"
    if isinstance(source, SuffixDrafter):
        return "suffix"
    return type(source).__name__


def _available(drafter) -> bool:
    """Whether a source can draft now (not while an offloaded draft's weights are away)."""
    return not isinstance(drafter, Offloads) or drafter.available()
