"""Sampling through the whole loop: the tokens produced have exactly the target's distribution."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import spec_adapt
from spec_adapt import FixedLength, ScriptedDrafter

from conftest import PAD, stock_greedy, tiny_model

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


def processed_probs(model, prefixes, temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0):
    """Target distributions [N, V] after each prefix [N, L], under temperature + top-k (+ top-p)."""
    with torch.no_grad():
        logits = model(prefixes, use_cache=False).logits[:, -1].float()
    logits = TemperatureLogitsWarper(temperature)(prefixes, logits)
    if top_k:
        logits = TopKLogitsWarper(top_k)(prefixes, logits)
    if top_p < 1.0:
        logits = TopPLogitsWarper(top_p)(prefixes, logits)
    return logits.softmax(-1)


def exact_marginals(model, prompt, depth=3, **warp):
    """Marginal distribution of each of the first `depth` generated tokens, by enumerating all prefixes."""
    prefixes = torch.tensor([prompt])
    joint = torch.ones(1)                                       # probability of each prefix
    marginals = []
    for _ in range(depth):
        probs = processed_probs(model, prefixes, **warp)         # [N, V]
        step = joint[:, None] * probs                            # [N, V]
        marginals.append(step.sum(0))
        joint = step.flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB_SMALL, 0),
                              torch.arange(VOCAB_SMALL).repeat(len(prefixes))[:, None]], dim=1)
    return marginals


def sample(model, drafter, n, seed, gamma=3, policy=None, **kw):
    prompt = torch.tensor([[3, 7, 9, 4]]).repeat(n, 1)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                         temperature=TEMPERATURE, top_k=TOP_K, top_p=None, max_new_tokens=5,
                         eos_token_id=None, pad_token_id=PAD, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=policy or FixedLength(gamma), **kw)
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


def assert_follows_target(target, drafter, n, **kw):
    """Sample n continuations through the loop with `drafter`; each of the first 3 tokens' empirical distribution
    must match the target's exact marginal (5 standard errors). Token 1 comes from the prefill; tokens 2 and 3 are
    drafted, accepted or recovered."""
    assert follows_target(target, drafter, n, **kw) is None


def follows_target(target, drafter, n, **kw):
    """None when the sampled marginals match the target's, else (position, statistic, bound) of the first miss."""
    marginals = exact_marginals(target, [3, 7, 9, 4])
    tokens = sample(target, drafter, n, seed=0, **kw)
    stats = spec_adapt.last_stats()
    assert stats.fallback is None and stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    return marginals_miss(tokens, marginals)


# Pearson's chi-square at a false-alarm rate of about 1e-6 per position: z = 4.75 in the Wilson-Hilferty form. A
# seeded test is deterministic; the rate says how far from the bound a correct rule's statistic sits.
CHI2_Z = 4.75


