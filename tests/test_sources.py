"""MultiSourceDrafter: a draft model beside model-free sources (prompt lookup, the suffix index), chosen per row and
step by the router. Greedy output is stock's token for token, sampled output keeps the target's distribution, the
router really picks per row, and every check makes sure the sources really drafted (no silent fallback)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec_adapt
from spec_adapt import Adaptive, FixedLength, ModelDrafter, PromptLookupDrafter, ScriptedDrafter
from spec_adapt.drafters.drafter import DraftRequest, InvalidProposal, Proposal, check_proposal
from spec_adapt.drafters.sources import MODEL, MODEL_OPTIMISM, PLAIN, MultiSourceDrafter, SourceState
from spec_adapt.policies.cost import StepCost
from spec_adapt.policies.estimators import SourceAcceptance
from spec_adapt.serving.engine import Engine
from spec_adapt.tools.synthetic import perturbed_copy

from conftest import EOS, PAD, VOCAB, Oracle, cached_model, drive_engine, ragged_batch, stock_greedy, tiny_model
from test_sampling import exact_marginals, follows_target, small  # noqa: F401  (small: the sampling models fixture)

TARGET = cached_model("llama")
GOOD_DRAFT = perturbed_copy(TARGET, 0.05, seed=3)      # most of its drafts are right: the router keeps choosing it


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and other processes share the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class FixedCost(StepCost):
    """A step-cost model that learns nothing from the clock: the router's choices depend only on the tokens and on
    what the acceptance estimates learned, so every run of these tests makes the same choices."""

    def __init__(self, verify_slope: float = 0.1, per_token: float = 0.05):
        super().__init__()
        self.verify_slope, self.per_token = verify_slope, per_token

    def observe_verify(self, batch, fed, seconds, path="full"):
        pass

    def observe_draft(self, source, batch, tokens, seconds):
        pass

    def verify_time(self, batch, fed, path="full"):
        return 1.0 + self.verify_slope * (fed - 1)

    def draft_time(self, source, batch, tokens, unknown=None):
        return self.per_token * tokens


def fixed_state(max_free: int = 32) -> SourceState:
    state = SourceState(max_free)
    state.cost = FixedCost()
    return state


def known_state(free: str, max_free: int = 32) -> SourceState:
    """`fixed_state` where the router has already seen the draft model right half the time at each position over
    many steps and the model-free source `free` always right: not cold, so neither is explored optimistically and
    the rows offered something take the free source from the first step."""
    state = fixed_state(max_free)
    for _ in range(200):
        state.acceptance.observe("model", 0, 3, 1)
        for opening in (0, 1):                     # its feature (0) on and after a row's opening step
            state.acceptance.observe(free, opening, 3, 3)
    return state


def repetitive_batch(batch: int, seed: int):
    """Ragged left-padded prompts whose tail repeats twice: prompt lookup finds matches from the first step."""
    ids, mask = ragged_batch(batch, seed=seed, max_len=9)
    tail = ids[:, -4:]
    ids = torch.cat([ids, tail, tail], dim=1)
    mask = torch.cat([mask, torch.ones(batch, 8, dtype=torch.long)], dim=1)
    return ids, mask


def looping_batch(batch: int, seed: int, distinct=()):
    """Ragged prompts followed by the target's own 16 greedy tokens, which on these tiny models already cycle: the
    first tokens generated after them repeat tokens of the prompt, so prompt lookup has offers from the first step
    on. Rows in `distinct` end in 12 distinct tokens instead."""
    ids, mask = ragged_batch(batch, seed=seed, max_len=9)
    ids = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=16)
    mask = torch.cat([mask, torch.ones(batch, 16, dtype=torch.long)], dim=1)
    for b in distinct:
        ids[b, -12:] = torch.arange(20, 32)
    return ids, mask


def run(model, ids, mask, drafter, policy, eos=None, max_new_tokens=30, **kw):
    stats = spec_adapt.SpecStats()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=eos,
                         max_new_tokens=max_new_tokens, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=policy, spec_stats=stats, **kw)
    return out, stats


def drafted(stats, name) -> int:
    return stats.per_source.get(name, {}).get("drafted", 0)


class Unbound(FixedLength):
    """A fixed width for the draft model only: model-free sources may draft beyond it, up to the drafter's
    `max_free` (`Policy.width_binds_free` False, the contract's default; FixedLength binds every source)."""

    width_binds_free = False


# -- 1. greedy identity ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_greedy_identity_with_several_sources(batch):
    """Ragged repetitive prompts, three policies, with and without an EOS that the output reaches (drafts run past it),
    every call learning into one SourceState: always stock's tokens, and the sources really drafted."""
    ids, mask = repetitive_batch(batch, seed=batch)
    free_run = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30)
    eos = int(free_run[0, ids.shape[1] + 6])          # row 0 emits it at its 7th token: an EOS inside the output
    references = {end: stock_greedy(TARGET, ids, mask, eos_token_id=end, max_new_tokens=30) for end in (None, eos)}
    state = fixed_state()
    totals = {}
    for name, policy in (("adaptive", Adaptive), ("fixed0", lambda: FixedLength(0)), ("free0", lambda: Unbound(0)),
                         ("fixed3", lambda: FixedLength(3))):
        for end in (None, eos):
            drafter = MultiSourceDrafter(GOOD_DRAFT, state=state)
            out, stats = run(TARGET, ids, mask, drafter, policy(), eos=end)
            assert torch.equal(out, references[end]), (name, end)
            assert stats.fallback is None and not stats.drafter_events, (name, stats.fallback)
            assert set(stats.per_source) <= {"model", "lookup", "suffix"}
            assert sum(e["drafted"] for e in stats.per_source.values()) == stats.drafted, name
            for record in stats.trace:          # a row's source, its drafts and the record agree
                sources = (record.telemetry or {}).get("source") or [None] * record.batch_size
                for source, free, d in zip(sources, record.free or [False] * len(sources), record.drafted):
                    assert d == 0 or (source in ("lookup", "suffix")) == bool(free), (name, record)
            if end is not None:                 # row 0 stopped at the EOS, as stock stopped it
                assert eos in out[0, ids.shape[1]:].tolist()
            if name in ("fixed0", "free0"):     # the policy planned no draft-model tokens
                assert "model" not in stats.per_source
            if name == "fixed0":                # and its width binds every source: nothing drafted
                assert stats.drafted == 0 and not stats.per_source
            if name == "fixed3":                # the draft model, right most of the time, keeps drafting
                assert drafted(stats, "model") > 0
            for source, entry in stats.per_source.items():
                key = (name, source)
                totals[key] = totals.get(key, 0) + entry["drafted"]
    # Every policy but FixedLength(0) drafted; with none planned by a width that does not bind the model-free sources
    # (Unbound(0)) the rows still drafted from them.
    assert totals.get(("adaptive", "model"), 0) > 0
    assert totals.get(("free0", "lookup"), 0) + totals.get(("free0", "suffix"), 0) > 0
    assert sum(n for (_, source), n in totals.items() if source == "lookup") > 0


