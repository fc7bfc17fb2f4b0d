"""The Drafter contract: the propose phase of a speculative step.

A drafter sees the committed tokens of the active rows and proposes up to `gammas[b]` tokens per row. It may propose
fewer (early exit, no n-gram match): `Proposal.lengths` says how many. After verification the loop calls `rollback`
with how much of the row's buffer is still valid, and `select_rows` when finished rows leave the batch, in the same
way for every drafter and for the target's own ledger.
"""

from __future__ import annotations

import numbers

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..positions import offsets
from ..processors import ScoreProcessor
from ..tree import ancestry, from_branches, is_chain, pack_tree_lists, tree_problems

if TYPE_CHECKING:
    from ..acceptor import Acceptor
    from ..running_estimates import StopRule
    from ..ledger import KVLedger
    from ..noise import StepNoise
    from ..policies.cost import CostReader


@dataclass
class DraftRequest:
    tokens: torch.Tensor         # [B, Lmax] long: token buffer of the active rows (left padding, prompt, generated)
    lengths: torch.Tensor        # [B] long: committed tokens per row (buffer prefix)
    gammas: torch.Tensor         # [B] long: tokens to draft per row (0 = none for that row)
    rows: torch.Tensor           # [B] long: the rows' indices in the user's batch
    sampling: bool               # True: return draft probabilities for rejection sampling (or None = point mass)
    process: ScoreProcessor      # the call's logits processors, to apply to draft scores position by position
    acceptor: "Acceptor | None" = None   # the call's accept phase, for drafters that verify (chain levels)
    members: tuple | None = None  # the policy's plan: which chain members to use this step (None = the drafter's own)
    depths: torch.Tensor | None = None   # [B] long: a tree plan's deepest node per row; None = draft chains. With
                                         # depths, gammas[b] counts the row's nodes (spec_adapt.tree)
    pooled: bool = False          # a tree plan's budget is sum(gammas), for the batch's likeliest nodes in any row
    stop: "StopRule | None" = None  # the plan's stopping rule: gammas are each row's most, and a drafter with
                                    # probabilities stops a row where the rule says
                                    # (spec_adapt.running_estimates.StopRule)
    free: torch.Tensor | None = None    # [B] long, for a `FreeSources` drafter: the most tokens a row may take from a
                                        # model-free source (point masses that cost no draft forward), whatever its
                                        # gamma; None = gammas bound every row
    cost: "CostReader | None" = None    # the call's step-cost model, read-only (spec_adapt.policies.cost.CostReader),
                                        # for a drafter that weighs step times (None: not in a call)
    target: "KVLedger | None" = None    # the target's ledger, read-only, for a drafter that attends to the target's
                                        # own keys and values (`ReadsTarget`); None for the others
    noise: "StepNoise | None" = None    # sampling: the step's keyed Gumbel noise (spec_adapt.noise); a drafter that
                                        # samples draft k of a row as argmax(scores + noise.at(k)) agrees with the
                                        # target's coupled rule most often. None when greedy

    @property
    def wants_probs(self) -> bool:
        """Whether the proposal should carry the drafts' distributions: sampling's rejection rule reads them, and so
        does an acceptor that mixes them into the target's (ensemble verification)."""
        return self.sampling or (self.acceptor is not None and self.acceptor.draft_probs)


