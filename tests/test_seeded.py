"""Seeded sampling repeats: a row's random numbers depend on the call's seed, the row's prompt and the position alone
(spec_adapt.noise), and every committed token is argmax(scores + noise) at its position (the coupled rule), so the
widths a policy chose, what it learned in earlier calls, the drafter and the batch around a row change nothing."""

from __future__ import annotations

import pytest
import torch

import spec_adapt
from spec_adapt import Adaptive, FixedLength, FixedTree, ModelDrafter, PromptLookupDrafter, ScriptedDrafter

from conftest import PAD, VOCAB, ragged_batch, sampling_pair


@pytest.fixture(scope="module")
def pair():
    return sampling_pair()


def sampled(target, ids, mask, seed=123, new=24, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.9, top_k=40,
                          max_new_tokens=new, pad_token_id=PAD, eos_token_id=None, **kw)
    return out[:, ids.shape[1]:], spec_adapt.last_stats()


def widths(stats) -> set:
    return {g for r in stats.trace for g in r.gammas}


@pytest.mark.parametrize("batch", [1, 3])
def test_seeded_calls_repeat_whatever_the_policy_chose(pair, batch):
    """After `enable`, the default drafter (the draft model beside prompt lookup) under FixedLength(1), FixedLength(4),
    a fresh Adaptive and the process's default policy (which learns across calls): the same tokens, at different
    widths, with drafts accepted and rejected."""
    target, draft = pair
    ids, mask = ragged_batch(batch, seed=4)
    spec_adapt.enable(target)
    try:
        runs = [sampled(target, ids, mask, assistant_model=draft, **kw)
                for kw in ({"assistant_policy": FixedLength(1)}, {"assistant_policy": FixedLength(4)},
                           {"assistant_policy": Adaptive()}, {}, {})]
        other, _ = sampled(target, ids, mask, seed=124, assistant_model=draft)
    finally:
        spec_adapt.disable(target)
    first, _ = runs[0]
    for out, stats in runs:
        assert stats.fallback is None and stats.drafted > 0
        assert torch.equal(out, first)
    # Drafts rejected in some calls (the first, with the draft model) and every one accepted in others (the later
    # ones, where the suffix source has learned the earlier calls' tokens), at different widths.
    assert any(s.accepted < s.drafted for _, s in runs) and any(s.accepted > 0 for _, s in runs)
    assert widths(runs[0][1]) != widths(runs[1][1])
    assert not torch.equal(other, first)


def test_seeded_calls_repeat_with_prompt_lookup_and_without_drafts(pair):
    """Stock's prompt_lookup_num_tokens, a model drafter, trees, and no speculation at all: one output per seed."""
    target, draft = pair
    ids, mask = ragged_batch(3, seed=5)
    plain = sampled(target, ids, mask, custom_generate=spec_adapt.generate, drafter=None)[0]
    spec_adapt.enable(target)
    try:
        lookup = [sampled(target, ids, mask, prompt_lookup_num_tokens=k)[0] for k in (1, 3)]
    finally:
        spec_adapt.disable(target)
    chains = sampled(target, ids, mask, custom_generate=spec_adapt.generate, drafter=ModelDrafter(draft),
                     assistant_policy=FixedLength(3))[0]
    trees, stats = sampled(target, ids, mask, custom_generate=spec_adapt.generate,
                           drafter=ModelDrafter(draft, branch=2), assistant_policy=FixedTree(6, 3))
    assert stats.fallback is None and stats.accepted > 0
    for out in lookup + [chains, trees]:
        assert torch.equal(out, plain)


def test_successive_calls_differ_and_a_reseeded_one_repeats(pair):
    target, draft = pair
    ids, mask = ragged_batch(2, seed=6)
    kw = dict(custom_generate=spec_adapt.generate, drafter=draft, assistant_policy=FixedLength(2))
    torch.manual_seed(7)
    a, _ = sampled(target, ids, mask, seed=None, **kw)
    b, _ = sampled(target, ids, mask, seed=None, **kw)
    c, _ = sampled(target, ids, mask, seed=7, **kw)
    assert not torch.equal(a, b) and torch.equal(a, c)


def test_a_batch_row_samples_what_it_samples_alone(pair):
    """A ragged batch's rows each equal the same prompt run alone under the same seed, whatever its place and
    padding; a prompt repeated in the batch is a fresh sample each time, its first copy the one run alone."""
    target, draft = pair
    ids, mask = ragged_batch(3, seed=8)
    ids = torch.cat([ids, ids[1:2]])              # row 3 repeats row 1's prompt
    mask = torch.cat([mask, mask[1:2]])
    kw = dict(custom_generate=spec_adapt.generate, drafter=draft, assistant_policy=Adaptive())
    together, _ = sampled(target, ids, mask, **kw)
    for b in range(3):
        n = int(mask[b].sum())
        alone, _ = sampled(target, ids[b:b + 1, -n:], mask[b:b + 1, -n:], **kw)
        assert torch.equal(alone[0], together[b])
    assert not torch.equal(together[3], together[1])
    flipped, _ = sampled(target, ids.flip(0), mask.flip(0), **kw)     # the repeat is now first: it takes stream 0
    assert torch.equal(flipped[0], together[1]) and torch.equal(flipped[2], together[3])