def test_fixed_length_three_drafts_from_the_model_and_lookup():
    """FixedLength(3) on prompts whose continuation repeats them for some rows and not for others: both the draft
    model and prompt lookup draft rows in the same call, and both have drafts accepted."""
    ids, mask = looping_batch(5, seed=5, distinct=(1, 3))
    reference = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30)
    out, stats = run(TARGET, ids, mask, MultiSourceDrafter(GOOD_DRAFT, state=fixed_state()), FixedLength(3))
    assert torch.equal(out, reference) and stats.fallback is None
    assert drafted(stats, "model") > 0 and drafted(stats, "lookup") > 0
    assert stats.per_source["model"]["accepted"] > 0 and stats.per_source["lookup"]["accepted"] > 0


def widest_drafts(stats) -> tuple[int, int]:
    """(the most tokens a row drafted in one step from a model-free source, from the draft model)."""
    free = model = 0
    for record in stats.trace:
        for d, f in zip(record.drafted, record.free or [False] * record.batch_size):
            free, model = (max(free, d), model) if f else (free, max(model, d))
    return free, model


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_fixed_width_binds_every_source(k):
    """FixedLength(k) bounds every source: with the default drafter of a bare draft model, and with a router that
    knows prompt lookup always right, on prompts whose copies run long (prompt lookup offers up to `max_free` = 32
    tokens), no row drafts more than k tokens in a step from any source; k = 0 drafts nothing. Output is stock's."""
    ids, mask = looping_batch(3, seed=9)
    reference = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30)
    default_draft = perturbed_copy(TARGET, 0.05, seed=70 + k)          # a pair of its own: a cold default state
    for drafter in (default_draft, MultiSourceDrafter(GOOD_DRAFT, state=known_state("lookup"))):
        out, stats = run(TARGET, ids, mask, drafter, FixedLength(k))
        assert torch.equal(out, reference) and stats.fallback is None
        free, model = widest_drafts(stats)
        assert free <= k and model <= k, (k, free, model)
        if k == 0:
            assert stats.drafted == 0 and not stats.per_source
        elif isinstance(drafter, MultiSourceDrafter):          # the router still takes lookup, within the width
            assert drafted(stats, "lookup") > 0 and free == k


def test_free_sources_draft_beyond_the_width_of_a_policy_that_allows_it():
    """A policy whose widths do not bind the model-free sources (the contract's default, `width_binds_free`
    False) lets a row take a long copy on a step it planned at width 1, or plain: prompt lookup drafts past it."""
    ids, mask = looping_batch(3, seed=9)
    reference = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30)
    for k in (0, 1):
        out, stats = run(TARGET, ids, mask, MultiSourceDrafter(GOOD_DRAFT, state=known_state("lookup")), Unbound(k))
        assert torch.equal(out, reference) and stats.fallback is None
        free, model = widest_drafts(stats)
        assert free > 1 and model <= k, (k, free, model)


# -- 2. the default drafter of a bare draft model --------------------------------------------------------------------
def test_default_for_a_bare_draft_model_uses_several_sources(monkeypatch):
    """`drafter=<a bare model>` and `assistant_model=` after enable draft from several sources (the router runs),
    an explicit ModelDrafter from the model alone; all identical to stock. The calls' step-cost models (their
    policy keeps none) are made as `FixedCost`: step costs learned from the wall clock would make the router's
    choices depend on the machine's load, and the rows' sources asserted below with them."""
    import spec_adapt.policies.cost as cost_module

    monkeypatch.setattr(cost_module, "StepCost", FixedCost)
    routed = []
    route = MultiSourceDrafter.route
    monkeypatch.setattr(MultiSourceDrafter, "route", lambda self, *a, **k: routed.append(1) or route(self, *a, **k))
    target = TARGET
    ids, mask = looping_batch(3, seed=40, distinct=[1])     # row 1: nothing for prompt lookup to find
    reference = stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=30)

    # A fresh draft model has a cold default state. Row 1, offered nothing by prompt lookup, drafts from the model
    # (and the suffix index); the repetitive rows take prompt lookup's long offers on some steps: several sources,
    # whatever the clock says (the model at width 1, the free sources beyond it).
    draft = perturbed_copy(target, 0.05, seed=11)
    out, stats = run(target, ids, mask, draft, Unbound(1))
    assert torch.equal(out, reference) and stats.fallback is None and routed
    sources = [set() for _ in range(3)]
    for record in stats.trace:
        for row, source in zip(record.rows, (record.telemetry or {}).get("source") or []):
            sources[row].add(source)
    sources = [names - {None} for names in sources]
    assert "model" in sources[1] and "lookup" not in sources[1], sources
    assert "lookup" in sources[0] and "lookup" in sources[2], sources
    assert drafted(stats, "lookup") > 0 and drafted(stats, "model") > 0
    assert set(stats.per_source) <= {"model", "lookup", "suffix"}

    routed.clear()
    out, stats = run(target, ids, mask, ModelDrafter(draft), FixedLength(2))    # explicit: one source
    assert torch.equal(out, reference) and stats.fallback is None and stats.drafted > 0
    assert set(stats.per_source) <= {"model"} and not routed

    spec_adapt.enable(target)
    try:
        stats = spec_adapt.SpecStats()
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                              eos_token_id=None, max_new_tokens=30, assistant_model=draft,
                              assistant_policy=FixedLength(2), spec_stats=stats)
        assert torch.equal(out, reference) and stats.fallback is None and stats.drafted > 0 and routed
        assert stats.per_source and set(stats.per_source) <= {"model", "lookup", "suffix"}

        routed.clear()
        fresh = perturbed_copy(target, 0.05, seed=12)         # cold again
        stats = spec_adapt.SpecStats()
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                              eos_token_id=None, max_new_tokens=30, assistant_model=fresh,
                              prompt_lookup_num_tokens=5, assistant_policy=Unbound(1), spec_stats=stats)
        assert torch.equal(out, reference) and stats.fallback is None and routed
        assert drafted(stats, "lookup") > 0
        assert all(d <= 5 for r in stats.trace for d, f in zip(r.drafted, r.free or [False] * r.batch_size) if f)

        routed.clear()
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
            target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                            max_new_tokens=5, assistant_model=ScriptedDrafter(lambda row, context, gamma: [3]),
                            prompt_lookup_num_tokens=5)
        assert not routed
    finally:
        spec_adapt.disable(target)
    assert "generate" not in target.__dict__