@dataclass
class Proposal:
    tokens: torch.Tensor              # [B, S] long, S = max(lengths); entries past lengths[b] are ignored
    lengths: torch.Tensor             # [B] long, 0 <= lengths[b] <= gammas[b]
    probs: torch.Tensor | None = None # [B, S, V] float32 processed draft distributions; None = point mass
    telemetry: dict | None = None     # what the drafter measured this step (a chain: members used, per-level
                                      # counts and times); the loop hands it to the policy in the StepRecord
    parents: torch.Tensor | None = None   # [B, S] long: a tree (spec_adapt.tree), node i's parent node or -1 for a
                                          # child of the last committed token; None = chains. With a tree, probs[b, i]
                                          # is the distribution node i and its siblings were drawn from (without
                                          # replacement, in node order)
    confidence: torch.Tensor | None = None   # [B, S] the drafter's probability of each drafted token (a chain from a
                                             # draft model), for the policy's calibration; None = not known
    free: torch.Tensor | None = None  # [B] bool: rows drafted by a model-free source (point masses, bounded by
                                      # DraftRequest.free rather than gammas); None = no such row
    # Set by the loop's check (`check_proposal`), never by a drafter: every row holds all S drafts, known on the
    # host from the check's one read, so the verification appends its columns with no hole check.
    dense: bool = field(default=False, init=False, repr=False, compare=False)

    @staticmethod
    def empty(batch: int, device) -> "Proposal":
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return Proposal(torch.zeros(batch, 0, dtype=torch.long, device=device), zeros)

    def cut(self, lengths: torch.Tensor) -> "Proposal":
        """The same proposal with row b keeping its first min(lengths[b], self.lengths[b]) drafts."""
        lengths = torch.minimum(self.lengths, lengths)
        width = int(lengths.max()) if lengths.numel() else 0
        probs = self.probs[:, :width] if self.probs is not None else None
        parents = self.parents[:, :width] if self.parents is not None else None    # a prefix of a tree is a tree
        confidence = self.confidence[:, :width] if self.confidence is not None else None
        return Proposal(self.tokens[:, :width], lengths, probs, self.telemetry, parents, confidence, self.free)

    @staticmethod
    def pack(drafts: list[torch.Tensor], device) -> "Proposal":
        """Per-row 1-D token tensors of different lengths -> a point-mass Proposal (rows padded with 0)."""
        width = max((d.numel() for d in drafts), default=0)
        tokens = torch.zeros(len(drafts), width, dtype=torch.long)
        for b, d in enumerate(drafts):
            tokens[b, : d.numel()] = d
        lengths = torch.tensor([d.numel() for d in drafts], dtype=torch.long)
        return Proposal(tokens.to(device), lengths.to(device))


def sample_drafts(scores: torch.Tensor, q: torch.Tensor, request: DraftRequest, k: int) -> torch.Tensor:
    """Draft k of each row under sampling, from processed scores [B, V] and q = their softmax: argmax(scores +
    the step's noise at k) where the request carries keyed noise, the sample the target's coupled rule takes when the
    draft's distribution is its own, so the two agree most often; else a draw from q by torch's generator."""
    if request.noise is None:
        return torch.multinomial(q, 1).squeeze(1)
    return (scores + request.noise.at(k).to(scores.device)).argmax(dim=-1)


def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Left-padding length of each row of a prompt batch (its real tokens start there)."""
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    return (attention_mask == 0).sum(dim=1).tolist()


def place(values: list | None, rows, new: list) -> list:
    """Per-row state kept in a list indexed by row number: `new[i]` becomes row rows[i]'s (the list grows to hold
    the largest row; slots in between that no row holds yet are None)."""
    values = list(values or [])
    for row, value in zip(rows, new):
        values.extend([None] * (int(row) + 1 - len(values)))
        values[int(row)] = value
    return values


def with_drafts(tokens: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """A copy of the token buffer [B, L] with each row's drafts [B, S] written after its committed tokens."""
    out = tokens.clone()
    if drafts.shape[1]:
        index = (lengths[:, None] + torch.arange(drafts.shape[1], device=tokens.device)).clamp(max=tokens.shape[1] - 1)
        out.scatter_(1, index, drafts)
    return out


def pack_trees(trees: list[tuple[list[int], list[int]]], device):
    """Per row (tokens, parents) lists -> a point-mass tree Proposal on `device`."""
    tokens, parents, lengths = pack_tree_lists(trees)
    return Proposal(tokens.to(device), lengths.to(device), parents=parents.to(device))


