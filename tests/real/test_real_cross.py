"""A draft with another tokenizer on real models: SmolLM2-135M-Instruct (49,152-token BPE) drafting for
Qwen2.5-Coder-1.5B-Instruct (151,665 tokens). The text bridge's properties over the two real tokenizers, and greedy
identity with stock generate on a ragged batch, alone and under a chain with the 0.5B."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec_adapt
from spec_adapt import ChainDrafter, FixedLength
from spec_adapt.drafters.cross import CrossTokenizerDrafter, TextBridge
from spec_adapt.recipes import workloads

pytestmark = pytest.mark.real
NEW_TOKENS = 32
PIECES = ["def ", "return", " x", "(", "):\n", "    ", "\n\n", " the", " é", "ü", "中文", "🙂", "<|im_start|>",
          "<|im_end|>", "user\n", "  ", "\t", "0.5", "==", "'", '"""', "ß", " Hello", ","]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tokenizers(smollm2, qwen_pair):
    return smollm2[1], qwen_pair[2]


@SETTINGS
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=2, max_size=24), cut=st.integers(1, 30))
def test_real_proposals_never_say_more_than_the_drafted_text(tokenizers, pieces, cut):
    draft_tok, target_tok = tokenizers
    ids = target_tok.encode("".join(pieces), add_special_tokens=False)
    cut = min(cut, len(ids) - 1)
    if cut < 1:
        return
    rest = TextBridge.text(target_tok, ids, cut, len(ids))
    proposed = TextBridge(draft_tok, target_tok).to_target(ids[:cut], rest, 100)
    before, after = decode(target_tok, ids[:cut]), decode(target_tok, ids[:cut] + proposed)
    if before.endswith("\ufffd"):
        assert proposed == []
    else:
        assert after.startswith(before) and decode(target_tok, ids).startswith(after.rstrip("\ufffd"))


@SETTINGS
@given(pieces=st.lists(st.lists(st.sampled_from(PIECES), max_size=6), min_size=1, max_size=10))
def test_real_draft_tokens_spell_the_committed_text(tokenizers, pieces):
    draft_tok, target_tok = tokenizers
    drafter = CrossTokenizerDrafter(spec_adapt.ScriptedDrafter(lambda *a: []), draft_tok, target_tok)
    committed = target_tok.encode("<|im_start|>user\n", add_special_tokens=False)
    row = drafter._new_row(list(committed))
    for piece in pieces:
        committed += target_tok.encode("".join(piece), add_special_tokens=False)
        if drafter._align(row, committed):
            assert decode(draft_tok, row.draft) == decode(target_tok, committed)


@pytest.fixture(scope="module")
def batch(qwen_pair):
    tok = qwen_pair[2]
    prompts = list(workloads.with_inputs(workloads.humaneval(limit=1), tok)["input_text"])
    prompts += list(workloads.with_inputs(workloads.sharegpt(limit=1, max_chars=300), tok)["input_text"])
    return tok(prompts, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def reference(qwen_pair, batch):
    return qwen_pair[0].generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)


def speculate(target, batch, drafter):
    stats = spec_adapt.SpecStats()
    out = target.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, custom_generate=spec_adapt.generate,
                          drafter=drafter, assistant_policy=FixedLength(4), spec_stats=stats, strict=True)
    return out, stats


def test_smollm2_drafts_for_qwen(smollm2, qwen_pair, batch, reference):
    target, _, target_tok = qwen_pair
    out, stats = speculate(target, batch, CrossTokenizerDrafter(smollm2[0], smollm2[1], target_tok))
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.accepted > 0


def test_smollm2_as_the_first_level_of_a_chain(smollm2, qwen_pair, batch, reference):
    target, draft, target_tok = qwen_pair
    chain = ChainDrafter([CrossTokenizerDrafter(smollm2[0], smollm2[1], target_tok), draft])
    out, stats = speculate(target, batch, chain)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.accepted > 0