# -- 3. sampling keeps the target's distribution ---------------------------------------------------------------------
def test_sampling_with_free_and_model_rows_follows_target_distribution(small):  # noqa: F811
    """Even rows are offered fixed tokens by a scripted model-free source (point masses), odd rows are offered
    nothing and draft from the draft model: in the same steps some rows verify point masses and others the draft's
    distributions, and each of the first three tokens still has the target's exact marginal (test_sampling's
    enumeration, 5 standard errors, fixed seed and a clock-free router: the outcome is fixed)."""
    target, draft = small
    best = int(exact_marginals(target, [3, 7, 9, 4])[1].argmax())
    script = ScriptedDrafter(lambda row, context, gamma: [best, 5, 6][:gamma] if row % 2 == 0 else [])
    drafter = MultiSourceDrafter(draft, free=[script], state=known_state("ScriptedDrafter"))
    assert follows_target(target, drafter, 6000) is None
    stats = spec_adapt.last_stats()
    assert drafted(stats, "ScriptedDrafter") > 0 and drafted(stats, "model") > 0
    free_rows = [r for rec in stats.trace for r, f in zip(rec.rows, rec.free or []) if f]
    assert free_rows and all(r % 2 == 0 for r in free_rows)
    mixed = [rec for rec in stats.trace if rec.free is not None and any(rec.free)
             and any(not f and d > 0 for f, d in zip(rec.free, rec.drafted))]
    assert mixed                        # one step verified point-mass rows beside draft-model rows
    entry = stats.per_source["ScriptedDrafter"]
    assert 0 < entry["accepted"] < entry["drafted"]


def test_sampling_at_batch_two_routes_one_row_each_way(small):  # noqa: F811
    """Batch 2, row 0 offered a model-free draft and row 1 not: in the same step row 0 verifies point masses and row
    1 the draft model's distributions (the exactness of such steps is the test above's)."""
    target, draft = small
    script = ScriptedDrafter(lambda row, context, gamma: [5, 6, 7][:gamma] if row == 0 else [])
    drafter = MultiSourceDrafter(draft, free=[script], state=known_state("ScriptedDrafter"))
    prompt = torch.tensor([[3, 7, 9, 4]]).repeat(2, 1)
    torch.manual_seed(0)
    target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=0.9,
                    top_k=12, max_new_tokens=8, eos_token_id=None, pad_token_id=PAD,
                    custom_generate=spec_adapt.generate, drafter=drafter, assistant_policy=FixedLength(3))
    first = spec_adapt.last_stats().trace[0]
    assert first.rows == [0, 1] and first.free == [True, False]
    assert first.telemetry["source"] == ["ScriptedDrafter", "model"] and min(first.drafted) > 0


# -- 4. the router picks per row -------------------------------------------------------------------------------------
def per_row_sources(trace, rows):
    """For each row, how many tokens it drafted from each source."""
    counts = {row: {} for row in rows}
    for record in trace:
        sources = (record.telemetry or {}).get("source") or [None] * record.batch_size
        for row, source, d in zip(record.rows, sources, record.drafted):
            if source is not None and d > 0 and row in counts:
                counts[row][source] = counts[row].get(source, 0) + d
    return counts


def rows_took_their_right_source(trace) -> bool:
    """Rows 0 and 2 drafted mostly from the model-free script, rows 1 and 3 mostly from the `model` slot (tokens)."""
    counts = per_row_sources(trace, [0, 1, 2, 3])
    right = {0: "ScriptedDrafter", 1: "model", 2: "ScriptedDrafter", 3: "model"}
    return all(counts[row].get(name, 0) > 0.5 * sum(counts[row].values()) for row, name in right.items())


def router_scenario():
    """Batch 4, FixedLength(4): the `model` slot (a scripted drafter, charged draft time per token) is right for rows
    1 and 3, the model-free script is right for rows 0 and 2; four calls learn into one SourceState. The last
    call's stats and whether every output equalled stock."""
    ids, mask = ragged_batch(4, seed=50)
    reference = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=40)
    # eos=(): these calls have no EOS, so token 2 in the reference is an ordinary token the scripts go on past
    model_slot = ScriptedDrafter(Oracle(reference, mask, ["wrong", "right"], eos=()))
    free = ScriptedDrafter(Oracle(reference, mask, ["right", "wrong"], eos=()))
    state = fixed_state()
    identical = True
    for _ in range(4):
        out, stats = run(TARGET, ids, mask, MultiSourceDrafter(model_slot, [free], state=state), FixedLength(4),
                         max_new_tokens=40)
        identical &= torch.equal(out, reference) and stats.fallback is None
    return stats, identical


def test_router_picks_the_right_source_per_row():
    stats, identical = router_scenario()
    assert identical
    assert drafted(stats, "ScriptedDrafter") > 0 and drafted(stats, "model") > 0
    assert rows_took_their_right_source(stats.trace), per_row_sources(stats.trace, [0, 1, 2, 3])


def test_a_router_that_ignores_the_rows_fails_the_check(monkeypatch):
    """Mutation check for the test above: a router that always takes the draft model keeps the output exact, but
    the per-row check catches it."""

    def always_model(self, batch, gammas, lengths, features, rows=None, cost=None, lags=None):
        return [MODEL if g > 0 else PLAIN for g in gammas], list(gammas)

    monkeypatch.setattr(MultiSourceDrafter, "route", always_model)
    stats, identical = router_scenario()
    assert identical and drafted(stats, "model") > 0
    assert not rows_took_their_right_source(stats.trace)


