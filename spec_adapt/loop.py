"""The speculative generation loop: prefill, then steps of propose -> verify -> accept -> commit/rollback -> observe.

State, for the user's batch of B0 rows (tensors on the target's device):
- `buffer` [B0, W]: the generate layout (left padding, prompt, generated tokens, pad after a row ends); W grows with
  what the rows generate (`_reserve`), never beyond max_length, so a huge max_new_tokens costs nothing up front;
- `lengths` [B0]: committed tokens per row (a buffer prefix), so row b's last committed token is buffer[b, len-1];
- `rows` [B]: the rows still generating (the active batch; it shrinks as rows finish).
The target's cache always holds each active row's buffer up to, not including, its last committed token: every step
feeds that token plus the drafts, so p_0 (which scores d_1) comes from the last committed token. Where a call's first
token waits for the first step's drafts (`SpeculativeLoop._commit_first`), the cache holds the whole prompt until that
step, which feeds the drafts alone after the prefill's p_0.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
from .compat import pad_token_tensor

from .acceptance_rules import committed_tokens
from .distributed import FollowerDrafter, FollowerPolicy, ranks_of
from .drafters.drafter import (CatchUp, Chains, DraftRequest, Drafter, Features, FillsBudget, Observes, Offloads, Proposal,
                            ReadsTarget, TakesInputs, Trees, check_chain_members, check_proposal, join_rows,
                            with_drafts)
from .acceptor import Acceptor
from .inputs import ModelInputs
from .ledger import KVLedger, positions_from_cache
from .metrics import SpecStats, StepRecord
from .noise import StepNoise, call_seed, row_keys
from .policies.policy import MAX_WIDTH, Policy, StepInfo, check_plan, check_rows, policy_lock
from .policies.cost import share_cost
from .processors import ScoreProcessor, tree_positions
from .returned_cache import ReturnedCache
from .rows import Rows
from .stopping import Stopper
from .tree import ancestry, chunk_tree, path_nodes
from .verifiers import FullVerifier, Verification, Verifier, check_trees


@dataclass(frozen=True)
class StepPlan:
    """One step's decisions, made once (on a sharded target by the leading rank, then broadcast) and handed to the
    phases that follow: nothing of a step is kept on the loop."""
    gammas: torch.Tensor                 # [B] per active row: drafts (a chain) or nodes (a tree); 0 = a plain step
    asked: bool = False                  # whether the policy planned this step (it observes only those)
    depths: torch.Tensor | None = None   # [B] a tree plan's deepest node per row; None = chains
    pooled: bool = False                 # a tree budget pooled over the rows
    members: tuple | None = None         # a chain drafter's levels to run; None = the drafter's own
    stop: object = None                  # a chain plan's StopRule (gammas are each row's most), or None
    free: torch.Tensor | None = None     # [B] the most drafts a row may take from a model-free source (FreeSources)
    plain: bool = False                  # known without reading a device tensor: no row drafts (every width 0)
    most: int | None = None              # known without reading a tensor: a bound on `deepest` (None: read them)
    some: bool = False                   # known without reading a tensor: some row drafts

    @property
    def deepest(self) -> int:
        """The most tokens a row may draft in depth this step (its buffer needs one more), or a bound on it."""
        if self.most is not None:
            return self.most
        reach = self.gammas if self.depths is None else self.depths
        if self.free is not None:
            reach = torch.maximum(reach, self.free)
        return int(reach.max()) if len(reach) else 0

    @property
    def drafts(self) -> bool:
        """Whether any row may draft this step (a drafter is never asked for none)."""
        return self.some or bool((self.gammas > 0).any()) or (self.free is not None and bool((self.free > 0).any()))


class SpeculativeLoop:
    closed = True     # one generate call: no row joins, the call ends with its slowest row (StepInfo.closed)

    def __init__(
        self, model, input_ids, attention_mask, *, drafter: Drafter | None, policy: Policy, logits_processor,
        stopping_criteria, generation_config, streamer=None, stats: SpecStats, cache=None,
        acceptor: Acceptor | None = None, verifier: Verifier | None = None, strict: bool = False,
        model_inputs: dict | None = None, positions: torch.Tensor | None = None,
    ):
        cfg = generation_config
        self._set_parts(model, drafter=drafter, policy=policy, processor=ScoreProcessor(logits_processor),
                        sampling=bool(cfg.do_sample), acceptor=acceptor, verifier=verifier, stats=stats,
                        streamer=streamer, strict=strict)
        ids = input_ids.to(self.device)
        mask = None if attention_mask is None else attention_mask.to(self.device)
        self.prompt = (ids, mask)      # what `run` prefills
        # Sampling's keyed noise (spec_adapt.noise): the call's seed, drawn once from torch's global generator, and
        # each row's key from it and the row's prompt, so no later draw depends on what the steps did.
        if self.choice.keyed:
            self.choice.keys = row_keys(call_seed(), input_ids, attention_mask)
        batch = input_ids.shape[0]
        self.stopper = Stopper(stopping_criteria, cfg.max_length, self.device, together=self.closed)
        pad = pad_token_tensor(cfg)
        self.rows_state = Rows.of_prompts(ids, self.stopper.max_length, int(pad) if pad is not None else 0)
        self.target = target_ledger(model, drafter, self.acceptor.mode, cache)
        # Images, token types, encoder outputs: what the target's forwards take besides tokens (spec_adapt.inputs).
        self.target.use_inputs(ModelInputs.of_call(model, ids, mask, self.target.cache,
                                                   model_inputs or {}, positions))
        # A target that numbers tokens by cache column: its rows commit in step, and its cache is never compacted.
        self.acceptor.lockstep = self.target.lockstep = positions_from_cache(model) is not None
        kept = cfg.return_dict_in_generate
        self.returns = Returns(batch, kept and cfg.output_scores, kept and cfg.output_logits,
                               ReturnedCache(model) if kept and cache is not None else None)

    def _set_parts(self, model, *, drafter, policy, processor, sampling, acceptor, verifier, stats, streamer=None,
                   strict=False):
        """What a loop holds besides its rows: the models' roles, the rules and the counters (shared with serving)."""
        self.model = model
        self.ranks = ranks_of(model)   # a sharded target: the first rank takes every decision (spec_adapt.distributed)
        if self.ranks.sharded and verifier is not None and verifier.rank_local:
            raise ValueError(f"{type(verifier).__name__} decides from per-rank timings; on a target sharded over "
                             "processes use the default FullVerifier.")
        if not self.ranks.leader:
            drafter = FollowerDrafter() if drafter is not None else None
            policy = FollowerPolicy()
        self.acceptor = (acceptor or Acceptor()).for_call()
        self.verifier = verifier if verifier is not None else FullVerifier()
        self.choice = TokenChoice(processor, sampling, self.acceptor.rule, self.device)
        self.drafter, self.streamer, self.stats = drafter, streamer, stats
        self.policy = PolicyHandle(policy, self.verifier)
        self.given_drafter = drafter   # `drafter` becomes None after a fallback; its events are still reported
        self.clock = Clock(self.device, policy.needs_timing)
        self.strict = bool(strict)     # True: a drafter's failure raises instead of falling back
        self.returns = Returns(0)      # what a generate call returns beside its tokens (SpeculativeLoop.__init__)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def run(self) -> torch.Tensor:
        self.clock.start()
        state = self.rows_state
        self._begin(state.buffer.shape[0])
        ids, mask = self.prompt
        logits = self._prefill(self.target, ids, mask)
        state.vocab = logits.shape[-1]
        state.reserve(1)
        state.finished = self._first_tokens(state.rows, logits)
        self._drafter_joins("prefill", ids, mask)   # then follows the rows that leave
        self._retire()
        self.policy.begin(len(state.rows))
        while len(state.rows):
            self.step()
        self.end()
        return state.buffer[:, : int(state.lengths.max())]

    # -- the lifecycle a generate call and a serving engine share ------------------------------------------------------
    def _begin(self, batch: int) -> None:
        """The counters (a generate call's `batch` rows; a serving engine's none yet) and the verifier start."""
        self.stats.start(batch)
        self.verifier.begin()

    def end(self) -> None:
        """The drafter ends (its failure there only says so in the statistics), the streamer ends, and the
        statistics are final: the report and the time since the loop began."""
        if self.drafter is not None:
            self._guard("end", self.drafter.end, self.rows_state.buffer, self.rows_state.lengths)
        if self.streamer is not None:
            self.streamer.end()
        self.report()
        self.stats.time_total = self.clock.elapsed()

    def _prefill(self, ledger: KVLedger, ids, mask) -> torch.Tensor:
        """The prompts' forward (a call's batch, or requests joining a running one) into `ledger`: the logits after
        each prompt [n, 1, V]. Its time counts as prefill."""
        began = self.clock.now()
        logits = ledger.prefill(ids, mask).float()[:, None]
        seconds = self.clock.now() - began
        self.stats.time_prefill += seconds
        self.policy.prefilled(ids.numel(), seconds)
        return logits

    def _first_tokens(self, rows, logits) -> torch.Tensor:
        """Freshly prefilled rows' first token (`_commit_first`), recorded and streamed; its time counts as prefill.
        Returns finished [n]."""
        began = self.clock.now()
        committed, finished, scores = self._commit_first(rows, logits)
        self.returns.record(rows, committed, scores, logits)
        if self.streamer is not None and int(rows[0]) == 0 and int(committed[0]) > 0:   # it follows the user's row 0
            start = int(self.rows_state.starts[0])
            self.streamer.put(self.rows_state.buffer[0, start : start + int(committed[0])].cpu())
        self.stats.time_prefill += self.clock.now() - began
        return finished

    def _drafter_joins(self, what: str, ids, mask, rows: torch.Tensor | None = None, hidden=None) -> None:
        """Prompts [n, L] (left padded, `mask`) enter the drafter: the first rows begin it, with the target's inputs
        and the hidden states of the prefill; `rows` (their row numbers, the last of the active rows) join a running
        batch (`JoinsRows.add_rows`), with `hidden` [n, W, H], their prefill's last hidden states, for a feature
        drafter. A failure in any of these drops the drafter, as anywhere else (`_guard`: `what` names the phase)."""
        if self.drafter is not None and rows is not None:
            self._guard(what, join_rows, self.drafter, ids, mask, rows.tolist())
            if hidden is not None:        # the running rows get nothing new (count 0), the joining ones their prompt
                running = len(self.rows_state.rows) - len(rows)
                count = torch.cat([torch.zeros(running, dtype=torch.long, device=self.device),
                                   torch.full((len(rows),), ids.shape[1], device=self.device)])
                self._hand_hidden(torch.cat([hidden.new_zeros((running,) + tuple(hidden.shape[1:])), hidden]), count)
            return
        if isinstance(self.drafter, TakesInputs):
            self._guard(what, self.drafter.share_inputs, self.target.inputs)
        if self.drafter is not None:         # not dropped by share_inputs
            self._guard(what, self.drafter.begin, ids, mask)
        self._hand_hidden(self.target.hidden, torch.full((len(ids),), ids.shape[1], device=self.device))

    compacted = (0, None)    # (compactions, last path) of target ledgers let go (a serving batch reset after a failure)

    def report(self) -> None:
        """What the statistics say beside the step counts: the fallback (every rank reports the leader's), the
        target's compactions, the kernel paths that ran, the verifier's counters and the drafter's events. At the end
        of a generate call; a serving engine's after every engine step, counting all it has served."""
        self.stats.fallback = self.ranks.decide(lambda: self.stats.fallback)
        compactions, path = self.compacted
        if self.target is not None:
            compactions, path = compactions + self.target.compactions, self.target.compact_path or path
        self.stats.compactions = compactions
        self.stats.kernel_paths = {**self.acceptor.paths, **({"compact": path} if path else {})}
        self.stats.verifier = self.verifier.report()
        self.stats.drafter_events = list(self.given_drafter.events) if self.given_drafter is not None else []

    def step(self) -> None:
        t0 = self.clock.now()
        plan = self.ranks.decide(self._plan)                               # 0. choose: one StepPlan
        if plan.plain:                                                     # no drafts: stock's decode step
            return self._plain_step(plan, t0)
        self.rows_state.reserve(plan.deepest + 1)
        noise = self.choice.step_noise(self.rows_state)                    # sampling's keyed noise, or None
        proposal = self.ranks.decide(self._draft, plan, noise)             # 1. propose
        t1 = self.clock.now()
        proposal, bonus, scores, logits, hidden = self._verify(proposal)   # 2. verify: [B, S+1, V]
        t2 = self.clock.now()
        accepted, next_token, path = self._accept(scores, proposal, noise)  # 3. accept (a tree: along `path`)
        counts = self._commit_drafts(proposal, accepted, next_token, scores, logits, bonus, path, hidden,  # 4.
                                     plan.gammas)
        t3 = self.clock.now()
        finished = self._observe(proposal, counts, plan, t3 - t0, t1 - t0, t2 - t1)                 # 5. observe
        self._retire(finished)

    # -- phases --------------------------------------------------------------------------------------------------------
    # Each decision (the plan, the proposal, the acceptance, the stop, the batch shape) goes through `ranks.decide`:
    # here, or on a sharded target the leading rank's, broadcast to the others.
    def _plan(self) -> StepPlan:
        """This step's plan: the policy's answer, validated and capped by what each row may still generate; a plain
        step without asking the policy when there is no drafter or it is away."""
        away = isinstance(self.drafter, Offloads) and not self._guard("available", self.drafter.available)
        if self.drafter is None or away:
            return StepPlan(self.rows_state.widths(len(self.rows_state.rows), 0), plain=True)
        # The rows' lengths and what they may still generate, computed where something reads them: a policy that
        # answers 0 without reading them, beside a drafter with no catch-up, costs no tensor operation here.
        rows = self.rows_state.rows
        lengths = _ComputedOnce(lambda: self.rows_state.lengths[rows])
        remaining = _ComputedOnce(lambda: self.rows_state.row_limits() - lengths())
        lag = level_lags = None
        if isinstance(self.drafter, CatchUp):
            lag = self._guard("lag", self.drafter.lag, lengths())
        if isinstance(self.drafter, Chains):
            level_lags = self._guard("lag", self.drafter.level_lags, lengths())
        if self.drafter is None:     # lag failed: the fallback already dropped the drafter
            return StepPlan(self.rows_state.widths(len(rows), 0), plain=True)
        info = StepInfo(len(rows), rows, lambda: lengths() - self.rows_state.starts[rows], remaining, self.stats.steps,
                        lag, level_lags, self.closed)
        answer = self.policy.choose(info)
        info.close()
        # Whether the policy's widths bound the model-free sources too (`Policy.width_binds_free`).
        binds = bool(getattr(self.policy.policy, "width_binds_free", False))
        if type(answer) is int and answer == 0 and (binds or not self.drafter.max_free):   # valid: a plain step
            return StepPlan(self.rows_state.widths(len(rows), 0), True, plain=True)
        if type(answer) is int and 0 < answer <= MAX_WIDTH and not self.drafter.max_free \
                and self.rows_state.min_tokens_left() > answer:
            # One width for every row, and every row has room for it and the bonus: nothing to cap, nothing to read.
            return StepPlan(self.rows_state.widths(len(rows), answer), True, most=answer, some=True)
        remaining = remaining()
        plan = check_plan(self.policy.policy, answer, len(self.rows_state.rows))
        if plan.members is not None:
            check_chain_members(self.drafter, plan.members)
        gammas = plan.gammas.to(self.device)
        if plan.depth is None:          # a step commits up to gamma + 1 tokens
            free = None
            if self.drafter.max_free and self.policy.allows_free(len(rows)):
                free = (remaining - 1).clamp(0, self.drafter.max_free)
                if binds:           # a row takes at most its width from a model-free source too
                    free = torch.minimum(free, gammas)
            # The policy's answer, read on the host: one width for every row needs no tensor read.
            most = answer if type(answer) is int else None
            if most is not None and free is not None and not binds:
                most = max(most, self.drafter.max_free)
            none = (free is None or binds) and (most == 0 if most is not None else not bool(plan.gammas.any()))
            # The bonus is cut past the budget.
            room = remaining if isinstance(self.drafter, FillsBudget) else remaining - 1
            # One width for every row, and room for a draft in every row: some row drafts, with no read.
            some = type(answer) is int and answer > 0 and self.rows_state.min_tokens_left() >= 2
            return StepPlan(torch.minimum(gammas, room), True, members=plan.members, stop=plan.stop,
                            free=free, plain=none, most=most, some=some)
        return self._tree_plan(gammas, plan, remaining)

    def _tree_plan(self, nodes, plan, remaining) -> StepPlan:
        """A tree plan: each row's depth capped by what it may still generate (a path commits depth + 1 tokens); a
        drafter that cannot branch is asked for the chain of min(nodes, depth)."""
        depths = torch.minimum(torch.full_like(nodes, plan.depth), remaining - 1)
        if not isinstance(self.drafter, Trees):
            return StepPlan(torch.minimum(nodes, depths), True, members=plan.members)
        self.policy.check_trees(self.model, self.verifier)
        return StepPlan(torch.where(depths > 0, nodes, 0), True, depths, plan.pooled, plan.members)

    def _draft(self, plan: StepPlan, noise: StepNoise | None = None) -> Proposal:
        state = self.rows_state
        batch = len(state.rows)
        if self.drafter is None or not plan.drafts:
            return Proposal.empty(batch, self.device)
        rows, choice = state.rows, self.choice
        request = DraftRequest(
            state.buffer[rows], state.lengths[rows], plan.gammas, rows, choice.sampling, choice.process,
            self.acceptor, plan.members, plan.depths, plan.pooled, plan.stop, plan.free, self.policy.cost,
            self.target if isinstance(self.drafter, ReadsTarget) else None, noise,
        )
        proposal = self._guard("propose", self._checked_proposal, request)
        return proposal if proposal is not None else Proposal.empty(batch, self.device)

    def _checked_proposal(self, request: DraftRequest) -> Proposal:
        """The drafter's answer, validated where it enters the loop (a malformed one falls back like an error)."""
        return check_proposal(self.drafter.propose(request), request, self.rows_state.vocab, self.strict)

    def _verify(self, proposal: Proposal):
        """The verifier's logits for the last committed token and the drafts. A verifier may keep fewer positions
        of a row (Top-K early exit): the row keeps that many drafts and, with no position after them, no bonus.
        Returns (proposal, bonus [B] bool or None where every row has one, scores, logits, hidden), scores and
        logits [B, S'+1, V] for the kept drafts, hidden the target's last hidden states there for a feature drafter (else None)."""
        rows, buffer = self.rows_state.rows, self.rows_state.buffer
        lengths = self.rows_state.lengths[rows]
        last = buffer[rows, lengths - 1]
        chunk = torch.cat([last[:, None], proposal.tokens], dim=1)                        # [B, S+1]
        if proposal.parents is not None:
            return self._verify_tree(proposal, chunk, lengths)
        # Every row drafting the full width (known from the proposal check's read): the ledger knows that tensor and
        # appends the columns without a hole check.
        n_valid = self.target.filled(len(lengths), chunk.shape[1]) if proposal.dense else proposal.lengths + 1
        result = self.verifier.verify(self.target, chunk, n_valid) if self.target.first is None \
            else self._verify_first(proposal, n_valid)
        bonus = None                     # every position kept (a full verification): every row has its bonus
        if result.kept is not n_valid:
            bonus = result.kept > proposal.lengths
            proposal = proposal.cut(result.kept)
        logits = _pad_positions(_as_float(result.logits), proposal.tokens.shape[1] + 1)     # [B, S'+1, V]
        if not self.choice.process.processors:
            return proposal, bonus, logits, logits, result.hidden
        context = with_drafts(buffer[rows], lengths, proposal.tokens)
        scores = self.choice.process.positions(logits, context, lengths, proposal.lengths + 1, rows)
        return proposal, bonus, scores, logits, result.hidden

    def _verify_first(self, proposal: Proposal, n_valid) -> Verification:
        """The first step's verification where the first token waited for it (`_commit_first`): the prefill already
        fed each prompt's last token and gave the logits after it, so the drafts alone follow, in one full forward
        (stock's first assisted step feeds the prompt and its drafts in one). Every position is kept (`n_valid`)."""
        first, self.target.first = self.target.first, None
        width = proposal.tokens.shape[1]
        if not width:                    # no row drafted (a drafter that failed): the prefill's logits alone
            return Verification(first, n_valid)
        drafted = self.target.filled(len(n_valid), width) if proposal.dense else proposal.lengths
        logits = self.target.forward(proposal.tokens, drafted)
        return Verification(torch.cat([first, _as_float(logits)], dim=1), n_valid)

    def _verify_tree(self, proposal: Proposal, chunk, lengths):
        """A tree: one forward where each node sees its ancestors; every position is kept (a bonus for every row)."""
        result = self.verifier.verify(self.target, chunk, proposal.lengths + 1, parents=chunk_tree(proposal.parents))
        logits = result.logits.float()
        anc, depth = ancestry(proposal.parents, proposal.lengths)
        rows = self.rows_state.rows
        scores = tree_positions(self.choice.process, logits, self.rows_state.buffer[rows], lengths, proposal.tokens,
                                anc, depth, proposal.lengths, rows)
        return proposal, torch.ones_like(lengths, dtype=torch.bool), scores, logits, result.hidden

    def _accept(self, scores: torch.Tensor, proposal: Proposal, noise: StepNoise | None = None):
        """(accepted [B], next_token [B], path): path [B, S] bool marks a tree's accepted nodes (None: a chain).
        `noise`: the step's keyed noise (sampling by the coupled rule)."""
        return self.ranks.decide(self._accept_here, scores, proposal, noise)

    def _accept_here(self, scores: torch.Tensor, proposal: Proposal, noise: StepNoise | None = None):
        sampling = self.choice.sampling
        if proposal.parents is not None:
            path, accepted, next_token = self.acceptor.accept_tree(
                scores, proposal.tokens, proposal.parents, proposal.probs, proposal.lengths, sampling, noise)
            return accepted, next_token, path
        accepted, next_token = self.acceptor.accept(scores, proposal.tokens, proposal.probs, proposal.lengths,
                                                    sampling, noise)
        return accepted, next_token, None

    def _commit(self, rows, old, new, n_new, limits=None, every_one: bool = False):
        """The one writer of committed tokens, for a drafting step, a plain step and the first token alike. Row b of
        `rows` (user rows, committed up to old[b]) keeps its first n_new[b] tokens of new [B, K] as far as the stopping
        criteria let it (an EOS, its limit, the other criteria: `Stopper.cut`), ends with the batch where rows wait
        for each other (`Stopper.settle`), and ends as the leading rank says; the lengths become old + kept, and rows
        that had left past where the batch ends give those tokens back, uncounted. `limits`: the rows' limits
        (default the active rows'); `every_one`: new is [B, 1] and every row keeps its token (`Stopper.cut`).

        Returns (n_keep [B], finished [B]): n_keep[b] < 0 where `Stopper.settle` took back tokens of earlier steps.
        What follows a commit (rollback, records, counts, the stream) is the caller's."""
        state = self.rows_state
        limits = state.row_limits() if limits is None else limits
        n_keep, finished = self.stopper.cut(state.buffer, rows, old, new, n_new, state.pad_id, limits, every_one)
        if self.stopper.waits:           # only then does settle write limits: what the rows keep of them is stale
            state.limits_written()
        n_keep, finished, taken = self.stopper.settle(state.buffer, rows, old, n_keep, finished, state.limits,
                                                      state.lengths, state.pad_id)
        n_keep, finished = self._agree_stop(rows, old, new, n_keep, finished)
        state.set_lengths(rows, old + n_keep, new.shape[1])
        for row, k in taken:     # rows that had left past where the batch ends (Stopper.settle)
            self._take_back(row, k)
        return n_keep, finished

    def _commit_drafts(self, proposal, accepted, next_token, scores, logits, bonus, path, hidden, gammas):
        """A drafting step's commit (`_commit`): each row's accepted drafts and the token after them (a correction, or
        the bonus where the row has one: `bonus` [B] bool, None where every row has one), then the rollback of what
        every model cached past them. A tree commits its accepted path as a chain: the ledgers keep the path's slots
        and the rest become holes. `hidden`: the target's last hidden states of the forward, whose committed positions
        go to a feature drafter after its rollback. Returns the step's `StepCounts`, its one host copy, made before
        the rollback, which reads from it what each row gives back."""
        drafted, given = proposal.tokens.shape[1], proposal    # a tree's record counts its nodes
        if path is not None:
            self.target.keep_tree(torch.cat([torch.ones_like(path[:, :1]), path], dim=1))   # the root stays
            if isinstance(self.drafter, Trees):
                self._guard("keep_tree", self.drafter.keep_tree, path)
            proposal, scores, logits, hidden = _along_path(proposal, path, scores, logits, hidden)
        rows = self.rows_state.rows
        old = self.rows_state.lengths[rows]
        new = committed_tokens(proposal.tokens, accepted, next_token, fill=self.rows_state.pad_id)   # [B, S+1]
        n_new = accepted + 1 if bonus is None else accepted + ((accepted < proposal.lengths) | bonus).long()
        n_keep, finished = self._commit(rows, old, new, n_new)
        self.rows_state.finished = finished
        committed = n_keep.clamp(min=0) if self.stopper.waits else n_keep    # tokens taken back are not counted
        counts = StepCounts.read(rows, gammas, given, accepted, committed, finished)
        # Rollback: what each model cached beyond the accepted drafts is not part of the sequence any more.
        keep = old + accepted
        self.target.rollback(keep, counts.dropped(proposal, bonus))
        if self.drafter is not None and drafted and len(rows):
            self._guard("rollback", self.drafter.rollback, keep)
        self._after_commit(rows, old, keep, new, n_keep, scores, logits, hidden)
        return counts

    def _after_commit(self, rows, old, keep, new, n_keep, scores, logits, hidden) -> None:
        """What follows a step's commit and rollback (to `keep` [B]): a feature drafter gets the target's hidden
        states of the positions kept (the last committed token's and the accepted drafts'), the call keeps the scores
        and logits it returns, the streamer gets row 0's tokens, and tokens `Stopper.settle` took back leave the
        counts."""
        if hidden is not None:
            self._hand_hidden(hidden, keep - old + 1)
        self.returns.record(rows, n_keep, scores, logits)
        if self.streamer is not None and int(rows[0]) == 0:    # the streamer follows the user's row 0
            self.streamer.put(new[0, : max(int(n_keep[0]), 0)].cpu())
        if self.stopper.waits:           # only Stopper.settle takes back tokens of earlier steps
            taken = n_keep < 0           # they are not counted
            if bool(taken.any()):
                self._count_tokens(rows[taken], n_keep[taken])

    def _commit_first(self, rows, logits):
        """The first token of freshly prefilled rows (`logits` [n, 1, V] after each prompt), as a step without drafts:
        processed, chosen by the accept phase and committed (`_commit`), counted. A generate call's rows and requests
        that join a running batch both start here. Returns (tokens kept [n], finished [n], scores [n, 1, V]).

        Where the first token waits for the first step's drafts (`_first_waits`), none is committed here: the
        prefill's logits wait (`first`) as the first position of the first step, which drafts from the prompt and
        verifies its drafts alone (`_verify_first`; `_plain_step` where no row drafts), so the accept phase chooses
        the first token over them, as stock's first assisted step does. Returns then (zeros, none finished,
        scores [n, 0, V])."""
        state = self.rows_state
        old = state.lengths[rows].clone()
        if self._first_waits():
            self.target.first = logits
            kept = torch.zeros_like(old)
            return kept, kept.bool(), logits[:, :0]
        scores = self.choice.process.positions(logits, state.buffer[rows], old, torch.ones_like(old), rows)
        noise = self.choice.step_noise(state, rows)
        _, next_token, _ = self._accept(scores, Proposal.empty(len(rows), self.device), noise)
        n_keep, finished = self._commit(rows, old, next_token[:, None], torch.ones_like(old), state.limits[rows])
        self._count_tokens(rows, n_keep)
        return n_keep, finished, scores

    def _first_waits(self) -> bool:
        """Whether a call's first token waits for the first step's drafts: the acceptor judges it with drafts
        (`Acceptor.judges_first`), every row has room for a token (a generate call's rows share one prompt width and
        one budget), and the drafter drafts from the prompt (a feature drafter, `Drafter.wants_hidden`, drafts from
        the target's hidden states of the first token, as stock's MTP, whose first step drafts nothing). A serving
        engine's rows commit theirs after their prefill. The leading rank's answer."""
        if not (self.closed and self.acceptor.judges_first and self.drafter is not None
                and self.stopper.max_length > self.prompt[0].shape[1]):
            return False
        return self.ranks.decide(lambda: not self.drafter.wants_hidden)

    def _agree_stop(self, rows, old, new, n_keep, finished):
        """The stopping criteria's verdict is the leading rank's (a time limit reads each rank's own clock); a rank
        that wrote another number of tokens rewrites its block: the kept ones, then padding."""
        agreed, done = self.ranks.decide(lambda: (n_keep, finished))
        if self.ranks.leader:
            return n_keep, finished
        state = self.rows_state
        room = torch.minimum(torch.full_like(old, new.shape[1]), state.limits[rows] - old)
        b, j = (torch.arange(new.shape[1], device=self.device)[None, :] < room[:, None]).nonzero(as_tuple=True)
        state.buffer[rows[b], old[b] + j] = torch.where(j < agreed[b], new[b, j], state.pad_id)
        for b in (agreed < 0).nonzero().flatten().tolist():     # Stopper.settle took back earlier tokens
            state.buffer[rows[b], int(old[b] + agreed[b]): int(old[b])] = state.pad_id
        return agreed, done

    def _plain_step(self, plan: StepPlan, t0: float) -> None:
        """A step in which no row drafts (every width 0), as `step` runs it with an empty proposal, minus what only
        drafts need: what stock's decode step does (one forward over each row's last token, the processors, the
        argmax or a sample, the stop, the cache) and the record, which keeps its per-row fields as tensors (copied
        to the host only by whoever reads them). No draft request, no buffer copy with drafts, no acceptance over
        drafts, no rollback of drafts. The same tokens, cache, statistics and records as `step`."""
        state = self.rows_state
        rows = state.rows
        old = state.lengths[rows]
        noise = self.choice.step_noise(state)     # sampling's keyed noise: its one read before the forward is queued
        state.reserve(1)
        t1 = self.clock.now()
        ones = self.target.ones(len(rows))
        if self.target.first is not None:   # the first token waited (`_commit_first`): the prefill's logits score it
            result, self.target.first = Verification(self.target.first, ones), None
        else:
            result = self.verifier.verify(self.target, state.buffer[rows, old - 1][:, None], ones)    # 2. verify
        logits = _pad_positions(_as_float(result.logits), 1)                                     # [B, 1, V]
        n_new = ones if result.kept is ones else (result.kept > 0).long()    # a bonus where the position was kept
        process = self.choice.process
        scores = process.positions(logits, state.buffer[rows], old, ones, rows) if process.processors else logits
        t2 = self.clock.now()
        if self.choice.sampling:                                                                # 3. accept
            _, next_token, _ = self._accept(scores, Proposal.empty(len(rows), self.device), noise)
        else:                            # greedy without drafts: the argmax (what greedy_accept answers then)
            next_token = self.ranks.decide(_first_argmax, scores)
        new = next_token[:, None]                                                               # 4. commit
        n_keep, state.finished = self._commit(rows, old, new, n_new, every_one=n_new is ones)
        # Nothing was cached past the committed tokens: a rollback to them changes no slot, adds no hole and frees
        # nothing to compact; it runs only for a ledger that drops what left a sliding window.
        if self.target.rewind is not None:
            self.target.rollback(old)
        self._after_commit(rows, old, old, new, n_keep, scores, logits, result.hidden)
        t3 = self.clock.now()
        # The step's one host copy: the record's per-row counts and which rows finished.
        row_ids, kept, finished = torch.stack([rows, n_keep, state.finished.long()]).tolist()
        zeros = plan.gammas
        record = StepRecord(len(row_ids), row_ids, zeros, zeros, zeros, kept, t3 - t0, t1 - t0, t2 - t1,  # 5. observe
                            held=self.target.held_rows)
        self._send_record(plan, record, plain=True)
        self._retire(finished)

    def _observe(self, proposal, counts: "StepCounts", plan: StepPlan, step_time, draft_time,
                 verify_time) -> list[int]:
        """The step's record to whoever learns from it; returns which rows finished (host ints, for `_retire`)."""
        record = StepRecord(
            batch_size=len(counts.rows), rows=counts.rows, gammas=counts.gammas, drafted=counts.drafted,
            accepted=counts.accepted, committed=counts.committed, step_time=step_time, draft_time=draft_time,
            verify_time=verify_time, telemetry=proposal.telemetry, held=self.target.held_rows,
            confidence=proposal.confidence, free=proposal.free.tolist() if proposal.free is not None else None,
            path=self.verifier.path,
        )
        self._send_record(plan, record)
        return counts.finished

    def _send_record(self, plan: StepPlan, record: StepRecord, plain: bool = False) -> None:
        """The step's record to the statistics, the policy (if it planned the step), the verifier and the drafter."""
        self.stats.record(record, plain)
        if plan.asked:
            self.policy.observe(record, plain)
        self.verifier.observe(record)
        if isinstance(self.drafter, Observes):
            self._guard("observe", self.drafter.observe, record)

    def _retire(self, finished: list | None = None) -> None:
        """Rows that finished leave the batch and every ledger. A batch that takes new rows (serving) follows them
        down to none and fills again; a generate call ends with its last row. `finished`: the rows' `finished` as
        host values, where the step has already copied it (no second read)."""
        state = self.rows_state
        if not (any(finished) if finished is not None else bool(state.finished.any())):
            return
        if self.returns.cache is not None:
            self.returns.cache.keep(self.target, state.finished, state.rows)
        keep = state.leave()
        if len(state.rows) or not self.closed:
            self._shrink(keep)

    def _shrink(self, keep: torch.Tensor) -> None:
        """The ledgers follow the rows that stay. The target may keep some that left as spare rows, when the policy
        measured the bigger batch to run faster (drafters always compact: their batch shapes vary anyway)."""
        live, held = len(keep), self.target.held_rows
        rows = self.ranks.decide(self.policy.batch_rows, live, held) if live else live
        self.target.select_rows(keep, spare=rows - live)
        if self.drafter is not None:
            self._guard("select_rows", self.drafter.select_rows, keep)

    def _hand_hidden(self, hidden, count) -> None:
        """A feature drafter (`Features`) gets the target's last hidden states of the positions just
        committed: row b's first count[b] positions of `hidden` [B, W, H]."""
        if hidden is not None and isinstance(self.drafter, Features) and len(self.rows_state.rows):
            self._guard("take_hidden", self.drafter.take_hidden, hidden, count)

    # -- helpers -------------------------------------------------------------------------------------------------------
    def _guard(self, what, fn, *args):
        """Run a drafter method; on any error (out of memory included) continue without speculation.

        Nothing committed is lost: the drafter never writes the buffer or the target's cache."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - any draft failure must fall back, not abort the user's call
            if self.strict:
                raise
            self._drop_drafter(f"draft {what} failed ({type(exc).__name__}: {exc})")
            return None

    def _drop_drafter(self, why: str) -> None:
        """Continue without speculation (nothing committed is lost), saying why."""
        self.stats.fallback = f"{why}; continued without speculation"
        warnings.warn(f"spec_adapt: {self.stats.fallback}", RuntimeWarning, stacklevel=4)
        drafter, self.drafter = self.drafter, None
        try:
            drafter.end()
        except Exception:  # noqa: BLE001
            pass
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _take_back(self, row: int, k: int) -> None:
        """Forget the last k tokens a row that left had generated (its scores, logits and counts)."""
        self.returns.take_back(row, k)
        self.stats.per_row_new_tokens[row] -= k
        self.stats.new_tokens -= k

    def _count_tokens(self, rows, committed) -> None:
        for row, n in zip(rows.tolist(), committed.tolist()):
            self.stats.per_row_new_tokens[row] += n
            self.stats.new_tokens += n

    def outputs(self, name: str):
        """scores / logits as generate returns them (`Returns.stacked`)."""
        return self.returns.stacked(name, int(self.rows_state.lengths.max()) - self.prompt[0].shape[1], self.device)


class Returns:
    """What a generate call returns beside its tokens, kept as the rows commit: per user row the scores and logits of
    each token it kept (None where the call returns none), and the cache in stock's layout (`ReturnedCache`, each
    row's entries as it leaves; None where none is returned). A serving engine's returns nothing of these."""

    def __init__(self, batch: int, scores: bool = False, logits: bool = False, cache: ReturnedCache | None = None):
        self.scores = [[] for _ in range(batch)] if scores else None
        self.logits = [[] for _ in range(batch)] if logits else None
        self.cache = cache

    def record(self, rows, n_keep, scores, logits) -> None:
        """Each of `rows`' kept scores and logits: n_keep[b] positions of row b (< 0: `Stopper.settle` took back that
        many tokens of earlier steps)."""
        for store, values in ((self.scores, scores), (self.logits, logits)):
            if store is None:
                continue
            for b, row in enumerate(rows.tolist()):
                n = int(n_keep[b])
                if n < 0:              # Stopper.settle took back tokens of earlier steps
                    del store[row][n:]
                store[row].extend(values[b, : max(n, 0)].unbind(0))

    def take_back(self, row: int, k: int) -> None:
        """Forget the last k positions of a row that left."""
        for store in (self.scores, self.logits):
            if store is not None:
                del store[row][-k:]

    def stacked(self, name: str, steps: int, device):
        """scores / logits as generate returns them: a tuple with one [B0, V] tensor per generated position (rows
        that had already finished hold zeros there); None where the call keeps none."""
        store = self.scores if name == "scores" else self.logits
        if store is None:
            return None
        vocab = next(t for per_row in store for t in per_row).shape[-1]
        out = torch.zeros(steps, len(store), vocab, device=device)
        for row, values in enumerate(store):
            if values:
                out[: len(values), row] = torch.stack(values)
        return tuple(out.unbind(0))


class PolicyHandle:
    """The loop's policy, the lock it decides under (`policy_lock`: a policy shared by calls in several threads decides
    in turn) and the call's one step-cost model (`share_cost`): the policy's, which its `observe` writes, else the
    handle's own (`own_cost`), which `observe` writes from each step's record. The drafter and verifier read `cost`."""

    def __init__(self, policy: Policy, verifier: Verifier):
        self.policy, self.lock = policy, policy_lock(policy)
        self.own_cost, self.cost = share_cost(policy, verifier, self.lock)
        self.trees_checked = False     # whether the target and verifier were checked for trees (once per call)

    def begin(self, batch: int) -> None:
        with self.lock:
            self.policy.begin(batch)

    def prefilled(self, tokens: int, seconds: float) -> None:
        with self.lock:
            self.policy.prefilled(tokens, seconds)

    def admit(self, rows: list[int]) -> None:
        with self.lock:
            self.policy.admit(rows)

    def choose(self, info: StepInfo):
        with self.lock:
            return self.policy.choose(info)

    def allows_free(self, batch: int) -> bool:
        with self.lock:
            return bool(self.policy.allows_free(batch))

    def observe(self, record: StepRecord, plain: bool) -> None:
        with self.lock:
            self.policy.observe(record)
            if self.own_cost is not None:
                self.own_cost.observe_record(record, plain)

    def batch_rows(self, live: int, held: int) -> int:
        with self.lock:
            answer = self.policy.batch_rows(live, held)
        return check_rows(self.policy, answer, live, held)

    def check_trees(self, model, verifier: Verifier) -> None:
        if not self.trees_checked:     # once per call: a policy may plan trees the call did not announce
            check_trees(model, verifier)
            self.trees_checked = True


class TokenChoice:
    """How the loop chooses tokens: the score processor, whether it samples, and where it samples by the coupled rule
    (`keyed`) its keyed noise (spec_adapt.noise): each user row's key (`keys`, by row number, set by who makes the
    rows) and the generator of the draws, on the target's device, made at the first draw."""

    def __init__(self, process: ScoreProcessor, sampling: bool, rule: str, device):
        self.keys, self.device, self.generator = None, device, None
        self.set(process, sampling, rule)

    def set(self, process: ScoreProcessor, sampling: bool, rule: str) -> None:
        self.process, self.sampling = process, bool(sampling)
        self.keyed = self.sampling and rule == "coupled"

    def step_noise(self, state: Rows, rows=None) -> StepNoise | None:
        """The keyed noise of a step of `rows` (default the active rows; None unless `keyed`): each row's key and the
        tokens it has generated, read once. Its draws are made when the drafter or the accept phase first reads a
        position, and kept for the step."""
        if not self.keyed:
            return None
        rows = state.rows if rows is None else rows
        row_list, base = torch.stack([rows, state.lengths[rows] - state.starts[rows]]).tolist()
        if self.generator is None:
            self.generator = torch.Generator(self.device)
        return StepNoise([self.keys[r] for r in row_list], base, state.vocab, self.device, self.generator)


