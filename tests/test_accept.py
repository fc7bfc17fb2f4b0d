"""Acceptance functions: properties against a naive per-row reading of the algorithm, and distribution tests."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from spec_adapt.acceptance_rules import committed_tokens, greedy_accept, rejection_sample, sample_randoms


def naive_greedy(logits, drafts, lengths):
    accepted, nxt = [], []
    for b in range(drafts.shape[0]):
        a = 0
        while a < int(lengths[b]) and int(logits[b, a].argmax()) == int(drafts[b, a]):
            a += 1
        accepted.append(a)
        nxt.append(int(logits[b, a].argmax()))
    return accepted, nxt


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 6), width=st.integers(0, 6), vocab=st.integers(2, 9), seed=st.integers(0, 10_000))
def test_greedy_accept_matches_naive(batch, width, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width + 1, vocab, generator=gen)
    target = logits.argmax(-1)
    # Drafts that agree with the target for a random prefix, so every acceptance length occurs.
    agree = torch.randint(0, width + 1, (batch,), generator=gen)
    noise = torch.randint(0, vocab, (batch, width), generator=gen)
    pos = torch.arange(width)[None, :]
    drafts = torch.where(pos < agree[:, None], target[:, :width], noise)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    accepted, nxt = greedy_accept(logits, drafts, lengths)
    exp_acc, exp_next = naive_greedy(logits, drafts, lengths)
    assert accepted.tolist() == exp_acc and nxt.tolist() == exp_next
    assert bool((accepted <= lengths).all())


def test_greedy_worked_example():
    vocab = 10
    target = torch.tensor([[7, 3, 4, 8], [7, 3, 9, 8]])
    logits = torch.nn.functional.one_hot(target, vocab).float()
    drafts = torch.tensor([[7, 3, 9], [7, 3, 9]])
    accepted, nxt = greedy_accept(logits, drafts, torch.tensor([3, 3]))
    assert accepted.tolist() == [2, 3] and nxt.tolist() == [4, 8]
    assert committed_tokens(drafts, accepted, nxt).tolist() == [[7, 3, 4, -1], [7, 3, 9, 8]]


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(1, 5), width=st.integers(0, 5), vocab=st.integers(2, 8), seed=st.integers(0, 10_000),
       point_mass=st.booleans())
def test_rejection_sample_invariants(batch, width, vocab, seed, point_mass):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(batch, width + 1, vocab, generator=gen).softmax(-1)
    q = None if point_mass else torch.rand(batch, width, vocab, generator=gen).softmax(-1)
    drafts = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    u, e = sample_randoms(batch, width, vocab, torch.device("cpu"), gen)
    accepted, nxt = rejection_sample(p, drafts, q, lengths, u, e)
    assert bool((accepted <= lengths).all()) and bool((nxt >= 0).all()) and bool((nxt < vocab).all())
    # Same randoms, same answer: a pure function.
    again = rejection_sample(p, drafts, q, lengths, u, e)
    assert torch.equal(again[0], accepted) and torch.equal(again[1], nxt)
    # A rejected draft token is never the recovered token (its residual mass is zero).
    for b in range(batch):
        if int(accepted[b]) < int(lengths[b]):
            assert int(nxt[b]) != int(drafts[b, accepted[b]])


def _first_token_distribution(p0, q0, point_mass_token, n, seed):
    """Empirical distribution of the first committed token over n independent one-token drafts."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p0.shape[-1]
    p = p0.expand(n, 2, vocab).contiguous()
    if point_mass_token is None:
        drafts = torch.multinomial(q0.expand(n, vocab), 1, generator=gen)
        q = q0.expand(n, 1, vocab)
    else:
        drafts = torch.full((n, 1), point_mass_token)
        q = None
    u, e = sample_randoms(n, 1, vocab, torch.device("cpu"), gen)
    accepted, nxt = rejection_sample(p, drafts, q, torch.ones(n, dtype=torch.long), u, e)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    return torch.bincount(first, minlength=vocab).float() / n


def test_rejection_sampling_approximates_target_distribution():
    """vLLM-style: the committed token's distribution converges to p whatever q is (draft model or point mass)."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 8, 200_000
    p0 = torch.rand(2, vocab, generator=gen) ** 2
    p0 = p0 / p0.sum(-1, keepdim=True)
    q0 = torch.rand(vocab, generator=gen) ** 2
    q0 = q0 / q0.sum()
    for point_mass in (None, int(p0[0].argmin())):
        empirical = _first_token_distribution(p0, q0, point_mass, n, seed=1)
        # 5 standard errors of a multinomial frequency, per token.
        tolerance = 5 * (p0[0] * (1 - p0[0]) / n).sqrt() + 1e-4
        assert bool(((empirical - p0[0]).abs() < tolerance).all()), (empirical, p0[0])
    # And a draft equal to the target is always accepted.
    accepted, _ = rejection_sample(
        p0[None].expand(100, 2, vocab), torch.multinomial(p0[0].expand(100, vocab), 1),
        p0[None, :1].expand(100, 1, vocab), torch.ones(100, dtype=torch.long), *sample_randoms(100, 1, vocab, "cpu"))
    assert bool((accepted == 1).all())


def test_rejection_sampling_detects_a_lossy_rule():
    """The distribution test must be able to fail: accepting every draft gives q, not p."""
    gen = torch.Generator().manual_seed(3)
    vocab, n = 8, 200_000
    p = torch.rand(vocab, generator=gen); p /= p.sum()
    q = torch.rand(vocab, generator=gen) ** 3; q /= q.sum()
    drafts = torch.multinomial(q.expand(n, vocab), 1, replacement=True, generator=gen)[:, 0]
    empirical = torch.bincount(drafts, minlength=vocab).float() / n    # "accept everything"
    tolerance = 5 * (p * (1 - p) / n).sqrt() + 1e-4
    assert not bool(((empirical - p).abs() < tolerance).all())