def test_route_unit():
    drafter = MultiSourceDrafter(ScriptedDrafter(lambda row, context, gamma: [3] * gamma),
                                 free=[PromptLookupDrafter()], max_free=16, state=fixed_state(16))
    assert drafter.names == ["lookup"]
    acceptance = drafter.state.acceptance
    for _ in range(20):                     # lookup with a 3-token match: always right
        acceptance.observe("lookup", 3, 12, 12)
    # Row 0: a long, well-rated free offer beats the model. Row 1: an empty offer costs nothing, the model drafts.
    # Row 2: gamma 0 and no offer: plain. Row 3: gamma 0 but a free offer: drafts from it anyway.
    choice, cut = drafter.route(4, [4, 4, 0, 0], [[12, 0, 0, 12]], [[3, 0, 0, 3]])
    assert choice == [1, MODEL, PLAIN, 1]
    assert cut[0] == 12 and cut[1] == 4 and cut[2] == 0 and cut[3] == 12
    # A poorly rated offer (always wrong at its first token) loses to the model.
    for _ in range(20):
        acceptance.observe("lookup", 1, 12, 0)
    choice, cut = drafter.route(1, [4], [[12]], [[1]])
    assert choice == [MODEL] and cut == [4]
    # Nothing offered and no model width: plain for every row.
    assert drafter.route(2, [0, 0], [[0, 0]], [[0, 0]]) == ([PLAIN, PLAIN], [0, 0])


def _lookup_judged_mediocre() -> MultiSourceDrafter:
    """A router whose prompt lookup hindsight has judged (100 offers, about one token in two at the first position)
    and whose draft model has never drafted."""
    drafter = MultiSourceDrafter(ScriptedDrafter(lambda row, context, gamma: [3] * gamma),
                                 free=[PromptLookupDrafter()], max_free=16, state=fixed_state(16))
    for _ in range(50):
        drafter.state.acceptance.observe("lookup", 3, 4, 1)
        drafter.state.acceptance.observe("lookup", 3, 4, 2)
    return drafter


def test_a_draft_model_not_yet_seen_is_tried_before_a_free_source_judged_mediocre():
    """The draft model is judged only on the steps it drafts, so it is read optimistically (an upper confidence
    bound): unseen, it is tried before prompt lookup's offer; seen wrong many times, it loses to that offer."""
    drafter = _lookup_judged_mediocre()
    assert drafter.route(1, [4], [[12]], [[3]]) == ([MODEL], [4])
    for _ in range(50):
        drafter.state.acceptance.observe("model", 0, 4, 0)
    assert drafter.route(1, [4], [[12]], [[3]])[0] == [1]


def test_without_optimism_an_unseen_model_loses_to_the_free_source(monkeypatch):
    """Mutation check for the test above: read as learned, the unseen model loses at once (and so stays unseen)."""
    import spec_adapt.drafters.sources as sources

    monkeypatch.setattr(sources, "MODEL_OPTIMISM", 0.0)
    assert _lookup_judged_mediocre().route(1, [4], [[12]], [[3]])[0] == [1]


def test_the_model_pays_for_reading_a_prompt_it_has_not_read():
    """A row whose draft model has not read its prompt yet (lag 150) pays the measured catch-up over it: prompt
    lookup's weaker offer wins there, where the same row without the lag drafts from the model. A row within the
    usual lag of a token or two pays none (its draft time holds it)."""
    drafter = MultiSourceDrafter(ScriptedDrafter(lambda row, context, gamma: [3] * gamma), free=[PromptLookupDrafter()],
                                 max_free=16, state=fixed_state(16))
    for _ in range(50):
        drafter.state.acceptance.observe("model", 0, 4, 3)
        drafter.state.acceptance.observe("lookup", 2, 4, 1)
    cost = StepCost()
    for lag, seconds in ((100, 2.0), (200, 4.0), (150, 3.0)):
        cost.observe_catchup("model", 1, lag, seconds)
    drafter.state.cost = FixedCost()
    drafter.state.cost.catchup = cost.catchup
    assert drafter.route(1, [4], [[4]], [[2]], lags=[0]) == ([MODEL], [4])
    assert drafter.route(1, [4], [[4]], [[2]], lags=[2]) == ([MODEL], [4])
    assert drafter.route(1, [4], [[4]], [[2]], lags=[150])[0] == [1]


def test_the_policy_is_told_the_whole_catch_up_after_free_steps():
    """After free sources committed tokens the draft model has not read, `lag` reports them for every row, not only
    for rows whose prompt it has not read: the policy then learns that catch-up as catch-up (`Adaptive._measure`),
    not as the draft model's time per drafted token, which would make every later width look dearer than it is."""
    ids, mask = looping_batch(2, seed=31)
    drafter = MultiSourceDrafter(GOOD_DRAFT, free=[PromptLookupDrafter()], state=known_state("lookup"))
    seen = []

    class Watch(FixedLength):
        def choose(self, info):
            seen.append((info.draft_lag.tolist(), ))
            return super().choose(info)

    out, stats = run(TARGET, ids, mask, drafter, Watch(3), max_new_tokens=16)
    assert torch.equal(out, stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=16))
    assert drafted(stats, "lookup") > 0
    after_prompt = [lags for (lags,) in seen[1:]]
    assert max(max(lags) for lags in after_prompt) > 2        # a row caught up on what lookup committed


def opening_scenario():
    """Batch 2, FixedLength(3): a model-free script wrong on each row's opening step (the step after the prefill's
    token) and right after it, beside a `model` slot right for one token a step; four calls learn into one
    SourceState. The last call's stats, and whether every output equalled stock."""
    ids, mask = ragged_batch(2, seed=70)
    reference = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=24)
    right = Oracle(reference, mask, ["right", "right"], eos=())
    prompt = mask.sum(dim=1).tolist()

    def free(row, context, gamma):
        return [PAD] * gamma if len(context) == prompt[row] + 1 else right(row, context, gamma)

    state, identical = fixed_state(), True
    for _ in range(4):
        drafter = MultiSourceDrafter(ScriptedDrafter(Oracle(reference, mask, [1, 1], eos=())),
                                     [ScriptedDrafter(free)], state=state)
        out, stats = run(TARGET, ids, mask, drafter, FixedLength(3), max_new_tokens=24)
        identical &= torch.equal(out, reference)
    return stats, identical


