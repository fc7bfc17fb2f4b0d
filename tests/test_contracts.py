"""The contracts at the loop's boundaries: whatever a drafter, a policy or a user hands the loop is checked once where it
enters. Each test here failed before the contracts issue (silent wrong output, a crash that lost every token, or a
state that did not survive a round trip)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import spec_adapt
from spec_adapt import ChainDrafter, ChainScheduler, Drafter, FixedLength, Policy, PromptLookupDrafter, ScriptedDrafter
from spec_adapt.policies import GoodputModel, PerRequest
from spec_adapt.drafters import CatchUp, Proposal
from spec_adapt.tools.synthetic import perturbed_copy

from conftest import PAD, VOCAB, Collect, Oracle, cached_model, ragged_batch, stock_greedy


def spec(model, ids, mask, drafter, policy=None, **kw):
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("do_sample", False)
    kw.setdefault("eos_token_id", None)
    stats = spec_adapt.SpecStats()
    out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=PAD,
                         custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=policy or FixedLength(3), spec_stats=stats, **kw)
    return out, stats


class Returns(Drafter):
    """Proposes right tokens (from an oracle) for `good` steps, then whatever `bad(request)` returns."""

    def __init__(self, oracle, bad, good=2):
        self.inner, self.bad, self.good, self.calls = oracle.drafter(), bad, good, 0

    def begin(self, input_ids, attention_mask):
        self.inner.begin(input_ids, attention_mask)

    def propose(self, request):
        self.calls += 1
        if self.calls > self.good:
            return self.bad(request, self.inner.propose(request))
        return self.inner.propose(request)


def _batch(request):
    return request.gammas.shape[0]


MALFORMED = {
    "negative lengths": lambda r, p: Proposal(p.tokens, p.lengths - 5),
    "lengths beyond the tokens": lambda r, p: Proposal(p.tokens[:, :1], p.lengths),
    "out-of-vocabulary ids": lambda r, p: Proposal(p.tokens + VOCAB, p.lengths),
    "negative ids": lambda r, p: Proposal(p.tokens - VOCAB, p.lengths),
    "float tokens": lambda r, p: Proposal(p.tokens.float(), p.lengths),
    "wrong batch": lambda r, p: Proposal(p.tokens[:1], p.lengths[:1]),
    "not a Proposal": lambda r, p: p.tokens.tolist(),
    "None": lambda r, p: None,
    "NaN probs": lambda r, p: Proposal(p.tokens, p.lengths, torch.full((_batch(r), p.tokens.shape[1], VOCAB), float("nan"))),
    "zero probs": lambda r, p: Proposal(p.tokens, p.lengths, torch.zeros(_batch(r), p.tokens.shape[1], VOCAB)),
    "probs of other tokens": lambda r, p: Proposal(
        p.tokens, p.lengths, torch.nn.functional.one_hot((p.tokens + 1) % VOCAB, VOCAB).float()),
    "telemetry not a dict": lambda r, p: Proposal(p.tokens, p.lengths, telemetry=["hindsight"]),
    "hindsight out of range": lambda r, p: Proposal(p.tokens, p.lengths,
                                                    telemetry={"hindsight": torch.full((_batch(r),), 2)}),
    "hindsight of another batch": lambda r, p: Proposal(p.tokens, p.lengths, telemetry={"hindsight": [1]}),
    "float hindsight": lambda r, p: Proposal(p.tokens, p.lengths, telemetry={"hindsight": [0.5] * _batch(r)}),
    "negative hindsight": lambda r, p: Proposal(p.tokens, p.lengths, telemetry={"hindsight": [-2] * _batch(r)}),
    "NaN hindsight": lambda r, p: Proposal(p.tokens, p.lengths,
                                           telemetry={"hindsight": torch.full((_batch(r),), float("nan"))}),
    "bool hindsight": lambda r, p: Proposal(p.tokens, p.lengths, telemetry={"hindsight": [True] * _batch(r)}),
    "text hindsight": lambda r, p: Proposal(p.tokens, p.lengths, telemetry={"hindsight": ["x"] * _batch(r)}),
    "hindsight not a sequence": lambda r, p: Proposal(p.tokens, p.lengths, telemetry={"hindsight": int}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_proposal_falls_back_without_losing_tokens(name):
    """A malformed proposal takes the drafter fallback: the output is still exactly stock generate's, the steps
    before it keep their accepted drafts, and stats.fallback names the problem."""
    model = cached_model("llama")
    ids, mask = ragged_batch(4, seed=5)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    drafter = Returns(Oracle(reference, mask, ["right"], eos=()), MALFORMED[name])
    with pytest.warns(RuntimeWarning, match="continued without speculation"):
        out, stats = spec(model, ids, mask, drafter)
    assert torch.equal(out, reference)
    assert "propose" in stats.fallback
    assert stats.accepted == stats.drafted == 2 * 4 * 3          # the two good steps, then plain decoding


@pytest.mark.parametrize("name", ["NaN probs", "zero probs", "probs of other tokens"])
def test_malformed_draft_probabilities_fall_back_when_sampling(name):
    """Sampling: NaN probabilities used to commit token 0 again and again; all-zero probabilities made p/q infinite
    (every draft accepted). Both now fall back to plain sampling, and every token is a real sample."""
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=6)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    drafter = Returns(Oracle(reference, mask, ["right"], eos=()), MALFORMED[name], good=0)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="malformed Proposal"):
        out, stats = spec(model, ids, mask, drafter, do_sample=True)
    assert stats.drafted == 0 and "probs" in stats.fallback or "probability 0" in stats.fallback
    generated = out[:, ids.shape[1]:]
    assert not bool((generated == 0).all(dim=1).any())           # no row stuck on token 0


def test_scripted_drafter_out_of_vocabulary_is_caught():
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=7)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    with pytest.warns(RuntimeWarning, match="within \\[0, 96\\)"):
        out, stats = spec(model, ids, mask, ScriptedDrafter(lambda row, ctx, g: [-3] * g))
    assert torch.equal(out, reference)


class LagFails(CatchUp):
    def propose(self, request):
        return Proposal.empty(_batch(request), request.tokens.device)

    def lag(self, lengths):
        raise RuntimeError("lag broke")


def test_drafter_lag_is_guarded():
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=8)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    with pytest.warns(RuntimeWarning, match="draft lag failed"):
        out, stats = spec(model, ids, mask, LagFails())
    assert torch.equal(out, reference)


def test_stopping_criteria_may_return_a_python_bool():
    class AfterFive(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[1] >= 14                  # a Python bool, as stock generate accepts

    model = cached_model("llama")
    ids, mask = ragged_batch(1, seed=9)
    criteria = StoppingCriteriaList([AfterFive()])
    reference = stock_greedy(model, ids, mask, eos_token_id=None, stopping_criteria=criteria)
    oracle = Oracle(reference, mask, ["right"], eos=())
    out, _ = spec(model, ids, mask, oracle.drafter(), max_new_tokens=24, stopping_criteria=criteria)
    assert torch.equal(out, reference)


def test_plain_streamer_with_custom_generate_is_ended():
    """transformers gives custom_generate no streamer: it used to get the prompt and never `end()` (a
    TextIteratorStreamer reader would wait forever)."""
    model = cached_model("llama")
    ids, mask = ragged_batch(1, seed=10)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    streamer = Collect()
    out, _ = spec(model, ids, mask, Oracle(reference, mask, [2]).drafter(), max_new_tokens=24, streamer=streamer)
    assert torch.equal(out, reference)
    assert streamer.tokens == reference[0].tolist() and streamer.ended


def test_spec_streamer_follows_row_zero_in_a_batch():
    """At batch > 1 the streamer follows the user's row 0, and stops receiving once that row finished (it used to
    switch to another row's tokens)."""
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=11)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=24)
    eos = int(reference[0, ids.shape[1] + 3])                 # row 0 stops after 4 tokens (if the id is its first)
    stops = stock_greedy(model, ids, mask, eos_token_id=eos, max_new_tokens=24)
    streamer = Collect()
    out, _ = spec(model, ids, mask, Oracle(stops, mask, ["right"], eos=(eos,)).drafter(), max_new_tokens=24,
                  eos_token_id=eos, spec_streamer=streamer)
    assert torch.equal(out, stops)
    generated = stops[0, ids.shape[1]:].tolist()
    row0 = stops[0, : ids.shape[1] + generated.index(eos) + 1].tolist()       # prompt, tokens up to its EOS
    assert bool((stops[1:, ids.shape[1] + len(row0) - ids.shape[1]:] != PAD).any())  # other rows went on
    assert streamer.tokens == row0 and streamer.ended


