"""The ways in: the process's default policy (learns across calls), `enable(model, assistant_policy=...)`, and the
`custom_generate/` folder a clone of this repository provides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import spec_adapt
from spec_adapt import Adaptive, FixedLength, ModelDrafter, PromptLookupDrafter
from spec_adapt.api import default_policy

from conftest import PAD, VOCAB, Oracle, cached_model, ragged_batch, stock_greedy

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


def ensemble_call(model, draft, ids, mask, weight, max_new_tokens=20, pad=PAD):
    """Stock's assisted generation, or spec_adapt's after `enable` (FixedLength(3))."""
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad, eos_token_id=None,
                          max_new_tokens=max_new_tokens, assistant_model=draft, assistant_ensemble_weight=weight)


@pytest.mark.parametrize("weight", [0.5, 0.1])
def test_assistant_ensemble_weight_is_stocks(weight):
    """Stock's lossy ensemble verification (drafts judged against w * p_target + (1 - w) * q_draft). Stock's first
    assisted step drafts from the prompt, and so does spec_adapt's: at batch 1 a row's tokens, the first included,
    are stock's own ensemble output for its prompt, and at batch 3 each row's are its own at batch 1.

    Except where stock's assistant masks its own context: stock 5.24 drops an all-ones attention mask, and its
    assistant's generate then infers one from the tokens, masking every token equal to `pad_token_id`. A row that
    generates the pad id (here row 2 at w = 0.5, whose third token is 0) is drafted there from another context than
    the draft's, and its later tokens change. Exactly those rows, the ones whose stock output changes when the call
    names a pad id no token equals, are compared with that output instead: stock's ensemble tokens with nothing
    masked. `stats.lossy` says the output is lossy."""
    import copy

    target, draft = cached_model("llama"), copy.deepcopy(cached_model("llama", seed=1))
    # Stock reads its draft schedule from the draft's own generation config: 3 drafts a step, no confidence exit.
    draft.generation_config.num_assistant_tokens, draft.generation_config.assistant_confidence_threshold = 3, 0.0
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    ids, mask = ragged_batch(3, seed=11)
    plain = stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=20)
    pads = (mask == 0).sum(dim=1).tolist()
    prompts = [ids[b:b + 1, pads[b]:] for b in range(3)]
    stock = [ensemble_call(target, draft, p, torch.ones_like(p), weight)[0] for p in prompts]
    unmasked = [ensemble_call(target, draft, p, torch.ones_like(p), weight, pad=VOCAB)[0] for p in prompts]
    masked = [b for b in range(3) if not torch.equal(stock[b], unmasked[b])]
    # Stock's masking is what changes them: each holds a generated pad id; most rows are compared with stock as is.
    assert all(PAD in stock[b][prompts[b].shape[1]:] for b in masked) and len(masked) < 2, masked
    assert not torch.equal(stock[0], plain[0, pads[0]:])       # the weight changes the tokens, the first one too
    assert stock[0][prompts[0].shape[1]] != plain[0, ids.shape[1]]
    spec_adapt.enable(target, assistant_policy=FixedLength(3))
    try:
        ours = []
        for prompt in prompts:
            ours.append(ensemble_call(target, draft, prompt, torch.ones_like(prompt), weight)[0])
            stats = spec_adapt.last_stats()
            assert stats.drafted > 0 and stats.lossy == f"assistant_ensemble_weight={weight}"
            assert stats.summary()["lossy"] == stats.lossy
        for b in range(3):          # batch 1: stock's own ensemble tokens (nothing masked in stock's assistant)
            assert ours[b].tolist() == (unmasked if b in masked else stock)[b].tolist(), b
        out = ensemble_call(target, draft, ids, mask, weight)
        for b in range(3):          # batch 3: each row's tokens are its own at batch 1
            assert torch.equal(out[b, pads[b]:], ours[b]), b
        assert torch.equal(ensemble_call(target, draft, ids, mask, None), plain)
        assert spec_adapt.last_stats().lossy is None
        sampled = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, pad_token_id=PAD,
                                  eos_token_id=None, max_new_tokens=8, assistant_model=draft,
                                  assistant_ensemble_weight=weight)
        assert sampled.shape == (3, ids.shape[1] + 8) and spec_adapt.last_stats().lossy is not None
        with pytest.raises(ValueError, match="prompt lookup"):
            target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, prompt_lookup_num_tokens=2,
                            assistant_ensemble_weight=weight)
        with pytest.raises(ValueError, match="assistant_ensemble_weight"):
            target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_ensemble_weight=weight,
                            assistant_model=PromptLookupDrafter(2, 1))
    finally:
        spec_adapt.disable(target)