def test_a_free_source_wrong_at_the_opening_is_learned_apart():
    """The opening step is learned apart from the steps after it: the script's offers there are wrong every time,
    so the rows draft their opening step from the model, and the script's right copies after it."""
    stats, identical = opening_scenario()
    assert identical
    assert stats.trace[0].telemetry["source"] == ["model", "model"]
    assert drafted(stats, "ScriptedDrafter") > 0


def test_without_the_opening_feature_the_opening_takes_the_copy(monkeypatch):
    """Mutation check for the test above: with one feature for every step, the script's good record after the
    opening carries over to the opening step, and its wrong offer is taken there."""
    monkeypatch.setattr(MultiSourceDrafter, "_with_opening", lambda self, features, request: features)
    stats, identical = opening_scenario()
    assert identical and stats.trace[0].telemetry["source"] != ["model", "model"]


# -- 5. SourceAcceptance properties ----------------------------------------------------------------------------------
observations = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 40)), max_size=25)


@settings(derandomize=True, max_examples=30, deadline=None)
@given(observations, st.integers(0, 3), st.integers(0, 16), st.booleans(), st.sampled_from([0.0, 2.0]))
def test_source_acceptance_expected_tokens(seen, feature, most, with_row, optimism):
    acceptance = SourceAcceptance(positions=16)
    row = torch.zeros(2, 16)
    for f, d, a in seen:
        a = min(a, d)
        acceptance.observe("s", f, d, a)
        if d > 0:
            row = row * acceptance.decay + acceptance.step_counts(d, a)
    for counts in acceptance.counts.values():
        assert bool(torch.isfinite(counts).all()) and bool((counts >= 0).all())
        assert bool((counts[1] <= counts[0] + 1e-5).all())         # accepted never exceeds reached
    expected = acceptance.expected("s", feature, most, row if with_row else None, optimism=optimism)
    assert expected.shape == (most + 1,) and float(expected[0]) == 1.0
    if optimism:          # never below the estimate as learned
        plain = acceptance.expected("s", feature, most, row if with_row else None)
        assert bool((expected >= plain - 1e-6).all())
    assert bool((expected[1:] >= expected[:-1] - 1e-6).all())
    assert bool((expected <= torch.arange(most + 1) + 1 + 1e-5).all())


def test_a_long_copy_keeps_its_rate_past_the_positions_it_reached():
    """A source whose copies survived every token they drafted, up to 8 each time: position 12, never reached, keeps
    the rate of the positions before it (a copy that has held for 8 tokens is likely to hold on), not the 0.5
    prior a fresh source starts from; a source whose drafts stop at the 2nd token has a low rate from there on."""
    acceptance = SourceAcceptance(positions=16)
    for _ in range(30):
        acceptance.observe("lookup", 3, 8, 8)
        acceptance.observe("suffix", 3, 8, 1)
    rates = acceptance.rates("lookup", 3)
    assert float(rates[11]) > 0.9 and float(rates[15]) > 0.9
    assert acceptance.expected("lookup", 3, 16)[-1] > 12
    assert float(acceptance.rates("suffix", 3)[1]) < 0.1 and float(acceptance.rates("suffix", 3)[11]) < 0.1
    assert float(acceptance.rates("lookup", 5)[0]) == acceptance.prior          # a feature never seen


def test_a_row_whose_offers_keep_failing_early_does_not_ride_the_features_long_tail():
    """The feature's copies hold for 24 tokens (other rows); this row's offers from the same source and feature
    failed at the 1st to 3rd token, six times. Its expected tokens from a 24-token offer stay near what its first
    positions show, not what the feature's tail adds (with the row's counts shrunk toward the feature's rates
    position by position alone, the positions it never reached keep the feature's ~1 rate and the 24-token offer
    reads about 11 tokens); a row whose copies held like the others' keeps the whole tail."""
    acceptance = SourceAcceptance(positions=32)
    for _ in range(30):
        acceptance.observe("suffix", 1, 24, 24)
    failing = torch.zeros(2, 32)
    for accepted in (0, 2, 1, 0, 2, 1):
        failing = failing * acceptance.decay + acceptance.step_counts(24, accepted)
    holding = torch.zeros(2, 32)
    for _ in range(3):
        holding = holding * acceptance.decay + acceptance.step_counts(24, 24)
    rows = acceptance.expected_rows("suffix", [1, 1], 24, [failing, holding])
    assert float(rows[0, 24]) < 3.0 and float(rows[0, 24] - rows[0, 3]) < 0.5
    assert float(rows[1, 24]) > 20


# -- 6. serving ------------------------------------------------------------------------------------------------------
def test_engine_with_several_sources_matches_stock_alone():
    def stock(prompt, n):
        ids = torch.tensor([prompt])
        out = TARGET.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
        return out[0, len(prompt):].tolist()

    ids, mask = looping_batch(5, seed=60)                   # prompt lookup has offers for them
    prompts = [ids[b][mask[b].bool()].tolist() for b in range(5)]
    budgets, arrivals = [14, 9, 16, 12, 10], [0, 1, 1, 3, 6]
    drafter = MultiSourceDrafter(GOOD_DRAFT, state=known_state("lookup"))
    engine = Engine(TARGET, drafter=drafter, assistant_policy=FixedLength(3), max_batch=3, eos_token_id=EOS,
                    pad_token_id=PAD)
    handles = drive_engine(engine, prompts, budgets, arrivals)
    assert engine.fallback is None
    for prompt, budget, handle in zip(prompts, budgets, handles):
        assert handle.state == "done"
        assert handle.result() == stock(prompt, budget)
    sizes = [r.batch_size for r in engine.stats.trace]
    assert max(sizes) > 1 and any(b > a for a, b in zip(sizes, sizes[1:]))     # requests joined a running batch
    assert drafted(engine.stats, "model") > 0
    assert drafted(engine.stats, "lookup") + drafted(engine.stats, "suffix") > 0


# -- 7. validation ---------------------------------------------------------------------------------------------------
def request(free=None, sampling=False):
    tokens = torch.tensor([[5, 6, 7, 8, 0, 0, 0, 0], [9, 10, 11, 12, 0, 0, 0, 0]])
    return DraftRequest(tokens, torch.tensor([4, 4]), torch.tensor([1, 1]), torch.tensor([0, 1]), sampling, None,
                        free=free)