def branches_proposal(branches: list[list[list[int]]], request):
    """Per row, continuations best first -> a point-mass Proposal for `request` (a DraftRequest): the trie within
    the plan's node budget and depths, or, when the plan asks for chains, each row's first continuation cut to
    gamma."""
    gammas, device = request.gammas.tolist(), request.tokens.device
    if request.depths is None:
        return pack_lists([[int(t) for t in (row[0] if row else [])][:g] for row, g in zip(branches, gammas)], device)
    return pack_trees(from_branches(branches, gammas, request.depths.tolist()), device)


def pack_lists(drafts: list[list[int]], device) -> Proposal:
    """Per-row token lists of different lengths -> a point-mass Proposal (rows padded with 0), in one tensor made
    from the lists (no per-row tensor or copy)."""
    width = max(map(len, drafts), default=0)
    tokens = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long).reshape(len(drafts), width)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    return Proposal(tokens.to(device), lengths.to(device))


CAPABILITIES: tuple = ()      # the capabilities, in docs/design.md's order (filled below)
_FLAGS = ("trees", "wants_hidden", "fills_budget")     # the core's attributes that say whether a drafter has one


class _DrafterType(type):
    """The drafters' metaclass. `isinstance(drafter, Trees)` asks whether a drafter has a capability: a wrapper
    (`Forwards`) has one of those it inherits only where it `offers` it. A class that declares a capability's member
    without inheriting the capability (sets `trees = True`, defines `add_rows`) inherits it; one that sets an
    inherited capability's flag false (`trees = False`) has it no more."""

    def __new__(mcls, name, bases, namespace, **kwargs):
        implied = tuple(c for c in CAPABILITIES if not any(issubclass(b, c) for b in bases)
                        and any(_declares(namespace, member) for member in members_of(c)))
        cls = super().__new__(mcls, name, implied + bases, namespace, **kwargs)
        said = {c: namespace[m] for c in CAPABILITIES for m in members_of(c) if m in namespace and m in _FLAGS}
        inherited = getattr(cls, "_withdrawn", frozenset())
        cls._withdrawn = frozenset(c for c in CAPABILITIES if not said.get(c, c not in inherited))
        return cls

    def __instancecheck__(cls, drafter) -> bool:
        return type.__instancecheck__(cls, drafter) and (cls not in CAPABILITIES or cls not in type(drafter)._withdrawn
                                                         and (not type.__instancecheck__(Forwards, drafter)
                                                              or drafter.offers(cls)))


def _declares(namespace: dict, member: str) -> bool:
    value = namespace.get(member)
    return member in namespace and (callable(value) or isinstance(value, property) or bool(value))


class _Derived:
    """A capability's attribute, readable on every drafter: without the capability, whether it has it (a flag) or
    `absent`. A drafter has it by inheriting the capability; setting it on one without raises, naming it."""

    def __init__(self, capability: str, absent=None):
        self.capability, self.absent = capability, absent

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, drafter, owner=None):
        if drafter is None:
            return self
        return isinstance(drafter, globals()[self.capability]) if self.absent is None else self.absent

    def __set__(self, drafter, value):
        raise TypeError(f"{type(drafter).__name__} sets `{self.name}`: a drafter has it by inheriting "
                        f"spec_adapt.drafters.{self.capability}.")