def test_chain_scheduler_state_round_trip_and_wrong_drafter():
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=12)
    chain = ChainDrafter([PromptLookupDrafter(), perturbed_copy(model, 0.1)])
    scheduler = ChainScheduler(chain, explore=0.2, seed=1)
    spec(model, ids, mask, chain, scheduler, max_new_tokens=20)
    copy = ChainScheduler(chain, explore=0.2, seed=1)
    copy.load_state_dict(json.loads(json.dumps(scheduler.state_dict())))
    for batch in (1, 3, 8):
        info = spec_adapt.policies.StepInfo(batch, torch.arange(batch), torch.zeros(batch, dtype=torch.long),
                                   torch.full((batch,), 50), 0, level_lags=[0, 3])
        assert scheduler.choose(info) == copy.choose(info)
    with pytest.raises(TypeError, match="ChainDrafter"):
        ChainScheduler(PromptLookupDrafter())


@pytest.mark.parametrize("make", [lambda: GoodputModel(max_gamma=6, explore=0.3), lambda: PerRequest(max_gamma=6)])
def test_policies_choose_the_same_after_a_state_round_trip(make):
    model = cached_model("llama")
    ids, mask = ragged_batch(4, seed=13)
    policy = make()
    spec(model, ids, mask, PromptLookupDrafter(), policy, max_new_tokens=40)
    copy = make()
    copy.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    for step in range(30):
        batch = 1 + step % 4
        info = spec_adapt.policies.StepInfo(batch, torch.arange(batch), torch.zeros(batch, dtype=torch.long),
                                   torch.full((batch,), 50), step)
        assert policy.choose(info) == copy.choose(info)