class Clock:
    """The loop's clock: on a GPU, when the policy learns from times (Policy.needs_timing), points on the device's
    timeline (`DeviceMark`), so the phases' times are the device's without a sync per phase; otherwise host time
    (approximate on a GPU, where the host runs ahead of the device). `started`: when the loop began (`start`)."""

    def __init__(self, device, timed: bool):
        self.device, self.started = device if device.type == "cuda" and timed else None, None

    def now(self):
        return DeviceMark(self.device) if self.device is not None else time.perf_counter()

    def start(self) -> None:
        self.started = self.now()

    def elapsed(self) -> float:
        """Seconds since `start`."""
        return self.now() - self.started


class StepCounts(NamedTuple):
    """A drafting step's per-row counts as host ints, in one copy: each `tolist` of a device tensor is a copy and,
    on a GPU, a wait of its own. The rollback reads what rows give back from them, the record everything."""

    rows: list
    gammas: list
    drafted: list
    accepted: list
    committed: list
    finished: list

    @classmethod
    def read(cls, rows, gammas, proposal, accepted, committed, finished) -> "StepCounts":
        return cls(*torch.stack([rows, gammas, proposal.lengths, accepted, committed, finished.long()]).tolist())

    def dropped(self, proposal, bonus) -> list | None:
        """How many of the verification's columns each row gives back, where every row verified all its drafts
        (`Proposal.dense`, every position kept: `bonus` None): the drafts past those it accepted; else None."""
        if not proposal.dense or bonus is not None:
            return None
        width = proposal.tokens.shape[1]
        return [width - a for a in self.accepted]