class Drafter(metaclass=_DrafterType):
    """The core contract: a drafter proposes drafts for the active rows and follows the rows' commits and exits.
    A model-free drafter overrides `propose` only; everything else a drafter may do is a capability it inherits
    (`Trees`, `JoinsRows`, ... below; docs/design.md's table)."""

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Start of a generate call: the (left padded) prompt [B, L] and its mask."""

    def propose(self, request: DraftRequest) -> Proposal:
        """Up to `request.gammas[b]` drafts per active row after its committed tokens (`Proposal.lengths` says how
        many: fewer is fine); their distributions where `request.wants_probs`, else None (point masses)."""
        raise NotImplementedError

    def rollback(self, keep_len: torch.Tensor) -> None:
        """Buffer tokens [0, keep_len[b]) of each active row are committed; anything drafted past them is not."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Only these active rows remain (indices into the current active batch)."""

    def end(self, tokens: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> None:
        """End of the call: free per-call state. `tokens` [B0, L] / `lengths` [B0] are the final sequences of the
        user's whole batch (None after a failure), for drafters that learn from outputs."""

    # Read-only, derived from the capabilities, for whoever reads them; a drafter never sets these.
    trees = _Derived("Trees")
    wants_hidden = _Derived("Features")
    fills_budget = _Derived("FillsBudget")
    reads_target = _Derived("ReadsTarget", 0)
    max_free = _Derived("FreeSources", 0)
    offloaded = _Derived("Offloads", False)
    events = _Derived("Events", ())


# -- capabilities: what a drafter may do beyond the core, each opted into by inheriting it --------------------------
class Trees(Drafter):
    """Proposes token trees: given `DraftRequest.depths` (a tree plan) it may return `Proposal.parents`
    (spec_adapt.tree). A drafter without it is asked for the chain of min(nodes, depth)."""

    def keep_tree(self, path: torch.Tensor) -> None:
        """After a tree proposal was verified, before `rollback`: path [B, S] bool marks the accepted nodes (a chain
        from the root per row). A drafter that cached its tree keeps the path's entries here."""


class Features(Drafter):
    """A feature drafter: drafts from the target's own last hidden states. The target's forwards keep them only for
    such a drafter (the verifier must hand them over: `Verifier.hands_hidden`)."""

    def take_hidden(self, hidden: torch.Tensor, count: torch.Tensor) -> None:
        """After each target forward (the prefill, every step), once its tokens are committed and after `rollback`,
        the target's last hidden states [B, W, H] of the active rows, row b's first count[b] being those of positions
        now committed (a tree's: its root and accepted path). They continue the row's earlier ones: the drafter then
        holds the hidden state of every buffer position the target has cached (its first row's prefill: every prompt
        position, left padding included); rows joining a serving batch get their prefill's."""


class ReadsTarget(Drafter):
    """Attends to the target's cached keys and values (a Gemma 4 assistant): each request carries the target's ledger
    (`DraftRequest.target`, read-only), whose sliding layers keep `reads_target` positions more than the target's
    windows need."""

    reads_target = 0


class JoinsRows(Drafter):
    """Serving: takes requests joining a running batch. Without it the engine goes on without speculation when one
    joins (nothing committed is lost)."""

    def add_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: list[int]) -> None:
        """Rows join after the active rows: their tokens [n, L], laid out as in the loop's buffer (left padding,
        then the prompt, and for a drafter restarted on running rows what they have generated; `attention_mask` marks
        the padding), and the row numbers they take in `DraftRequest.rows`. Row numbers are slots that earlier
        requests may have used: per-row state kept by row number is replaced here. A drafter that cannot take these
        rows raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows joining a running batch.")


class CatchUp(Drafter):
    """Has committed tokens to catch up on before it drafts (a draft model after plain steps): the policy reads the
    lag (`StepInfo.lag`) and learns its cost apart from the cost per drafted token."""

    def lag(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """[B] committed tokens (of `lengths`) this drafter would have to catch up on first; None = none."""
        return None


class Chains(Drafter):
    """Several levels (a draft and intermediate verifiers) among which a policy's plan chooses (`Plan.members`,
    `DraftRequest.members`)."""

    def level_lags(self, lengths: torch.Tensor) -> list[int] | None:
        """The largest lag of each level (index = level)."""
        return None

    def check_members(self, members: tuple) -> None:
        """Raise a clear error unless `members` (a policy's plan) names levels this drafter has."""


class Offloads(Drafter):
    """Its draft's weights may leave their device: while they are away (`offloaded`) it is not `available` and the
    loop runs plain steps without asking the policy."""

    offloaded = False

    def available(self) -> bool:
        """False while the drafter cannot draft."""
        return True


class Observes(Drafter):
    """Learns from the steps: `observe` gets every step's record."""

    def observe(self, record) -> None:
        """After every step: the StepRecord (widths, drafted, accepted, times), e.g. to decide an offload."""


class FreeSources(Drafter):
    """Has model-free sources: the loop lets a row draft up to `max_free` tokens from them (`DraftRequest.free`,
    `Proposal.free`), even on a step the policy planned plain."""

    max_free = 0


class FillsBudget(Drafter):
    """Drafts up to a row's whole remaining budget, the step's bonus token then cut (stock's MTP drafts its depth to
    the end: under a lossy ensemble acceptor the last token is the mix's at a draft's position, not the target's
    bonus). A drafter without it is asked to leave room for the bonus."""


class Events(Drafter):
    """Says what went wrong inside it this call (a ChainDrafter's dropped levels, a DraftOffload's moves):
    `events`, which the statistics carry (`SpecStats.drafter_events`)."""

    events: tuple | list = ()


class ChecksTarget(Drafter):
    """Checks the target it drafts for, once per call where the call's parts enter (`api.check_parts`)."""

    def validate(self, target) -> None:
        """Raise a clear error if this drafter cannot serve `target` (tokenizer, vocabulary)."""


class TakesInputs(Drafter):
    """Reads what the target's forwards take besides token ids (a draft decoder attending to the target's encoder
    outputs)."""

    def share_inputs(self, inputs) -> None:
        """Before `begin`: a `spec_adapt.inputs.ModelInputs` (images, encoder outputs), or None."""


class Forwards(Drafter):
    """A wrapper of inner drafters: of the capabilities it inherits, it has those it `offers` (its inner drafters')."""

    def offers(self, capability: type) -> bool:
        """Whether this drafter has `capability`, one of the capabilities its class inherits."""
        return True


CAPABILITIES = (Trees, Features, ReadsTarget, JoinsRows, CatchUp, Chains, Offloads, Observes, FreeSources,
                FillsBudget, Events, ChecksTarget, TakesInputs, Forwards)


def members_of(capability: type) -> list[str]:
    """A capability's members: its own methods and attributes, and the core's attribute derived from it."""
    own = [name for name in vars(capability) if not name.startswith("_")]
    derived = [name for name, value in vars(Drafter).items()
               if isinstance(value, _Derived) and value.capability == capability.__name__]
    return own + [name for name in derived if name not in own]


def lag_of(drafter: Drafter, lengths: torch.Tensor) -> torch.Tensor | None:
    """A drafter's catch-up lag (`CatchUp.lag`); None for a drafter without one."""
    return drafter.lag(lengths) if isinstance(drafter, CatchUp) else None


def join_rows(drafter: Drafter, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: list[int]) -> None:
    """`JoinsRows.add_rows`; a drafter without it raises (it cannot take the rows)."""
    if not isinstance(drafter, JoinsRows):
        raise NotImplementedError(f"{type(drafter).__name__} cannot take rows joining a running batch.")
    drafter.add_rows(input_ids, attention_mask, rows)


def check_chain_members(drafter: Drafter, members: tuple) -> None:
    """Raise a clear error unless `drafter` has the levels a policy's plan names (`Chains.check_members`)."""
    if not isinstance(drafter, Chains):
        raise ValueError(f"The policy's plan names chain members {members!r}, but {type(drafter).__name__} is not a "
                         "ChainDrafter: pass the ChainDrafter the policy schedules as drafter=.")
    drafter.check_members(members)


class InvalidProposal(ValueError):
    """A drafter returned something the loop cannot verify; the call continues without speculation."""


def check_proposal(proposal, request: DraftRequest, vocab: int, strict: bool = False) -> Proposal:
    """Validate a drafter's answer once, where it enters the loop; return it on the target's device with its width
    cut to the longest row. Lengths above gamma are cut to gamma (the extra drafts are simply not verified); anything
    else malformed raises InvalidProposal, which the loop treats like a drafter exception (fallback, nothing lost).

    Checked: type; tokens [B, S] of an integer dtype, ids within [0, vocab) where used; lengths [B] integers, >= 0,
    <= S; probs None or [B, >= S', V] floating, with q(d) finite, > 0 and <= 1 for every drafted token d (a draft
    cannot propose what it gives probability 0: p/q would be infinite and acceptance lossy). `strict` (the call's
    `strict=True`) adds the full-vocabulary checks, every used position's probs finite, >= 0 and summing to 1: they
    read S x V values per row and step, so a call pays them only when it asks to."""
    if not isinstance(proposal, Proposal):
        raise InvalidProposal(f"propose returned {type(proposal).__name__}, not a Proposal")
    batch, device = request.gammas.shape[0], request.tokens.device
    tokens, lengths, probs = proposal.tokens, proposal.lengths, proposal.probs
    _expect(isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[0] == batch
            and not tokens.dtype.is_floating_point and tokens.dtype != torch.bool,
            lambda: f"tokens must be an integer tensor [B={batch}, S], got {_describe(tokens)}")
    _expect(isinstance(lengths, torch.Tensor) and lengths.shape == (batch,) and not lengths.dtype.is_floating_point
            and lengths.dtype != torch.bool,
            lambda: f"lengths must be an integer tensor [B={batch}], got {_describe(lengths)}")
    tokens, lengths = _long_on(tokens, device), _long_on(lengths, device)
    free = _checked_free(proposal.free, request, batch, device)
    given = lengths
    if request.pooled:          # one budget for the batch: a row may hold more than its share
        lengths = torch.where(request.gammas.to(device) > 0, lengths, 0)
    else:
        bound = _long_on(request.gammas, device)
        if free is not None:    # a free row is bounded by what the loop lets it take from a model-free source
            bound = torch.where(free, request.free.to(device), bound)
        lengths = torch.minimum(lengths, bound)
    # Every bound the checks read, in one host copy: the given lengths' ends, the width after the cut, the ids' ends
    # (over every column: an id out of range past the width is looked at again below, and let through).
    confidence = _shaped_confidence(proposal.confidence, batch, device)
    telemetry, seen = _shaped_telemetry(proposal.telemetry, batch)
    low, high, width, shortest, low_id, high_id, *extremes = _ends(given, lengths, tokens, confidence, seen)
    sure = extremes[:2] if confidence is not None else []
    if seen is not None:            # integers: within [-1, 1] is one of -1, 0, 1
        _expect(-1 <= extremes[-2] and extremes[-1] <= 1, lambda: f"telemetry['hindsight'] must hold one of -1, 0, 1 "
                f"per row (1: a draft past the accepted ones would have been accepted, 0 not, -1 not known), got "
                f"{seen.tolist()}")
    _expect(low >= 0 and high <= tokens.shape[1],
            lambda: f"lengths must be within [0, S={tokens.shape[1]}], got {given.tolist()}")
    if request.pooled:
        total = int(request.gammas.sum())
        _expect(int(given.sum()) <= total, lambda: f"{int(given.sum())} nodes proposed for a pooled budget of "
                f"{total}")
    tokens = tokens[:, :width]
    used = offsets(width, device) < lengths[:, None]                                  # [B, S]
    if low_id < 0 or high_id >= vocab:    # an id is out of range: is it one a row uses (past its length, any value)?
        bad = used & ((tokens < 0) | (tokens >= vocab))
        _expect(not bool(bad.any()), lambda: f"token ids must be within [0, {vocab}), got {tokens[bad][:4].tolist()}")
    if probs is not None:
        probs = _checked_probs(probs, tokens, used, batch, width, vocab, strict).to(device)
    parents = _checked_parents(proposal.parents, tokens, lengths, used, request, probs)
    if free is not None and probs is not None:      # a free row proposes point masses: q(d) = 1 at every draft
        q = probs.gather(-1, tokens[..., None]).squeeze(-1)
        _expect(not bool(((q != 1) & used & free[:, None]).any()), "a model-free row's probs must be point masses "
                "at its drafted tokens")
    checked = Proposal(tokens, lengths, probs, telemetry, parents,
                       _checked_confidence(confidence, width, sure), free)
    checked.dense = parents is None and shortest == width > 0
    return checked


def _long_on(values: torch.Tensor, device) -> torch.Tensor:
    """`values` as int64 on `device`, with no dispatch where they already are (the usual case, every step)."""
    return values if values.dtype == torch.long and values.device == device else values.to(device).long()


def _checked_free(free, request, batch, device):
    """None, or [B] bool rows a model-free source drafted; only for a chain request that allows free drafts."""
    if free is None:
        return None
    _expect(isinstance(free, torch.Tensor) and free.shape == (batch,) and free.dtype == torch.bool,
            f"free must be a bool tensor [B={batch}] or None, got {_describe(free)}")
    _expect(request.free is not None and not request.pooled, "free rows proposed, but the request allows none "
            "(DraftRequest.free is None or the plan is a pooled tree)")
    return free.to(device)


def _shaped_telemetry(telemetry, batch: int):
    """(telemetry, hindsight): None or a dict, and its "hindsight" (a draft model's verdict on the position past a
    fully accepted chain, read by `Adaptive`) as a [B] integer tensor where given, its shape and dtype checked (its
    values are checked with the proposal's one host read)."""
    if telemetry is None:
        return None, None
    _expect(isinstance(telemetry, dict), f"telemetry must be a dict or None, got {type(telemetry).__name__}")
    seen = telemetry.get("hindsight")
    if seen is None:
        return telemetry, None
    if isinstance(seen, (list, tuple)):
        _expect(all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in seen),
                lambda: f"telemetry['hindsight'] must hold integers, got {seen!r}")
        seen = torch.tensor([int(v) for v in seen], dtype=torch.long)
    _expect(isinstance(seen, torch.Tensor) and seen.shape == (batch,) and not seen.dtype.is_floating_point
            and not seen.dtype.is_complex and seen.dtype != torch.bool,
            lambda: f"telemetry['hindsight'] must be an integer tensor or list [B={batch}], got {_describe(seen)}")
    return {**telemetry, "hindsight": seen}, seen