def test_check_proposal_refuses_free_rows_the_request_does_not_allow():
    proposal = Proposal(torch.tensor([[3, 4, 5], [3, 0, 0]]), torch.tensor([3, 1]), free=torch.tensor([True, False]))
    with pytest.raises(InvalidProposal, match="free rows proposed"):
        check_proposal(proposal, request(free=None), VOCAB)
    checked = check_proposal(proposal, request(free=torch.tensor([3, 3])), VOCAB)     # allowed: a free row takes 3
    assert checked.lengths.tolist() == [3, 1] and checked.free.tolist() == [True, False]
    with pytest.raises(InvalidProposal, match="bool tensor"):
        check_proposal(Proposal(proposal.tokens, proposal.lengths, free=torch.tensor([1, 0])),
                       request(free=torch.tensor([3, 3])), VOCAB)


def test_check_proposal_refuses_a_free_row_that_is_not_point_masses():
    tokens, lengths = torch.tensor([[3, 4], [7, 8]]), torch.tensor([2, 1])
    point = torch.nn.functional.one_hot(tokens, VOCAB).float()
    smeared = point.clone()
    smeared[0, 1] = 0.5 * smeared[0, 1] + 0.5 / VOCAB            # row 0's second draft: q(d) < 1
    allowed = request(free=torch.tensor([2, 2]), sampling=True)
    ok = check_proposal(Proposal(tokens, lengths, point, free=torch.tensor([True, False])), allowed, VOCAB)
    assert ok.free.tolist() == [True, False]
    with pytest.raises(InvalidProposal, match="point masses"):
        check_proposal(Proposal(tokens, lengths, smeared, free=torch.tensor([True, False])), allowed, VOCAB)
    # The same distribution on a draft-model row (not free) is fine.
    check_proposal(Proposal(tokens, lengths, smeared, free=torch.tensor([False, True])), allowed, VOCAB)


def test_multi_source_drafter_arguments():
    draft = tiny_model("llama", seed=7, layers=1)
    for bad in (0, 10**6, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_free"):
            MultiSourceDrafter(draft, max_free=bad)
    with pytest.raises(TypeError, match="model-free"):
        MultiSourceDrafter(draft, free=[ModelDrafter(draft)])
    with pytest.raises(TypeError):
        MultiSourceDrafter("not a model")
    with pytest.raises(ValueError):
        MultiSourceDrafter(None, free=[])
    made = MultiSourceDrafter(draft)
    assert isinstance(made.model_drafter, ModelDrafter) and made.model is draft and made.names == ["lookup", "suffix"]
    assert made.max_free == 32


def test_a_long_offer_must_pay_for_the_whole_batchs_longer_step():
    """One verification serves the batch: a row's mediocre long offer that pays alone (batch 1) does not pay when
    three other rows would wait through the longer step with nothing to draft. Mutation: a router that judges each
    row against its own plain step drafts the offer at batch 4 too."""
    state = fixed_state()
    state.cost = FixedCost(verify_slope=0.2)
    for accepted in [0, 1] * 10:
        state.acceptance.observe("lookup", 2, 16, accepted)     # the first token right half the time, no more
    drafter = MultiSourceDrafter(None, free=[PromptLookupDrafter()], state=state)
    alone = drafter.route(1, [0], [[16]], [[2]])
    assert alone[0] == [1] and alone[1][0] > 0
    batch = drafter.route(4, [0] * 4, [[16, 0, 0, 0]], [[2, 0, 0, 0]])
    assert batch == ([PLAIN] * 4, [0] * 4)
    everyone = drafter.route(4, [0] * 4, [[16] * 4], [[2] * 4])      # all four rows gain: the step pays again
    assert everyone[0] == [1] * 4


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 3), min_size=0, max_size=14),
                          st.integers(0, 24)), min_size=1, max_size=5),
       st.integers(1, 4), st.integers(1, 4))
def test_batched_lookup_equals_the_per_row_rule(rows, a, b):
    """lookup_batch (every row in one set of tensor operations) proposes exactly what lookup_match proposes row by
    row: the most recent match of the longest suffix, copies that run off the end repeating, rows without a match or
    without a budget proposing nothing; left padding and garbage after a row's end never read."""
    from spec_adapt.drafters.lookup import lookup_batch, lookup_match

    min_ngram, max_ngram = min(a, b), max(a, b)
    width = max(pad + len(ctx) for pad, ctx, _ in rows) + 3
    tokens = torch.full((len(rows), width), 9, dtype=torch.long)      # 9: padding and garbage, never in a context
    for i, (pad, ctx, _) in enumerate(rows):
        tokens[i, pad:pad + len(ctx)] = torch.tensor(ctx, dtype=torch.long)
    starts = torch.tensor([pad for pad, _, _ in rows])
    ends = torch.tensor([pad + len(ctx) for pad, ctx, _ in rows])
    gammas = torch.tensor([g for _, _, g in rows])
    drafts, lengths, matched = lookup_batch(tokens, starts, ends, gammas, max_ngram, min_ngram)
    for i, (pad, ctx, gamma) in enumerate(rows):
        want, n = lookup_match(torch.tensor(ctx, dtype=torch.long), gamma, max_ngram, min_ngram) if gamma and ctx \
            else ([], 0)
        assert drafts[i, :int(lengths[i])].tolist() == want
        assert int(matched[i]) == n


def _route_row_by_row(drafter, batch, gammas, lengths, features, rows):
    """The router's rule written plainly, one row, option and width at a time (the reference `route` must equal)."""
    acceptance, most = drafter.state.acceptance, drafter.max_free
    cost = drafter.state.cost
    verify = [cost.verify_time(batch, w + 1) for w in range(most + 1)]
    drafting = [cost.draft_time("model", batch, k) for k in range(most + 1)]
    table = [[[-math.inf] * (most + 1) for _ in range(len(drafter.names) + 2)] for _ in range(batch)]
    for b in range(batch):
        if gammas[b] == 0:
            table[b][0] = [1.0] * (most + 1)
        offers = [(i + 1, name, min(lengths[i][b], most), features[i][b]) for i, name in enumerate(drafter.names)]
        if gammas[b] > 0:
            offers.append((len(drafter.names) + 1, "model", min(gammas[b], most), 0))
        for slot, name, n, feature in offers:
            if n > 0:
                optimism = MODEL_OPTIMISM if name == "model" else 0.0
                expected = acceptance.expected(name, feature, n, drafter.row_counts.get((name, rows[b])),
                                               optimism=optimism)
                for w in range(1, most + 1):
                    table[b][slot][w] = float(expected[min(w, n)])
        if gammas[b] > 0:
            for w in range(min(gammas[b], most)):
                table[b][-1][w] = -math.inf
    best = (-1.0, None, None)
    for with_model in (False, True) if any(g > 0 for g in gammas) else (False,):
        for w in range(most + 1):
            options = [[table[b][o][w] for o in range(len(table[b]) - (0 if with_model else 1))] for b in range(batch)]
            picks = [max(range(len(o)), key=lambda k, o=o: (o[k], -k)) for o in options]   # first best
            values = [options[b][k] for b, k in enumerate(picks)]
            if any(math.isinf(v) for v in values):
                continue
            model_width = max([min(gammas[b], most) for b, k in enumerate(picks) if k == len(table[b]) - 1],
                              default=0)
            rate = sum(values) / (verify[w] + drafting[model_width])
            if rate > best[0]:
                best = (rate, picks, w)
    return drafter._choices(torch.tensor(best[1]), best[2], gammas, lengths)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.integers(1, 6), st.data())
