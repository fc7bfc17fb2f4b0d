"""The ways in: the process's default policy (learns across calls), `enable(model, assistant_policy=...)`, and the
`custom_generate/` folder a clone of this repository provides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spec_adapt
from spec_adapt import Adaptive, FixedLength, ModelDrafter, PromptLookupDrafter
from spec_adapt.api import default_policy

from conftest import PAD, Oracle, cached_model, ragged_batch, stock_greedy

ROOT = Path(__file__).resolve().parents[1]


def plain_call(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                          max_new_tokens=16, custom_generate=spec_adapt.generate, **kw)


def test_default_policy_is_kept_per_target_drafter_dtype():
    llama, qwen = cached_model("llama"), cached_model("qwen2")
    spec_adapt.reset_default_policies()
    ids, mask = ragged_batch(2, seed=3)
    drafter = PromptLookupDrafter(2, 1)
    plain_call(llama, ids, mask, drafter=drafter)
    first = default_policy(llama, drafter)
    steps = first.steps
    assert steps > 0                                      # the call used (and taught) the process's policy
    plain_call(llama, ids, mask, drafter=PromptLookupDrafter(3, 1))
    assert default_policy(llama, drafter) is first and first.steps > steps      # the second call is warm
    assert default_policy(qwen, drafter) is not first                           # another target, another policy
    assert default_policy(llama, None) is not first                             # another drafter kind
    spec_adapt.reset_default_policies(llama)
    assert default_policy(llama, drafter) is not first                          # forgotten: starts cold


def test_default_policy_keys_the_draft_model():
    llama = cached_model("llama")
    a, b = ModelDrafter(cached_model("llama", seed=1)), ModelDrafter(cached_model("llama", seed=2))
    assert default_policy(llama, a) is default_policy(llama, ModelDrafter(a.model))
    assert default_policy(llama, a) is not default_policy(llama, b)


def test_default_policy_output_is_stock():
    llama = cached_model("llama")
    ids, mask = ragged_batch(3, seed=4)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None, max_new_tokens=16)
    oracle = Oracle(reference, mask, ["right", 2, "wrong"])
    for _ in range(2):                                   # cold, then warm
        assert torch.equal(plain_call(llama, ids, mask, drafter=oracle.drafter()), reference)


def test_enable_sets_the_policy_of_later_calls():
    llama = cached_model("llama")
    ids, mask = ragged_batch(2, seed=5)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None, max_new_tokens=16)
    oracle = Oracle(reference, mask, ["right"])
    policy = FixedLength(3)
    spec_adapt.enable(llama, assistant_policy=policy)
    try:
        stats = spec_adapt.SpecStats()
        out = llama.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None, max_new_tokens=16, assistant_model=oracle.drafter(), spec_stats=stats)
        assert torch.equal(out, reference)
        assert stats.policy == repr(policy) and stats.drafted > 0
        # No draft and no policy: stock generate, untouched.
        assert torch.equal(stock_greedy(llama, ids, mask, eos_token_id=None, max_new_tokens=16), reference)
    finally:
        spec_adapt.disable(llama)
    assert spec_adapt.api._ENABLED.get(llama) is None


def test_enable_refuses_a_non_policy():
    with pytest.raises(TypeError):
        spec_adapt.enable(cached_model("llama"), assistant_policy="adaptive")


@pytest.mark.parametrize("how", ["assistant_model", "drafter"])
def test_custom_generate_folder_is_greedy_identical(how):
    """`custom_generate=<path of a clone>` runs spec_adapt through transformers' folder convention."""
    llama = cached_model("llama")
    ids, mask = ragged_batch(3, seed=6)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None, max_new_tokens=16)
    oracle = Oracle(reference, mask, ["right", 1, "wrong"])
    stats = spec_adapt.SpecStats()
    out = llama.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                         max_new_tokens=16, custom_generate=str(ROOT), trust_remote_code=True,
                         assistant_policy=Adaptive(), spec_stats=stats, **{how: oracle.drafter()})
    assert torch.equal(out, reference)
    assert stats.steps > 0 and stats.drafted > 0


def test_custom_generate_folder_refuses_two_drafts():
    llama = cached_model("llama")
    ids, mask = ragged_batch(1, seed=7)
    with pytest.raises(ValueError, match="not both"):
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=str(ROOT),
                       trust_remote_code=True, assistant_model=ModelDrafter(llama), drafter=PromptLookupDrafter())


@pytest.mark.real
def test_stop_strings_with_a_tokenizer_work_after_enable(smollm2):
    """After `enable`, stop_strings with tokenizer= are the StopStringCriteria stock builds, and the output equals
    stock's."""
    model, tok = smollm2
    batch = tok(["def add(a, b):\n    return a + b\n\ndef sub(a, b):"], return_tensors="pt")
    free = model.generate(**batch, do_sample=False, max_new_tokens=16)
    text = tok.decode(free[0, batch["input_ids"].shape[1]:])
    stop = text.strip().split()[1]                      # a word the answer reaches early
    kw = dict(**batch, do_sample=False, max_new_tokens=16, stop_strings=[stop], tokenizer=tok)
    reference = model.generate(**kw)
    spec_adapt.enable(model)
    try:
        out = model.generate(**kw, assistant_model=PromptLookupDrafter(2, 1))
    finally:
        spec_adapt.disable(model)
    assert torch.equal(out, reference) and out.shape[1] < free.shape[1]