def _shaped_confidence(confidence, batch, device):
    """None, or the drafter's [B, >= S] confidences on `device`, their rank, rows and dtype checked (the width S is
    known only after the proposal's one read: `_checked_confidence` checks the columns)."""
    if confidence is None:
        return None
    _expect(isinstance(confidence, torch.Tensor) and confidence.dim() == 2 and confidence.shape[0] == batch
            and confidence.dtype.is_floating_point,
            f"confidence must be a float tensor [B={batch}, >= S], got {_describe(confidence)}")
    return confidence.to(device)


def _checked_confidence(confidence, width, ends):
    """None, or [B, >= S] probabilities (a policy's calibration reads them): cut to the kept width. `ends`: the whole
    tensor's (min, max), read with the proposal's bounds; only where they leave [0, 1] (or are NaN) is the kept part
    read again, since values past a row's width are never read."""
    if confidence is None:
        return None
    _expect(confidence.shape[1] >= width,
            f"confidence must be a float tensor [B={confidence.shape[0]}, >= {width}], got {_describe(confidence)}")
    confidence = confidence[:, :width]
    low, high = ends
    if not (low >= 0 and high <= 1):
        _expect(bool(((confidence >= 0) & (confidence <= 1)).all()), "confidence must be probabilities in [0, 1]")
    return confidence