def test_route_equals_the_rule_row_by_row(batch, data):
    """The router's vectorized choice (every width and row at once) equals the rule applied row by row, with
    learned rates, rows' own counts and measured costs."""
    drafter = MultiSourceDrafter(None, [PromptLookupDrafter(), spec_adapt.SuffixDrafter()], max_free=6)
    acceptance = drafter.state.acceptance
    for _ in range(data.draw(st.integers(0, 12))):
        source = data.draw(st.sampled_from(["lookup", "suffix", "model"]))
        drafted = data.draw(st.integers(1, 6))
        accepted = data.draw(st.integers(0, drafted))
        drafter._learn(source, data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, 3)), drafted, accepted)
    for w in range(1, 8):
        drafter.state.cost.observe_verify(batch, w, 0.1 + data.draw(st.floats(0.0, 0.05)) * w)
    drafter.state.cost.observe_draft("model", batch, 2, data.draw(st.floats(0.01, 0.2)))
    gammas = data.draw(st.lists(st.integers(0, 8), min_size=batch, max_size=batch))
    lengths = [data.draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch)) for _ in range(2)]
    features = [data.draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)) for _ in range(2)]
    rows = list(range(batch))
    assert drafter.route(batch, gammas, lengths, features, rows) == \
        _route_row_by_row(drafter, batch, gammas, lengths, features, rows)


class RecordingFixedCost(FixedCost):
    """Reads fixed numbers (so every choice is the same on any machine) and records what it is told, as a StepCost."""

    observe_verify = StepCost.observe_verify

    def observe_draft(self, source, batch, tokens, seconds):
        self.told = getattr(self, "told", []) + [(source, tokens, seconds)]
        StepCost.observe_draft(self, source, batch, tokens, seconds)


class AdaptiveDraftingThree(Adaptive):
    """`Adaptive` learning as always, but planning by a count, not by its own choices (they read the clock): plain
    steps until its plain step is measured (model-free drafts are allowed from then on), then 3 drafts per row."""

    def choose(self, info):
        super().choose(info)
        return 3 if self.allows_free(info.batch_size) else 0


def test_the_router_reads_the_policys_step_cost_and_learns_no_times_of_its_own():
    """One step-cost model: under `Adaptive` the router weighs the policy's `StepCost` (DraftRequest.cost) and its
    own stays empty; the policy learns the draft model's seconds, at the width it drafted, from the steps where free
    rows drafted too. Under a policy that keeps none (FixedLength) the router reads the call's own, one model for the
    whole call, which the loop writes, and its state's stays empty."""
    ids, mask = looping_batch(3, seed=40, distinct=[1])      # row 1: nothing for prompt lookup, it drafts the model
    reference = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30)
    seen = []
    drafter = MultiSourceDrafter(GOOD_DRAFT)
    route = drafter.route
    drafter.route = lambda *a, **k: seen.append(a[5]) or route(*a, **k)        # (batch, gammas, ..., rows, cost)
    policy = AdaptiveDraftingThree()
    policy.cost = RecordingFixedCost()
    out, stats = run(TARGET, ids, mask, drafter, policy)
    assert torch.equal(out, reference) and stats.fallback is None
    assert seen and all(c is not None and c.cost is policy.cost for c in seen)
    assert not drafter.state.cost.verify and not drafter.state.cost.draft
    mixed = [r for r in stats.trace if r.free is not None and any(r.free) and "model" in (r.telemetry or {})
             .get("source", [])]
    assert mixed and policy.cost.verify and any(source == "model" for source, _ in policy.cost.draft)
    for r in mixed:                 # the policy learned the model's own seconds there, at the width it drafted
        width, seconds = r.telemetry["draft_seconds"]["model"]
        assert seconds > 0 and width == max(d for d, s in zip(r.drafted, r.telemetry["source"]) if s == "model")
        assert ("model", width, seconds) in policy.cost.told

    own, handed = MultiSourceDrafter(GOOD_DRAFT), []
    own_route = own.route
    own.route = lambda *a, **k: handed.append(a[5]) or own_route(*a, **k)
    out, stats = run(TARGET, ids, mask, own, FixedLength(2))
    assert torch.equal(out, reference) and handed and len({id(c.cost) for c in handed}) == 1
    assert handed[0].cost.verify and handed[0].cost.draft and not own.state.cost.verify and not own.state.cost.draft


def test_route_weighs_the_cost_it_is_given():
    """A cost model where every extra verified token is dear makes the router cut a long, well-rated offer short."""
    drafter = MultiSourceDrafter(None, [PromptLookupDrafter()], max_free=8, state=fixed_state(8))
    for _ in range(20):
        drafter.state.acceptance.observe("lookup", 3, 8, 6)          # right for 6 of 8, every time

    class Dear:
        def __init__(self, per_token):
            self.per_token = per_token

        def verify_times(self, batch, feds):
            return [1.0 + self.per_token * (fed - 1) for fed in feds]

        def draft_time(self, source, batch, tokens, unknown=None):
            return 0.0

    _, cheap = drafter.route(1, [0], [[8]], [[3]], None, Dear(0.01))
    _, dear = drafter.route(1, [0], [[8]], [[3]], None, Dear(2.0))
    assert cheap[0] >= 6 and dear[0] < cheap[0], (cheap, dear)


