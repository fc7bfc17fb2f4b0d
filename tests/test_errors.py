"""Bad input gets a clear error naming the fix; a failing draft falls back without losing tokens."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import spec_adapt
from spec_adapt import Drafter, FixedLength, Policy
from spec_adapt.policies import Heuristic

from conftest import BOS, EOS, PAD, Oracle, ragged_batch, stock_greedy, tiny_model


def spec(model, ids, mask, drafter=None, policy=None, **kw):
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("do_sample", False)
    return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=PAD,
                          eos_token_id=None, custom_generate=spec_adapt.generate, drafter=drafter,
                          assistant_policy=policy or FixedLength(2), **kw)


def test_right_padding_is_rejected(llama):
    ids, mask = ragged_batch(3)
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        spec(llama, ids.flip(1), mask.flip(1), llama)


@pytest.mark.parametrize("kw, match", [
    (dict(num_return_sequences=2, do_sample=True), "repeat_interleave"),
    (dict(num_beams=2), "beam search"),
    (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
])
def test_unsupported_generation_modes(llama, kw, match):
    ids, mask = ragged_batch(2)
    with pytest.raises(ValueError, match=match):
        spec(llama, ids, mask, llama, **kw)


def test_static_cache_is_rejected(llama):
    ids, mask = ragged_batch(2)
    with pytest.raises(ValueError, match="DynamicCache"):
        spec(llama, ids, mask, llama, cache_implementation="static")


def test_sliding_windows_need_an_attention_that_takes_4d_masks():
    """Windows are enforced by 4-D masks: an attention implementation that takes none is refused by name."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                      max_window_layers=0, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    model = Qwen2ForCausalLM(cfg).eval()
    model.config._attn_implementation = "flash_attention_2"
    ids, mask = ragged_batch(2)
    with pytest.raises(ValueError, match="sliding-window layers.*attn_implementation='sdpa'"):
        spec(model, ids, mask, None)


def test_draft_with_smaller_vocabulary_is_rejected(llama):
    draft = tiny_model("llama", vocab=64)
    ids, mask = ragged_batch(2)
    with pytest.raises(ValueError, match="do not share a tokenizer"):
        spec(llama, ids, mask, draft)


def test_draft_with_other_special_tokens_is_rejected(llama):
    draft = tiny_model("llama")
    draft.config.eos_token_id = 7
    ids, mask = ragged_batch(2)
    with pytest.raises(ValueError, match="eos_token_id"):
        spec(llama, ids, mask, draft)


def test_unknown_drafter_type(llama):
    ids, mask = ragged_batch(2)
    with pytest.raises(TypeError, match="Drafter"):
        spec(llama, ids, mask, drafter="prompt lookup")


class Returns(Policy):
    def __init__(self, value):
        self.value = value

    def choose(self, info):
        return self.value


@pytest.mark.parametrize("value", [-1, 2.5, [1, 2], [1, -1, 1], "3", True, torch.tensor([1.0, 2.0, 3.0])])
def test_invalid_policy_output(llama, value):
    ids, mask = ragged_batch(3)
    with pytest.raises(ValueError, match="Returns.choose returned"):
        spec(llama, ids, mask, llama, Returns(value))


@pytest.mark.parametrize("make", [lambda: FixedLength(-1), lambda: FixedLength(1.5), lambda: Heuristic(initial=-2)])
def test_invalid_policy_parameters(make):
    with pytest.raises(ValueError, match="must be an int"):
        make()


class Explodes(Drafter):
    """Proposes right tokens for a few steps, then raises (an out-of-memory error by default)."""

    def __init__(self, oracle, after, where="propose", exc=None):
        self.oracle, self.after, self.where, self.calls = oracle, after, where, 0
        self.exc = exc or torch.OutOfMemoryError("CUDA out of memory (simulated)")
        self.inner = oracle.drafter()

    def begin(self, input_ids, attention_mask):
        if self.where == "begin":
            raise self.exc
        self.inner.begin(input_ids, attention_mask)

    def propose(self, request):
        self.calls += 1
        if self.calls > self.after:
            raise self.exc
        return self.inner.propose(request)


@pytest.mark.parametrize("where, after", [("propose", 3), ("propose", 0), ("begin", 0)])
def test_draft_failure_falls_back_without_losing_tokens(llama, where, after):
    ids, mask = ragged_batch(5, seed=2)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None, max_new_tokens=16)
    drafter = Explodes(Oracle(reference, mask, ["right"], eos=()), after, where)
    stats = spec_adapt.SpecStats()
    with pytest.warns(RuntimeWarning, match="continued without speculation"):
        out = spec(llama, ids, mask, drafter, FixedLength(3), spec_stats=stats)
    assert torch.equal(out, reference)
    assert "OutOfMemoryError" in stats.fallback
    # Before the failure: `after` steps of 5 rows x 3 drafts, all right; after it: plain decoding.
    assert stats.accepted == stats.drafted == (after * 5 * 3 if where == "propose" else 0)


def test_no_fallback_warning_when_all_is_well(llama):
    ids, mask = ragged_batch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        spec(llama, ids, mask, llama)
    assert spec_adapt.last_stats().fallback is None