def _checked_parents(parents, tokens, lengths, used, request, probs):
    """A tree's parents, validated (spec_adapt.tree); None for chains (a tree that is a chain becomes one)."""
    if parents is None:
        if request.depths is not None:
            _check_depth(lengths, request)
        return None
    batch, width = tokens.shape
    _expect(isinstance(parents, torch.Tensor) and parents.dim() == 2 and parents.shape[0] == batch
            and parents.shape[1] >= width and not parents.dtype.is_floating_point and parents.dtype != torch.bool,
            f"parents must be an integer tensor [B={batch}, S>={width}] or None, got {_describe(parents)}")
    parents = parents.to(tokens.device).long()[:, :width]
    parents = torch.where(used, parents, -1)       # slots past a row's length are never read: whatever they held
    if is_chain(parents, lengths):
        if request.depths is not None:
            _check_depth(lengths, request)
        return None
    _expect(request.depths is not None, "the drafter returned a tree, but this step's plan asked for chains (a "
            "policy without depth)")
    problem = tree_problems(parents, tokens, lengths)
    _expect(problem is None, str(problem))
    _, depth = ancestry(parents, lengths)
    _check_depth(depth.max(dim=1).values if width else lengths, request)
    if probs is not None:
        index = torch.arange(width, device=tokens.device)
        first = (parents[:, :, None] == parents[:, None, :]) & (index[None, None, :] <= index[None, :, None])
        first = torch.where(first & used[:, None, :], index, width).min(dim=2).values     # each node's first sibling
        first = torch.where(used, first, index)
        same = probs.gather(1, first[..., None].expand(-1, -1, probs.shape[-1])) == probs
        _expect(bool(same.all(dim=-1)[used].all()), "siblings must carry the same probs (the distribution they "
                "were drawn from)")
    return parents


