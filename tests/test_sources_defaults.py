"""The default several-source drafter of a (target, draft) pair: what it keeps for the process serves every later
call, whatever width bound that call sets, and `reset_default_policies` makes the next call a cold one."""

from __future__ import annotations

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength
from spec_adapt.drafters.sources import MultiSourceDrafter, SourceState
import spec_adapt.policies.cost as cost_module
from spec_adapt.policies.cost import StepCost
from spec_adapt.policies.estimators import SourceAcceptance
from spec_adapt.tools.synthetic import perturbed_copy

from conftest import PAD, cached_model, ragged_batch, stock_greedy
from test_sources import one_thread     # noqa: F401 (its autouse fixture: tiny models on one thread)

TARGET = cached_model("llama")




def repeating_batch(batch: int, seed: int):
    """Ragged prompts whose tail repeats: prompt lookup has offers from the first step."""
    ids, mask = ragged_batch(batch, seed=seed, max_len=9)
    tail = ids[:, -4:]
    return torch.cat([ids, tail, tail], 1), torch.cat([mask, torch.ones(batch, 8, dtype=torch.long)], 1)


def enabled_call(ids, mask, draft, **kw):
    stats = spec_adapt.SpecStats()
    out = TARGET.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                          max_new_tokens=kw.pop("max_new_tokens", 40), assistant_model=draft, spec_stats=stats, **kw)
    return out, stats


@pytest.mark.parametrize("widths", [(16, 32, 8), (8, 32, 16), (None, 48, 32)])
def test_the_pairs_state_serves_every_later_calls_width(widths):
    """Calls of one (target, draft) pair with different `prompt_lookup_num_tokens` (None: the default 32) share the
    pair's router state: each call drafts, falls back never, and returns stock's tokens."""
    draft = perturbed_copy(TARGET, 0.05, seed=100 + sum(w or 0 for w in widths))    # a pair of its own: cold
    ids, mask = repeating_batch(2, seed=7)
    reference = stock_greedy(TARGET, ids, mask, eos_token_id=None, max_new_tokens=40)
    spec_adapt.enable(TARGET)
    try:
        for n in widths:
            bound = {} if n is None else {"prompt_lookup_num_tokens": n}
            out, stats = enabled_call(ids, mask, draft, **bound)
            assert stats.fallback is None, (n, stats.fallback)
            assert torch.equal(out, reference), n
            assert stats.drafted > 0 and stats.per_source, n
            free_most = max((d for r in stats.trace for d, f in zip(r.drafted, r.free or []) if f), default=0)
            assert free_most <= (n or 32), n
    finally:
        spec_adapt.disable(TARGET)


def test_a_shared_state_grows_for_a_wider_drafter():
    """A SourceState made for 8 free tokens, handed to a drafter that takes 40: the router reads every width, and
    what the state learned at the positions it had is kept."""
    state = SourceState(8)
    state.acceptance.observe("lookup", 0, 5, 3)
    before = state.acceptance.rates("lookup", 0).clone()
    drafter = MultiSourceDrafter(None, max_free=40, state=state)
    assert state.acceptance.positions >= 40
    assert torch.equal(state.acceptance.rates("lookup", 0)[: len(before)], before)
    choice, cut = drafter.route(2, [0, 0], [[40, 3], [0, 40]], [[0, 0], [0, 0]])
    assert len(choice) == len(cut) == 2 and all(c <= 40 for c in cut)


def test_a_grown_state_reads_as_one_made_that_wide():
    """Growing adds positions never reached: the rates are those of a state made at the larger size with the same
    observations, and a row's counts from before the growth still combine with the ones after."""
    grown, wide = SourceAcceptance(positions=16), SourceAcceptance(positions=40)
    for drafted, accepted in ((5, 3), (16, 16), (2, 0)):
        grown.observe("suffix", 1, drafted, accepted)
        wide.observe("suffix", 1, drafted, accepted)
    row = grown.step_counts(6, 4)
    grown.grow(40)
    assert torch.allclose(grown.rates("suffix", 1), wide.rates("suffix", 1))
    expected = grown.expected_rows("suffix", [1, 1], 40, [row, None], optimism=2.0)
    assert expected.shape == (2, 41)
    assert torch.allclose(expected, wide.expected_rows("suffix", [1, 1], 40, [wide.step_counts(6, 4), None],
                                                       optimism=2.0))


class ClockFreeCost(StepCost):
    """The router's step costs without the clock: its choices then depend on the tokens and on what it learned."""

    def observe_verify(self, batch, fed, seconds, path="full"):
        pass

    def observe_draft(self, source, batch, tokens, seconds):
        pass

    def verify_time(self, batch, fed, path="full"):
        return 1.0 + 0.1 * (fed - 1)

    def draft_time(self, source, batch, tokens, unknown=None):
        return 0.05 * tokens


def summary(out, stats):
    sources_per_step = [tuple((r.telemetry or {}).get("source") or ()) for r in stats.trace]
    return (out.tolist(), stats.steps, stats.drafted, stats.accepted, stats.per_source, sources_per_step)


def test_after_reset_a_call_is_a_cold_first_call(monkeypatch):
    """The default drafter of a pair learns across calls (its router's rates, the suffix index of the outputs); after
    `reset_default_policies()` or `reset_default_policies(target)` the same call behaves exactly as the first did."""
    monkeypatch.setattr(cost_module, "StepCost", ClockFreeCost)      # each call's (FixedLength keeps none)
    draft = perturbed_copy(TARGET, 0.3, seed=131)           # a pair of its own, often wrong
    ids, mask = ragged_batch(2, seed=11)

    def call():
        return summary(*enabled_call(ids, mask, draft, assistant_policy=FixedLength(3), max_new_tokens=36))

    spec_adapt.enable(TARGET)
    try:
        first = call()
        warm = call()
        assert warm[0] == first[0]
        assert warm[1:] != first[1:]       # learned: the second call is not a first one (the check below can fail)
        spec_adapt.reset_default_policies(TARGET)
        assert call() == first
        call()
        spec_adapt.reset_default_policies()
        assert call() == first
    finally:
        spec_adapt.disable(TARGET)