def test_kernel_paths_are_per_call():
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=14)
    spec(model, ids, mask, model, do_sample=True)
    _, stats = spec(model, ids, mask, model)
    assert set(stats.kernel_paths) == {"greedy"}             # no "coupled" left over from the sampled call


def test_concurrent_calls_keep_their_own_statistics():
    """Two threads, one greedy and one sampled call with their own acceptors: each reports its own path."""
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=15)
    results = {}

    def run(name, sample):
        results[name] = spec(model, ids, mask, PromptLookupDrafter(), do_sample=sample)[1]

    threads = [threading.Thread(target=run, args=(n, s)) for n, s in (("greedy", False), ("sampled", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "coupled" not in results["greedy"].kernel_paths
    assert "greedy" not in results["sampled"].kernel_paths and "coupled" in results["sampled"].kernel_paths


def test_chain_events_do_not_carry_over_to_the_next_call():
    class Breaks(torch.nn.Module):
        pass

    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=16)
    chain = ChainDrafter([PromptLookupDrafter(), perturbed_copy(model, 0.1)])
    chain.events.append("level 1 dropped: from an earlier call")
    _, stats = spec(model, ids, mask, chain)
    assert stats.drafter_events == []


def test_generate_called_directly_with_a_generation_config():
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=17)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=12)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    out = spec_adapt.generate(model, ids, attention_mask=mask, generation_config=config, drafter=model,
                              assistant_policy=FixedLength(2))
    assert torch.equal(out, reference)