def _checked_probs(probs, tokens, used, batch, width, vocab, strict) -> torch.Tensor:
    _expect(isinstance(probs, torch.Tensor) and probs.dim() == 3 and probs.shape[0] == batch
            and probs.shape[1] >= width and probs.shape[2] == vocab and probs.dtype.is_floating_point,
            f"probs must be a float tensor [B={batch}, S>={width}, V={vocab}] or None, got {_describe(probs)}")
    probs = probs[:, :width].float().to(tokens.device)
    if strict:                         # the whole distribution of every used position: S x V values per row
        rows = probs[used]                                                          # [N, V] positions in use
        _expect(bool(torch.isfinite(rows).all()) and bool((rows >= 0).all()),
                "probs contain NaN, inf or negative values")
        _expect(bool(((rows.sum(-1) - 1).abs() < 1e-3).all()), "each used position's probs must sum to 1")
    q = probs.gather(-1, tokens[..., None]).squeeze(-1)[used]                         # what acceptance divides by
    _expect(bool(torch.isfinite(q).all()), "probs contain NaN or inf at a drafted token")
    _expect(bool((q > 0).all()), "a drafted token has draft probability 0 (its probs do not match its tokens)")
    _expect(bool((q <= 1).all()), "a drafted token has draft probability above 1")
    return probs


