"""Sampling through the whole loop: the tokens produced have exactly the target's distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

import spec_adapt
from spec_adapt import FixedLength, ScriptedDrafter

from conftest import PAD, tiny_model

VOCAB_SMALL = 16
TEMPERATURE, TOP_K = 0.9, 12


@pytest.fixture(scope="module")
def small():
    target = tiny_model("llama", seed=5, vocab=VOCAB_SMALL)
    draft = tiny_model("llama", seed=6, vocab=VOCAB_SMALL, layers=1)
    with torch.no_grad():   # milder logits than the greedy fixtures: every token has real probability
        target.lm_head.weight.mul_(0.3)
        draft.lm_head.weight.mul_(0.3)
    return target, draft


def processed_probs(model, prefixes):
    """Target distributions [N, V] after each prefix [N, L], under temperature + top-k."""
    with torch.no_grad():
        logits = model(prefixes).logits[:, -1].float()
    logits = TopKLogitsWarper(TOP_K)(prefixes, TemperatureLogitsWarper(TEMPERATURE)(prefixes, logits))
    return logits.softmax(-1)


def exact_marginals(model, prompt, depth=3):
    """Marginal distribution of each of the first `depth` generated tokens, by enumerating all prefixes."""
    prefixes = torch.tensor([prompt])
    joint = torch.ones(1)                                       # probability of each prefix
    marginals = []
    for _ in range(depth):
        probs = processed_probs(model, prefixes)                 # [N, V]
        step = joint[:, None] * probs                            # [N, V]
        marginals.append(step.sum(0))
        joint = step.flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB_SMALL, 0),
                              torch.arange(VOCAB_SMALL).repeat(len(prefixes))[:, None]], dim=1)
    return marginals


def sample(model, drafter, n, seed, gamma=3):
    prompt = torch.tensor([[3, 7, 9, 4]]).repeat(n, 1)
    torch.manual_seed(seed)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                         temperature=TEMPERATURE, top_k=TOP_K, top_p=None, max_new_tokens=5,
                         eos_token_id=None, pad_token_id=PAD, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=FixedLength(gamma))
    return out[:, 4:]


@pytest.mark.parametrize("kind", ["model", "point_mass"])
def test_sampled_tokens_follow_target_distribution(small, kind):
    target, draft = small
    n = 6000
    marginals = exact_marginals(target, [3, 7, 9, 4])
    if kind == "model":
        drafter = draft
    else:  # a point-mass draft that always proposes the same (often wrong) tokens
        drafter = ScriptedDrafter(lambda row, context, gamma: [int(marginals[1].argmax()), 5, 6][:gamma])
    assert_follows_target(target, drafter, n)


def assert_follows_target(target, drafter, n):
    """Sample n continuations through the loop with `drafter`; each of the first 3 tokens' empirical distribution
    must match the target's exact marginal (5 standard errors). Token 1 comes from the prefill; tokens 2 and 3 are
    drafted, accepted or recovered."""
    marginals = exact_marginals(target, [3, 7, 9, 4])
    tokens = sample(target, drafter, n, seed=0)
    stats = spec_adapt.last_stats()
    assert stats.fallback is None and stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    for position, exact in enumerate(marginals):
        empirical = torch.bincount(tokens[:, position], minlength=VOCAB_SMALL).float() / n
        tolerance = 5 * (exact * (1 - exact) / n).sqrt() + 2e-3
        assert bool(((empirical - exact).abs() < tolerance).all()), (position, empirical, exact)


def test_accepting_every_draft_would_be_caught(small):
    """Control for the test above: the draft's own distribution differs measurably from the target's."""
    target, draft = small
    n = 6000
    first = exact_marginals(target, [3, 7, 9, 4], depth=1)[0]
    q = processed_probs(draft, torch.tensor([[3, 7, 9, 4]]))[0]
    torch.manual_seed(0)
    lossy = torch.multinomial(q.expand(n, VOCAB_SMALL), 1)[:, 0]
    empirical = torch.bincount(lossy, minlength=VOCAB_SMALL).float() / n
    tolerance = 5 * (first * (1 - first) / n).sqrt() + 2e-3
    assert not bool(((empirical - first).abs() < tolerance).all())


def test_seeded_runs_are_deterministic(small):
    target, draft = small
    a = sample(target, draft, 64, seed=123)
    b = sample(target, draft, 64, seed=123)
    c = sample(target, draft, 64, seed=124)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_three_level_chain_sampling_follows_target_distribution(small):
    """draft model -> intermediate model (a noisy copy of the target) -> target: still the target's distribution."""
    from spec_adapt import ChainDrafter
    from spec_adapt.tools.synthetic import perturbed_copy

    target, draft = small
    n = 6000
    marginals = exact_marginals(target, [3, 7, 9, 4])
    chain = ChainDrafter([draft, perturbed_copy(target, 0.5, seed=1)])
    tokens = sample(target, chain, n, seed=3)
    stats = spec_adapt.last_stats()
    middle = {k: sum(r.telemetry["levels"][1][k] for r in stats.trace if r.telemetry) for k in ("accepted", "drafted")}
    assert stats.fallback is None and not stats.drafter_events and stats.drafted > 0
    assert 0 < middle["accepted"] < middle["drafted"]          # the intermediate level really verified and rejected
    for position, exact in enumerate(marginals):
        empirical = torch.bincount(tokens[:, position], minlength=VOCAB_SMALL).float() / n
        tolerance = 5 * (exact * (1 - exact) / n).sqrt() + 2e-3
        assert bool(((empirical - exact).abs() < tolerance).all()), (position, empirical, exact)