def test_mask_with_a_gap_is_named_as_such():
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=18)
    mask[1, 4] = 0
    with pytest.raises(ValueError, match="gap"):
        spec(model, ids, mask, model)


class Answers(Policy):
    def __init__(self, value):
        self.value = value

    def choose(self, info):
        return self.value


@pytest.mark.parametrize("value", [np.int64(2), np.int32(1), torch.tensor(2), np.array(3)])
def test_numpy_and_0d_tensor_lengths_are_accepted(value):
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=19)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    out, stats = spec(model, ids, mask, model, Answers(value))
    assert torch.equal(out, reference) and stats.drafted > 0


def test_string_policy_gets_a_clear_error():
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=20)
    with pytest.raises(TypeError, match="assistant_policy must be a spec_adapt Policy"):
        spec(model, ids, mask, model, "nightjar")


def test_plan_members_for_a_plain_drafter_are_refused():
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=21)
    with pytest.raises(ValueError, match="not a ChainDrafter"):
        spec(model, ids, mask, model, Answers(spec_adapt.policies.Plan(2, (0,))))


def test_full_vocabulary_probability_checks_run_under_strict_only():
    """By default a proposal's probabilities are checked where acceptance reads them (q at each drafted token: finite,
    in (0, 1]); the whole distribution (finite, >= 0, summing to 1 over the vocabulary) only with strict=True."""
    from spec_adapt.drafters.drafter import DraftRequest, InvalidProposal, check_proposal
    from spec_adapt.processors import ScoreProcessor

    req = DraftRequest(torch.zeros(2, 8, dtype=torch.long), torch.tensor([4, 4]), torch.tensor([2, 2]),
                       torch.tensor([0, 1]), True, ScoreProcessor(None))
    tokens, lengths = torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 1])
    probs = torch.full((2, 2, VOCAB), 1.0 / VOCAB)
    assert check_proposal(Proposal(tokens, lengths, probs), req, VOCAB, strict=True).lengths.tolist() == [2, 1]
    off = probs.clone()
    off[0, 0, 9] = float("nan")                   # elsewhere than a drafted token: acceptance divides by q(d) only
    off[1, 0, 10] = 3.0                           # the row's probs no longer sum to 1
    assert check_proposal(Proposal(tokens, lengths, off), req, VOCAB).lengths.tolist() == [2, 1]
    with pytest.raises(InvalidProposal, match="NaN, inf or negative"):
        check_proposal(Proposal(tokens, lengths, off), req, VOCAB, strict=True)
    unnormalized = probs.clone()
    unnormalized[1, 0, 10] = 3.0
    with pytest.raises(InvalidProposal, match="sum to 1"):
        check_proposal(Proposal(tokens, lengths, unnormalized), req, VOCAB, strict=True)
    for value, message in ((float("nan"), "NaN or inf at a drafted token"), (0.0, "probability 0"),
                           (2.0, "above 1")):
        bad = probs.clone()
        bad[0, 1, 6] = value                      # at a drafted token: refused either way
        with pytest.raises(InvalidProposal, match=message):
            check_proposal(Proposal(tokens, lengths, bad), req, VOCAB)
        with pytest.raises(InvalidProposal):          # strict: the full check may name it first
            check_proposal(Proposal(tokens, lengths, bad), req, VOCAB, strict=True)
    unused = probs.clone()
    unused[1, 1, 3] = float("nan")                # row 1 drafts one token: its second position is never read
    assert check_proposal(Proposal(tokens, lengths, unused), req, VOCAB, strict=True).lengths.tolist() == [2, 1]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_checked_proposal_is_dense_exactly_when_every_row_drafts_the_full_width(data):
    """`Proposal.dense` (set by the check from its one read) tells the ledger that every row's drafts fill the
    width, so the verification appends its columns without a hole check: it holds exactly when every row's length,
    after the cut to its gamma, equals the cut width, and a drafter cannot set it."""
    from spec_adapt.drafters.drafter import DraftRequest, check_proposal
    from spec_adapt.processors import ScoreProcessor

    batch = data.draw(st.integers(1, 4))
    gammas = torch.tensor([data.draw(st.integers(0, 4)) for _ in range(batch)])
    width = data.draw(st.integers(0, 5))
    lengths = torch.tensor([data.draw(st.integers(0, width)) for _ in range(batch)])
    req = DraftRequest(torch.zeros(batch, 8, dtype=torch.long), torch.full((batch,), 4), gammas,
                       torch.arange(batch), False, ScoreProcessor(None))
    checked = check_proposal(Proposal(torch.full((batch, width), 5), lengths), req, VOCAB)
    cut = torch.minimum(lengths, gammas)
    assert checked.dense == (int(cut.max()) > 0 and bool((cut == cut.max()).all()))
    with pytest.raises(TypeError):
        Proposal(torch.full((batch, width), 5), lengths, dense=True)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_proposals_confidences_are_probabilities_where_the_kept_width_reads_them(data):
    """Confidences are checked as probabilities in [0, 1] over the columns the proposal keeps (its longest row),
    from the bounds the check reads with the proposal's others; a NaN or out-of-range value there is refused, one
    past the kept width is not read and passes."""
    from spec_adapt.drafters.drafter import DraftRequest, InvalidProposal, check_proposal
    from spec_adapt.processors import ScoreProcessor

    batch, columns = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    lengths = torch.tensor([data.draw(st.integers(0, columns)) for _ in range(batch)])
    req = DraftRequest(torch.zeros(batch, 8, dtype=torch.long), torch.full((batch,), 4), torch.full((batch,), 5),
                       torch.arange(batch), False, ScoreProcessor(None))
    confidence = torch.rand(batch, columns + data.draw(st.integers(0, 2)),
                            generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    bad = data.draw(st.sampled_from([None, float("nan"), -0.1, 1.5]))
    if bad is not None:
        row, column = data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, confidence.shape[1] - 1))
        confidence[row, column] = bad
    width = int(lengths.max())
    proposal = Proposal(torch.full((batch, columns), 5), lengths, confidence=confidence)
    if bad is not None and column < width:
        with pytest.raises(InvalidProposal, match="confidence must be probabilities"):
            check_proposal(proposal, req, VOCAB)
    else:
        assert torch.equal(check_proposal(proposal, req, VOCAB).confidence, confidence[:, :width])
    with pytest.raises(InvalidProposal, match="confidence must be a float tensor"):
        check_proposal(Proposal(torch.full((batch, columns), 5), lengths, confidence=confidence.long()), req, VOCAB)


