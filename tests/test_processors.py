"""Every logits processor transformers builds from a generation config, at batch 3 (ragged), with drafts that are
right for some rows and wrong for others: each position is processed with its own row's state and context."""

from __future__ import annotations

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength

from conftest import EOS, PAD, Oracle, cached_model, ragged_batch, stock_greedy

# generate's keyword -> value: each builds one processor (greedy: the warpers that only sampling uses are left out).
SETTINGS = {
    "repetition_penalty": 1.5,
    "encoder_repetition_penalty": 1.5,
    "no_repeat_ngram_size": 2,
    "encoder_no_repeat_ngram_size": 2,
    "bad_words_ids": [[7], [11, 12]],
    "sequence_bias": {(20,): 5.0, (21, 22): -3.0},
    "min_new_tokens": 6,
    "min_length": 14,
    "forced_bos_token_id": 5,
    "forced_eos_token_id": EOS,
    "suppress_tokens": [8, 9],
    "begin_suppress_tokens": [10],
    "exponential_decay_length_penalty": (4, 1.5),
    "renormalize_logits": True,
    "remove_invalid_values": True,
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_generation_config_processor_batched(name):
    model = cached_model("llama")
    ids, mask = ragged_batch(3, seed=31)
    setting = {name: SETTINGS[name]}
    if name == "forced_eos_token_id":
        setting["max_new_tokens"] = 10
    if name in ("min_new_tokens", "min_length", "forced_eos_token_id", "exponential_decay_length_penalty"):
        setting["eos_token_id"] = EOS
    setting = {"max_new_tokens": 16, "eos_token_id": None, **setting}
    reference = stock_greedy(model, ids, mask, **setting)
    for modes in (["right", "wrong", 2], [1, "right", "wrong"]):
        stats = spec_adapt.SpecStats()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **setting,
                             custom_generate=spec_adapt.generate, drafter=Oracle(reference, mask, modes).drafter(),
                             assistant_policy=FixedLength(3), spec_stats=stats)
        assert torch.equal(out, reference), name
        assert stats.accepted > 0
