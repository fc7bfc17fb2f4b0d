"""Losslessness in bfloat16 on the CPU, judged by the tie-aware rule (spec_adapt.identity): a tiny random Llama in
bf16, spec_adapt against stock bf16 `generate`. In bf16 a verification over several tokens can break a near-tie
differently from a one-token step; the rule accepts exactly that and nothing more."""

from __future__ import annotations

import functools

import pytest
import torch

from spec_adapt import FixedLength, PromptLookupDrafter
from spec_adapt.identity import assert_lossless

from conftest import PAD, VOCAB, Oracle, spec_generate, stock_greedy, tiny_model


@functools.lru_cache(maxsize=None)
def bf16_llama():
    return tiny_model("llama", seed=3).to(torch.bfloat16)


def repetitive_batch(batch: int, seed: int = 0):
    """Left-padded prompts that repeat a short phrase (prompt lookup finds matches), ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [12 - (i * 3) % 7 for i in range(batch)]
    width = max(lengths)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        phrase = torch.randint(3, VOCAB, (3,), generator=gen)
        ids[b, width - n:] = phrase.repeat(n // 3 + 1)[:n]
        mask[b, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("draft", ["lookup", "scripted"])
def test_bf16_output_is_lossless_under_the_tie_rule(batch, draft):
    model = bf16_llama()
    ids, mask = repetitive_batch(batch, seed=batch)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=32)
    drafter = PromptLookupDrafter() if draft == "lookup" else Oracle(reference, mask, ["right", 2, "wrong"]).drafter()
    out, stats = spec_generate(model, ids, mask, drafter, FixedLength(4), max_new_tokens=32)
    assert stats.fallback is None and stats.drafted > 0 and stats.accepted > 0
    verdict = assert_lossless(model, ids, mask, reference, out, dtype=torch.bfloat16)
    assert len(verdict.rows) == batch