def test_a_draft_sampled_with_the_call_noise_agrees_more_than_one_sampled_apart(pair):
    """The draft model samples with the step's noise (argmax of its scores plus the target's noise at that
    position): on a draft close to the target, far more of its drafts are accepted than of the same draft's
    independent samples (a scripted drafter replaying them)."""
    target, draft = pair
    ids, mask = ragged_batch(4, seed=9)
    _, coupled = sampled(target, ids, mask, new=32, custom_generate=spec_adapt.generate, drafter=draft,
                         assistant_policy=FixedLength(3))
    gen = torch.Generator().manual_seed(0)

    def independent(row, context, gamma):       # the draft's own samples, with noise of their own
        out, seq = [], torch.tensor([context])
        with torch.no_grad():
            for _ in range(gamma):
                logits = draft(seq).logits[0, -1].float()
                q = torch.topk(logits / 0.9, 40)
                token = int(q.indices[torch.multinomial(q.values.softmax(-1), 1, generator=gen)])
                out.append(token)
                seq = torch.cat([seq, torch.tensor([[token]])], 1)
        return out

    _, apart = sampled(target, ids, mask, new=32, custom_generate=spec_adapt.generate,
                       drafter=ScriptedDrafter(independent), assistant_policy=FixedLength(3))
    rate = lambda s: s.accepted / s.drafted  # noqa: E731
    assert rate(coupled) > rate(apart) + 0.1


def test_the_serving_engine_samples_per_request_whatever_the_batching(pair):
    """A request's tokens depend on the engine's seed and its admission number: not on which requests shared its
    steps (max_batch 1 or 4, requests arriving at different steps) nor on the widths (FixedLength(1) or (4))."""
    from spec_adapt.serving.engine import Engine

    from conftest import drive_engine

    target, draft = pair
    prompts = [list(range(3 + i, 9 + 2 * i)) for i in range(5)]
    outputs = []
    for max_batch, policy, arrivals in ((1, FixedLength(1), [0, 0, 0, 0, 0]), (4, FixedLength(4), [0, 1, 1, 3, 7]),
                                        (4, Adaptive(), [0, 0, 2, 2, 2])):
        engine = Engine(target, drafter=ModelDrafter(draft), assistant_policy=policy, max_batch=max_batch,
                        do_sample=True, temperature=0.9, top_k=40, eos_token_id=None, pad_token_id=PAD, seed=3)
        handles = drive_engine(engine, prompts, [12] * 5, arrivals)
        outputs.append([h.result() for h in handles])
    assert outputs[0] == outputs[1] == outputs[2]
    assert len({tuple(o) for o in outputs[0]}) == 5


def test_the_rejection_rule_still_samples_and_is_kept_apart(pair):
    """Acceptor(rule="rejection"): rejection sampling from torch's generator (a seeded call repeats where its drafts
    and widths repeat); the draft model then samples from its own distribution with torch's generator."""
    target, draft = pair
    ids, mask = ragged_batch(2, seed=10)
    kw = dict(custom_generate=spec_adapt.generate, assistant_policy=FixedLength(3),
              acceptor=spec_adapt.Acceptor(rule="rejection"))
    a, stats = sampled(target, ids, mask, drafter=ModelDrafter(draft), **kw)      # the same drafts, the same draws
    b, _ = sampled(target, ids, mask, drafter=ModelDrafter(draft), **kw)
    assert torch.equal(a, b) and stats.accepted > 0 and int(a.max()) < VOCAB
    with pytest.raises(ValueError, match="rule must be"):
        spec_adapt.Acceptor(rule="gumbel")


def test_the_coupled_rule_commits_the_noisy_argmax_whatever_is_drafted():
    """coupled_accept: the committed tokens (accepted drafts, then the next token) are argmax(scores + noise) at each
    of their positions, for drafts right, wrong or random; a draft that is that token is accepted."""
    from spec_adapt.acceptance_rules import committed_tokens, coupled_accept

    gen = torch.Generator().manual_seed(0)
    batch, width, vocab = 64, 5, 12
    scores = torch.randn(batch, width + 1, vocab, generator=gen)
    scores[..., :3] = float("-inf")                       # masked tokens are never drawn
    noise = -torch.empty(batch, width + 1, vocab).exponential_(generator=gen).log()
    best = (scores + noise).argmax(-1)                    # [B, S+1]
    drafts = torch.where(torch.rand(batch, width, generator=gen) < 0.6, best[:, :width],
                         torch.randint(0, vocab, (batch, width), generator=gen))
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    accepted, next_token = coupled_accept(scores, drafts, lengths, noise)
    out = committed_tokens(drafts, accepted, next_token)
    for b in range(batch):
        n = int(accepted[b]) + 1
        assert out[b, :n].tolist() == best[b, :n].tolist()
        assert int(accepted[b]) == int(lengths[b]) or drafts[b, accepted[b]] != best[b, accepted[b]]
    assert int(best.min()) >= 3


def test_the_noise_of_a_position_does_not_depend_on_the_draws_before_it():
    from spec_adapt.noise import StepNoise

    keys = [11, 12, 13]
    a = StepNoise(keys, [0, 5, 9], 50, "cpu")
    b = StepNoise(keys[::-1], [9 + 2, 5 + 2, 0 + 2], 50, "cpu")
    a.at(3)
    assert torch.equal(a.at(2), b.at(0).flip(0))          # same (key, position): same numbers, whatever came before
    assert torch.equal(a.select([2, 0]).at(2), a.at(2)[[2, 0]])
    assert not torch.equal(a.at(0), a.at(1))