class DeviceMark:
    """A CUDA event recorded on the device's current stream. `later - earlier` is the seconds between two marks: it
    waits for `later` alone (events on one stream complete in order, so the earlier ones are then done too), which
    is the step's one wait for its times; the record's per-row counts read after it cost no further wait."""

    __slots__ = ("event",)

    def __init__(self, device):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(torch.cuda.current_stream(device))

    def __sub__(self, earlier: "DeviceMark") -> float:
        self.event.synchronize()
        return earlier.event.elapsed_time(self.event) / 1e3


def _along_path(proposal: Proposal, path, scores, logits, hidden=None):
    """A verified tree as the chain of its accepted path: (proposal, scores, logits, hidden) of the root and the
    path (hidden None where the forward kept none)."""
    nodes, counts = path_nodes(path)                                                # [B, A]
    root = nodes.new_zeros((nodes.shape[0], 1))                    # column 0 even where no row accepted a node (A = 0)
    columns = torch.cat([root, nodes + 1], dim=1)                                   # [B, A+1]
    index = columns[..., None].expand(-1, -1, scores.shape[-1])
    chain = Proposal(proposal.tokens.gather(1, nodes), counts, None, proposal.telemetry)
    if hidden is not None:
        hidden = hidden.gather(1, columns[..., None].expand(-1, -1, hidden.shape[-1]))
    return chain, scores.gather(1, index), logits.gather(1, index), hidden