def test_route_pays_the_draft_models_first_token_overhead_once():
    """The draft model's time is a line a + d k in the tokens drafted: a large a (a forward, the catch-up) is paid
    once per step, not once per token, so a well-rated 4-token model draft beats a poor free offer."""
    drafter = MultiSourceDrafter(ScriptedDrafter(lambda row, context, gamma: [3] * gamma),
                                 free=[PromptLookupDrafter()], max_free=8, state=fixed_state(8))
    for _ in range(30):
        drafter.state.acceptance.observe("model", 0, 4, 4)
        drafter.state.acceptance.observe("lookup", 1, 4, 0)

    class Line:
        def verify_times(self, batch, feds):
            return [1.0 + 0.01 * (fed - 1) for fed in feds]

        def draft_time(self, source, batch, tokens, unknown=None):
            return 1.0 + 0.01 * tokens if tokens > 0 else 0.0

    choice, cut = drafter.route(1, [4], [[4]], [[1]], None, Line())
    assert choice == [MODEL] and cut == [4]


class Recorded(FixedLength):
    """FixedLength that keeps every step's record (the drafter's telemetry with it)."""

    def __init__(self, k):
        super().__init__(k)
        self.records = []

    def observe(self, record):
        self.records.append(record)


def _judged_hindsight(policy, draft, ids, mask, out) -> list[int]:
    """Every hindsight value reported after a row's fully accepted model step, each checked against a separate
    forward of the draft over the output row (the row's last draft at length - 2, the target's token after it at
    length - 1); -1 asserted after a rejection."""
    batch = ids.shape[0]
    pads = (mask == 0).sum(1).tolist()
    with torch.no_grad():
        guesses = [draft(input_ids=out[b:b + 1, pads[b]:]).logits[0].argmax(-1) for b in range(batch)]   # [L_b]
    length = [ids.shape[1] - pads[b] + 1 for b in range(batch)]     # the prompt and the token its prefill chose
    last: dict = {}                                                 # row -> (its last step's record, index in it)
    judged = []
    for record in policy.records:
        seen = (record.telemetry or {}).get("hindsight")
        sources = (record.telemetry or {}).get("source") or ["model"] * len(record.rows)
        for i, row in enumerate(record.rows):
            before = last.get(row)
            value = -1 if seen is None else int(seen[i])
            if before is not None:
                prev, j = before
                full = prev.drafted[j] == prev.accepted[j] == prev.gammas[j] > 0
                from_model = ((prev.telemetry or {}).get("source") or ["model"] * len(prev.rows))[j] == "model"
                if full and from_model and sources[i] == "model" and record.gammas[i] > 0:
                    # The row's last draft sits at length - 2, the target's token after it at length - 1.
                    n = length[row]
                    assert value == int(guesses[row][n - 2] == out[row, pads[row] + n - 1])
                    judged.append(value)
                elif not full:
                    assert value == -1
            length[row] += record.committed[i]
            last[row] = (record, i)
    return judged


@pytest.mark.parametrize("multi,batch", [(False, 1), (True, 1), (False, 3)])
def test_the_draft_models_hindsight_is_its_own_next_token_against_the_targets(multi, batch):
    """After a step whose drafts were all accepted, the draft model reports whether its own greedy token after the
    last of them is the target's token there (a draft one longer would have been accepted): checked against a
    separate forward of the draft over each output row; after a rejection it reports nothing (-1). Through the
    several-source drafter too, on the rows it drafted; and per row of a ragged batch."""
    draft = perturbed_copy(TARGET, 0.1, seed=5)        # right often enough for full acceptances, wrong at times
    ids, mask = ragged_batch(batch, seed=3)
    policy = Recorded(2)
    drafter = MultiSourceDrafter(draft, free=[PromptLookupDrafter()]) if multi else ModelDrafter(draft)
    out, _ = run(TARGET, ids, mask, drafter, policy, max_new_tokens=40)
    assert torch.equal(out, stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=40))
    judged = _judged_hindsight(policy, draft, ids, mask, out)
    assert 0 in judged and 1 in judged


class OneRowPlain(Recorded):
    """Width 2 for every row but row 2, which never drafts (the draft model then never has every row fed)."""

    def choose(self, info):
        return torch.where(info.rows.cpu() == 2, 0, 2)


def test_the_draft_models_hindsight_is_reported_while_a_row_never_drafts():
    """A batch where one row stays plain (a policy's hopeless row): the draft model never feeds every row in one
    step, and still reports its hindsight on the rows that draft."""
    draft = perturbed_copy(TARGET, 0.1, seed=5)
    ids, mask = ragged_batch(3, seed=3)
    policy = OneRowPlain(2)
    out, _ = run(TARGET, ids, mask, ModelDrafter(draft), policy, max_new_tokens=30)
    assert torch.equal(out, stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=30))
    judged = _judged_hindsight(policy, draft, ids, mask, out)
    assert len(judged) >= 5 and 0 in judged and 1 in judged


def test_the_draft_models_hindsight_reaches_the_policy_while_requests_join_the_engine():
    """Serving: rows join a running batch (their prompts caught up beside rows a token or two behind), and the draft
    model still reports its hindsight on the running rows; every answer is stock's."""
    from spec_adapt.serving.engine import Engine

    from conftest import drive_engine

    draft = perturbed_copy(TARGET, 0.1, seed=5)
    ids, mask = ragged_batch(6, seed=3)
    prompts = [ids[b][mask[b].bool()].tolist() for b in range(6)]
    budgets = [20, 7, 30, 12, 25, 9]
    policy = Recorded(2)
    engine = Engine(TARGET, drafter=ModelDrafter(draft), assistant_policy=policy, max_batch=3, eos_token_id=None,
                    pad_token_id=PAD)
    handles = drive_engine(engine, prompts, budgets, [0, 0, 1, 3, 5, 8])
    for prompt, budget, handle in zip(prompts, budgets, handles):
        x = torch.tensor([prompt])
        stock = stock_greedy(TARGET, x, torch.ones_like(x), eos_token_id=None, max_new_tokens=budget)
        assert torch.as_tensor(handle.result()).tolist() == stock[0, len(prompt):].tolist()
    seen = [(r.telemetry or {}).get("hindsight") for r in policy.records]
    known = [v for s in seen if s is not None for v in torch.as_tensor(s).tolist() if v >= 0]
    assert len(known) >= 8 and 0 in known and 1 in known