# -- the drafter contract's shape: a core of five methods, and capabilities a drafter inherits -------------------------
def test_the_drafter_core_is_five_methods_and_each_capability_holds_its_own_members():
    from spec_adapt.drafters import drafter as contract

    core = {name for name, value in vars(Drafter).items() if not name.startswith("_") and callable(value)}
    assert core == {"begin", "propose", "rollback", "select_rows", "end"}
    derived = {name for name, value in vars(Drafter).items() if isinstance(value, contract._Derived)}
    assert derived == {"trees", "wants_hidden", "fills_budget", "reads_target", "max_free", "offloaded", "events"}
    assert {c.__name__: contract.members_of(c) for c in contract.CAPABILITIES} == {
        "Trees": ["keep_tree", "trees"], "Features": ["take_hidden", "wants_hidden"], "ReadsTarget": ["reads_target"],
        "JoinsRows": ["add_rows"], "CatchUp": ["lag"], "Chains": ["level_lags", "check_members"],
        "Offloads": ["offloaded", "available"], "Observes": ["observe"], "FreeSources": ["max_free"],
        "FillsBudget": ["fills_budget"], "Events": ["events"], "ChecksTarget": ["validate"],
        "TakesInputs": ["share_inputs"], "Forwards": ["offers"]}


def test_every_drafter_has_the_capabilities_it_declares():
    from spec_adapt.distributed import FollowerDrafter
    from spec_adapt.drafters import drafter as contract, CandidateGeneratorDrafter, CrossTokenizerDrafter, MTPDrafter, SharedKVDrafter
    from spec_adapt.drafters import SuffixDrafter

    def has(cls):
        return {c.__name__ for c in contract.CAPABILITIES if issubclass(cls, c)}

    model_drafter = {"Trees", "CatchUp", "JoinsRows", "ChecksTarget", "TakesInputs"}
    assert has(spec_adapt.ModelDrafter) == model_drafter
    for cls in (PromptLookupDrafter, SuffixDrafter, ScriptedDrafter, FollowerDrafter):
        assert has(cls) == {"Trees", "JoinsRows"}, cls
    assert has(CandidateGeneratorDrafter) == set()
    assert has(MTPDrafter) == {"Features", "FillsBudget", "JoinsRows", "ChecksTarget"}
    assert has(SharedKVDrafter) == {"Features", "ReadsTarget", "JoinsRows", "ChecksTarget"}
    assert has(CrossTokenizerDrafter) == {"CatchUp", "JoinsRows", "Offloads", "Observes", "ChecksTarget"}
    assert has(ChainDrafter) == {"CatchUp", "Chains", "JoinsRows", "Events", "ChecksTarget", "TakesInputs"}
    assert has(spec_adapt.DraftOffload) == model_drafter | {"Offloads", "Observes", "Events"}
    assert has(spec_adapt.MultiSourceDrafter) == model_drafter | {"Features", "ReadsTarget", "FreeSources", "Observes",
                                                                  "Forwards"}
    # A wrapper has those of its inner drafters: model-free sources draft trees and want no hidden states.
    free = spec_adapt.MultiSourceDrafter(None, [PromptLookupDrafter()])
    assert isinstance(free, contract.Trees) and not isinstance(free, (contract.Features, contract.ReadsTarget))
    assert free.trees and not free.wants_hidden and free.reads_target == 0 and free.max_free == 32
    plain = spec_adapt.MultiSourceDrafter(None, [CandidateGeneratorDrafter.prompt_lookup()])
    assert not isinstance(plain, contract.Trees) and not plain.trees
    assert not isinstance(ScriptedDrafter(lambda *a: []), (contract.CatchUp, contract.Features, contract.Offloads, contract.Chains))