def _check_depth(deepest, request) -> None:
    limit = request.depths.to(deepest.device)
    _expect(bool((deepest <= limit).all()),
            lambda: f"tree depths {deepest.tolist()} exceed the plan's {limit.tolist()}")


def _ends(given: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor, *extra) -> list:
    """(min, max) of the given lengths, (max, min) of the cut lengths (the width, and whether every row fills it),
    (min, max) of the token ids and of each tensor in `extra` that is not None (the confidence, the hindsight), read
    in one host copy; 0 for what is empty."""
    zero = given.new_zeros(())
    parts = [*torch.aminmax(given)] if given.numel() else [zero, zero]
    parts += [*reversed(torch.aminmax(lengths))] if lengths.numel() else [zero, zero]
    parts += [*torch.aminmax(tokens)] if tokens.numel() else [zero, zero]
    extra = [x for x in extra if x is not None]
    if not extra:
        return torch.stack(parts).tolist()
    # One copy for all: as float64, which holds every length and token id exactly.
    for x in extra:
        parts += [*torch.aminmax(x.to(given.device))] if x.numel() else [zero, zero]
    values = torch.stack([p.double() for p in parts]).tolist()
    return [int(v) for v in values[:6]] + values[6:]


def _expect(ok: bool, problem) -> None:
    """Raise InvalidProposal unless ok; `problem` is the message, or a function that makes it (only on failure: a
    message that reads tensors costs nothing while the proposal is fine)."""
    if not ok:
        raise InvalidProposal(f"malformed Proposal: {problem() if callable(problem) else problem}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__