def chi2_bound(dof: int, z: float = CHI2_Z) -> float:
    """The chi-square quantile at standard-normal z (Wilson-Hilferty: within 1% for 10+ degrees of freedom)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def marginals_miss(tokens: torch.Tensor, marginals, vocab: int = VOCAB_SMALL):
    """None when each position's sampled tokens (tokens [n, >= depth]) fit that position's exact marginal, else
    (position, statistic, bound) of the first that does not. Pearson's chi-square over the tokens the target can
    produce, against `chi2_bound`; a token of probability 0 sampled even once is a miss (statistic inf). The whole
    distribution at once: a lossy rule that moves many tokens a little (accepting drafts a draft close to the target
    proposes) fails it where a per-token bound lets each move pass."""
    n = tokens.shape[0]
    for position, exact in enumerate(marginals):
        counts = torch.bincount(tokens[:, position], minlength=vocab).double()
        exact = exact.double()
        possible = exact > 0
        if bool((counts[~possible] > 0).any()):
            return position, float("inf"), 0.0
        expected = n * exact[possible]
        statistic = float(((counts[possible] - expected) ** 2 / expected).sum())
        bound = chi2_bound(int(possible.sum()) - 1)
        if statistic > bound:
            return position, statistic, bound
    return None


@pytest.mark.parametrize("kind", ["model", "point_mass", "tree"])
def test_the_rejection_rule_follows_target_distribution(small, kind):
    """The same enumerated test under Acceptor(rule="rejection"): rejection sampling, recursive down a tree, with the
    draft model sampling from its own distribution."""
    from spec_adapt import FixedTree, ModelDrafter

    target, draft = small
    rejection = spec_adapt.Acceptor(rule="rejection")
    if kind == "tree":
        assert_follows_target(target, ModelDrafter(draft, branch=3), 6000, policy=FixedTree(6, 3), acceptor=rejection)
        return
    first = int(exact_marginals(target, [3, 7, 9, 4], depth=1)[0].argmax())
    drafter = draft if kind == "model" else ScriptedDrafter(lambda row, context, gamma: [first, 5, 6][:gamma])
    assert_follows_target(target, drafter, 6000, acceptor=rejection)


class LossyCoupled(spec_adapt.Acceptor):
    """The coupled rule made lossy: a draft is accepted while it is among the two best of scores + noise (the next
    token stays the best), so drafts the target nearly sampled are kept."""

    def greedy(self, logits, draft_tokens, lengths):
        width = draft_tokens.shape[1]
        top = logits[:, :width].topk(2, dim=-1).indices
        ok = (top == draft_tokens[..., None]).any(-1) & (torch.arange(width)[None, :] < lengths[:, None])
        accepted = ok.long().cumprod(-1).sum(-1)
        return accepted, logits.argmax(-1).gather(1, accepted[:, None]).squeeze(1)


def test_a_lossy_coupled_rule_is_caught(small):
    target, draft = small
    assert follows_target(target, draft, 6000, acceptor=LossyCoupled()) is not None


class LossyTreeAcceptor(spec_adapt.Acceptor):
    """Tests every sibling against the untouched target p: no residual after a rejection (a lossy tree rule, of the
    rejection rule's recursive walk)."""

    def __init__(self):
        super().__init__(rule="rejection")

    def tree_rejection(self, target_probs, draft_tokens, parents, draft_probs, lengths, uniforms, exponentials):
        batch, width = draft_tokens.shape
        rows = torch.arange(batch, device=draft_tokens.device)
        cur = torch.zeros_like(lengths)
        path = torch.zeros(batch, width, dtype=torch.bool, device=draft_tokens.device)
        for i in range(width):
            tried = (parents[:, i] + 1 == cur) & (i < lengths)
            x = draft_tokens[:, i]
            q = 1.0 if draft_probs is None else draft_probs[rows, i, x]
            accept = tried & (uniforms[:, i] * q < target_probs[rows, cur, x])
            path[:, i] = accept
            cur = torch.where(accept, i + 1, cur)
        next_token = (target_probs[rows, cur] / exponentials).argmax(-1)
        return path, path.long().sum(1), next_token


@pytest.mark.parametrize("kind", ["model", "point_mass"])
def test_sampling_through_trees_follows_target_distribution(small, kind):
    from spec_adapt import FixedTree, ModelDrafter

    target, draft = small
    if kind == "model":
        drafter = ModelDrafter(draft, branch=3)
    else:       # point-mass siblings chosen without looking at the target: the best and two fixed tokens
        first = int(exact_marginals(target, [3, 7, 9, 4], depth=1)[0].argmax())
        drafter = ScriptedDrafter(lambda row, context, gamma: [[first, 5], [6, 7], [8]])
    assert_follows_target(target, drafter, 6000, policy=FixedTree(6, 3))
    assert sum(max(r.drafted) > max(r.accepted) + 1 for r in spec_adapt.last_stats().trace) > 0   # real trees


@pytest.mark.parametrize("kind", ["model", "point_mass"])
def test_a_lossy_tree_rule_is_caught(small, kind):
    from spec_adapt import FixedTree, ModelDrafter

    target, draft = small
    if kind == "model":
        drafter = ModelDrafter(draft, branch=3)
    else:
        first = int(exact_marginals(target, [3, 7, 9, 4], depth=1)[0].argmax())
        drafter = ScriptedDrafter(lambda row, context, gamma: [[first, 5], [6, 7], [8]])
    assert follows_target(target, drafter, 6000, policy=FixedTree(6, 3), acceptor=LossyTreeAcceptor()) is not None


def test_accepting_every_draft_would_be_caught(small):
    """Control for the test above: the draft's own distribution differs measurably from the target's."""
    target, draft = small
    n = 6000
    first = exact_marginals(target, [3, 7, 9, 4], depth=1)[0]
    q = processed_probs(draft, torch.tensor([[3, 7, 9, 4]]))[0]
    torch.manual_seed(0)
    lossy = torch.multinomial(q.expand(n, VOCAB_SMALL), 1)
    assert marginals_miss(lossy, [first]) is not None
    assert marginals_miss(torch.multinomial(first.expand(n, VOCAB_SMALL), 1), [first]) is None   # the target's own


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
    assert marginals_miss(tokens, marginals) is None


def test_cross_tokenizer_point_mass_drafts_follow_target_distribution(small):
    """A draft with another tokenizer (byte-level BPE, drafting text) for a character-level target: its proposals
    are point masses in the target's ids, and the sampled tokens keep the target's exact distribution."""
    from spec_adapt.drafters.cross import CrossTokenizerDrafter
    from tiny_tokenizers import bpe_tokenizer, char_tokenizer

    target, _ = small
    draft_tokenizer = bpe_tokenizer("bytelevel", 420)
    script = ScriptedDrafter(lambda row, context, gamma: draft_tokenizer.encode("$&#'%", add_special_tokens=False))
    drafter = CrossTokenizerDrafter(script, draft_tokenizer, char_tokenizer(VOCAB_SMALL))
    assert_follows_target(target, drafter, 6000)


class RuledWidth(FixedLength):
    """FixedLength(k) whose rows stop inside the step at a survival threshold of the draft's own confidences: depths
    that differ per row and per step, decided from what the draft sampled."""

    def __init__(self, k, thresholds):
        super().__init__(k)
        from spec_adapt.running_estimates import Calibration, StopRule

        self.rule = StopRule(thresholds, Calibration())

    def choose(self, info):
        from spec_adapt.policies.policy import Plan

        return Plan(super().choose(info), stop=self.rule)


def test_rows_stopped_by_the_draft_confidence_follow_target_distribution(small):
    """Depth decided inside the step (a stop rule, as `Adaptive(stop_rule=True)` plans) reads only the draft's own
    probabilities of the tokens it sampled, so the sampled tokens keep the target's distribution with ragged per-row
    depths."""
    target, draft = small
    assert_follows_target(target, draft, 6000, policy=RuledWidth(3, [0.0, 0.1, 0.005]))   # unsure: ~0.05-0.2 a token
    trace = spec_adapt.last_stats().trace
    assert any(0 < d < g for r in trace for d, g in zip(r.drafted, r.gammas))      # some rows stopped early
    assert any(d == g > 1 for r in trace for d, g in zip(r.drafted, r.gammas))     # and some drafted their most


def test_the_serving_engine_follows_target_distribution(small):
    """The enumerated test through the serving Engine: 3,000 requests for 5 tokens each (the first 3 checked)
    through a batch of at most 1,000, so most requests join a running batch (their prefill apart, their rows added to
    the draft's and the target's caches), drafted by the draft model and accepted by the rejection rule."""
    from spec_adapt import ModelDrafter
    from spec_adapt.serving.engine import Engine

    target, draft = small
    n = 3000
    marginals = exact_marginals(target, [3, 7, 9, 4])
    engine = Engine(target, drafter=ModelDrafter(draft), assistant_policy=FixedLength(3), max_batch=1000,
                    max_new_tokens=5, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, eos_token_id=None,
                    pad_token_id=PAD, seed=0)
    handles = [engine.submit([3, 7, 9, 4]) for _ in range(n)]
    engine.run_until_idle()
    tokens = torch.tensor([h.result()[:3] for h in handles])
    stats = engine.stats
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    assert marginals_miss(tokens, marginals) is None


def test_the_serving_engine_samples_each_request_by_its_own_parameters(small):
    """The enumerated test with per-request sampling in one running batch: requests at temperature 0.9 with top-k 12,
    at temperature 1.4 with top-p 0.8, and greedy ones, interleaved, drafted by the draft model. Each sampled group
    follows its own exact marginals; every greedy request gives the argmax continuation."""
    from spec_adapt import ModelDrafter
    from spec_adapt.serving.engine import Engine

    target, draft = small
    prompt = [3, 7, 9, 4]
    groups = {"a": dict(temperature=TEMPERATURE, top_k=TOP_K), "b": dict(temperature=1.4, top_p=0.8)}
    engine = Engine(target, drafter=ModelDrafter(draft), assistant_policy=FixedLength(3), max_batch=1000,
                    max_new_tokens=5, eos_token_id=None, pad_token_id=PAD, seed=0)
    kinds = ["a", "b"] * 1500 + ["greedy"] * 100
    random.Random(0).shuffle(kinds)
    handles = [engine.submit(prompt, **groups.get(kind, {})) for kind in kinds]
    engine.run_until_idle()
    stats = engine.stats
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    for name, warp in groups.items():
        tokens = torch.tensor([h.result()[:3] for h, kind in zip(handles, kinds) if kind == name])
        marginals = exact_marginals(target, prompt, **{"top_k": 0, **warp})
        assert marginals_miss(tokens, marginals) is None, name
    ids = torch.tensor([prompt])
    greedy = stock_greedy(target, ids, torch.ones_like(ids), eos_token_id=None, max_new_tokens=5)[0, 4:].tolist()
    assert all(h.result() == greedy for h, kind in zip(handles, kinds) if kind == "greedy")