def test_a_drafter_declaring_a_capability_by_its_member_has_it():
    """A Drafter subclass that sets a capability's flag or defines its method has the capability (the members it
    lacks are the capability's); one that sets an inherited flag false has it no more; setting a capability's
    attribute on a drafter without it raises, naming the capability to inherit."""
    from spec_adapt.drafters import drafter as contract

    class Declares(Drafter):
        trees = True
        reads_target = 8

        def add_rows(self, input_ids, attention_mask, rows):
            pass

        def lag(self, lengths):
            return None

        def observe(self, record):
            super().observe(record)

    drafter = Declares()
    for capability in (contract.Trees, contract.ReadsTarget, contract.JoinsRows, contract.CatchUp, contract.Observes):
        assert isinstance(drafter, capability), capability
    assert not isinstance(drafter, (contract.Features, contract.Chains, contract.Offloads))
    drafter.keep_tree(None)
    drafter.observe(None)
    assert drafter.trees and drafter.reads_target == 8 and not drafter.wants_hidden

    class Chains(ScriptedDrafter):
        trees = False

    class TreesAgain(Chains):
        trees = True

    assert not isinstance(Chains(lambda *a: []), contract.Trees) and isinstance(TreesAgain(lambda *a: []), contract.Trees)

    class SetsFree(Drafter):
        def __init__(self):
            self.max_free = 4

    with pytest.raises(TypeError, match="inheriting spec_adapt.drafters.FreeSources"):
        SetsFree()
    with pytest.raises(TypeError, match="inheriting spec_adapt.drafters.Trees"):
        ScriptedDrafter(lambda *a: []).trees = False
