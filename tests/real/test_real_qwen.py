"""Integration on the real pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (fp32), both
assembled from their PyPI part packages and loaded once per session (the 1.5B runs at ~3 tokens/s on 2 cores, so
the batch is 2 ragged prompts and 32 new tokens)."""

from __future__ import annotations

import pytest
import torch

import spec_adapt
from spec_adapt import ChainDrafter, ChainScheduler, FixedLength, PromptLookupDrafter
from spec_adapt.policies import GoodputModel
from spec_adapt.recipes import workloads

pytestmark = pytest.mark.real
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def batch(qwen_pair):
    tok = qwen_pair[2]
    prompts = list(workloads.with_inputs(workloads.humaneval(limit=1), tok)["input_text"])
    prompts += list(workloads.with_inputs(workloads.sharegpt(limit=1, max_chars=300), tok)["input_text"])
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert enc["attention_mask"][:, 0].tolist().count(0) == 1            # ragged: one row is left-padded
    return enc


@pytest.fixture(scope="module")
def reference(qwen_pair, batch):
    target = qwen_pair[0]
    return target.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)


def speculate(target, batch, drafter, policy):
    stats = spec_adapt.SpecStats()
    out = target.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, custom_generate=spec_adapt.generate,
                          drafter=drafter, assistant_policy=policy, spec_stats=stats)
    return out, stats


def test_draft_model_fixed_length(qwen_pair, batch, reference):
    target, draft, _ = qwen_pair
    out, stats = speculate(target, batch, draft, FixedLength(3))
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.acceptance_rate > 0.3          # a real draft of the same family


def test_draft_model_adaptive(qwen_pair, batch, reference):
    target, draft, _ = qwen_pair
    out, stats = speculate(target, batch, draft, GoodputModel(max_gamma=6, explore=0.05))
    assert torch.equal(out, reference)
    assert stats.fallback is None


def test_three_level_chain(qwen_pair, batch, reference):
    target, draft, _ = qwen_pair
    chain = ChainDrafter([PromptLookupDrafter(3, 2), draft])
    out, stats = speculate(target, batch, chain, ChainScheduler(chain, widths=(2, 4)))
    assert torch.equal(out, reference)
    assert stats.fallback is None and not stats.drafter_events


def test_prepared_pair_is_identical_to_prepared_stock(qwen_pair, batch):
    """spec_adapt.prepare on target and draft: greedy output equals stock generate on the same prepared target
    (identity is judged within one execution configuration)."""
    from spec_adapt.execution import prepared

    target, draft, _ = qwen_pair
    spec_adapt.prepare(target)
    spec_adapt.prepare(draft)
    try:
        assert prepared(target)["layers"] > 0 and prepared(draft)["layers"] > 0
        stock = target.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        out, stats = speculate(target, batch, draft, FixedLength(3))
        assert torch.equal(out, stock)
        assert stats.fallback is None and stats.drafted > 0
    finally:
        spec_adapt.unprepare(target)
        spec_adapt.unprepare(draft)


def test_smollm2_with_its_own_tokenizer_drafts_for_the_target(smollm2, qwen_pair, batch, reference):
    from spec_adapt.drafters import CrossTokenizerDrafter

    target, _, tok = qwen_pair
    out, stats = speculate(target, batch, CrossTokenizerDrafter(smollm2[0], smollm2[1], tok), FixedLength(4))
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.accepted > 0


def test_smollm2_as_the_first_level_of_a_chain_before_the_draft(smollm2, qwen_pair, batch, reference):
    from spec_adapt.drafters import CrossTokenizerDrafter

    target, draft, tok = qwen_pair
    chain = ChainDrafter([CrossTokenizerDrafter(smollm2[0], smollm2[1], tok), draft])
    out, stats = speculate(target, batch, chain, FixedLength(4))
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.accepted > 0