class _ComputedOnce:
    """A value computed on first call and kept."""

    __slots__ = ("make", "value")

    def __init__(self, make):
        self.make, self.value = make, None

    def __call__(self):
        if self.make is not None:
            self.value, self.make = self.make(), None
        return self.value


def _as_float(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits (no dispatch where they are already)."""
    return logits if logits.dtype == torch.float32 else logits.float()


def _first_argmax(scores: torch.Tensor) -> torch.Tensor:
    return scores[:, 0].argmax(dim=-1)


def target_ledger(model, drafter, kernels: str, cache=None) -> KVLedger:
    """A ledger for the target's forwards (a call's, or prompts joining a serving batch) as `drafter` (the user's,
    the same on every rank) needs it: rolled back never below a commit, its sliding layers keeping the extra
    positions a drafter that reads the target's keys asks for (`ReadsTarget`), and the last hidden states kept for a
    feature drafter (`Features`)."""
    rewind = drafter.reads_target if isinstance(drafter, ReadsTarget) else 0
    ledger = KVLedger(model, cache, kernels=kernels, rewind=rewind)
    ledger.want_hidden = isinstance(drafter, Features)
    return ledger


def _pad_positions(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Logits [B, W, V] widened to `width` positions by repeating the last one. Only a row that a verifier cut at the
    batch's widest position needs it: the accept phase reads its (unused) bonus slot."""
    if logits.shape[1] >= width:
        return logits
    return torch.cat([logits, logits[:, -1:].expand(-1, width - logits.shape[1], -1)], dim=1)
