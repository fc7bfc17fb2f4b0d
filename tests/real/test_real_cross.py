"""The text bridge between two real tokenizers: SmolLM2-135M-Instruct's (49,152-token BPE) and Qwen2.5-Coder's
(151,665 tokens). Greedy identity of SmolLM2 drafting for the 1.5B is in test_real_qwen.py (it shares that file's
batch and reference)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec_adapt
from spec_adapt.drafters.cross import CrossTokenizerDrafter, TextBridge

pytestmark = pytest.mark.real
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
