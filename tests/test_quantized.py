"""Quantized drafts (bitsandbytes int8 / nf4, loaded through transformers' BitsAndBytesConfig): lossless through the
loop, refused where they cannot work, and a clear error when bitsandbytes is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from spec_adapt import Adaptive, FixedLength, ModelDrafter
from spec_adapt.drafters.offload import DraftOffload
from spec_adapt.tools.models import bnb_config, is_quantized, load_model

from conftest import PAD, VOCAB, ragged_batch, spec_generate, stock_greedy
from test_sampling import VOCAB_SMALL, assert_follows_target


def small_llama(seed: int, vocab: int = VOCAB, head_scale: float = 8.0):
    """bitsandbytes' CPU 4-bit kernels need wider layers than the 32-wide fixtures (hidden 128 works)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, vocab_size=vocab, bos_token_id=1,
                      eos_token_id=2, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model.eval()


def quantized_copy(model, quantization, folder):
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu",
                                                quantization_config=bnb_config(quantization, torch.float32)).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The target in float32 and its own weights quantized two ways: a draft that mostly agrees with it."""
    target = small_llama(0)
    drafts = {q: quantized_copy(target, q, tmp_path_factory.mktemp(q)) for q in ("int8", "nf4")}
    return target, drafts


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("batch", [1, 3])
def test_quantized_draft_is_lossless(pair, quantization, policy, batch):
    target, drafts = pair
    draft = drafts[quantization]
    assert is_quantized(draft)
    ids, mask = ragged_batch(batch, seed=batch)
    reference = stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=24)
    out, stats = spec_generate(target, ids, mask, ModelDrafter(draft),
                               FixedLength(3) if policy == "fixed" else Adaptive())
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0
    if policy == "fixed":       # its own weights, quantized: many drafts survive (an unrelated draft: ~1 in 96)
        assert stats.accepted / stats.drafted > 0.3, (stats.accepted, stats.drafted)


def test_quantized_draft_sampling_follows_target_distribution(tmp_path):
    target = small_llama(5, vocab=VOCAB_SMALL, head_scale=0.3)
    draft = quantized_copy(small_llama(6, vocab=VOCAB_SMALL, head_scale=0.3), "nf4", tmp_path)
    assert_follows_target(target, ModelDrafter(draft), 4000)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="int8.*nf4"):
        bnb_config("int4", torch.float32)


def test_missing_bitsandbytes_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ImportError, match="pip install 'bitsandbytes"):
        load_model("does-not-matter", quantization="nf4")


def test_offload_refuses_a_quantized_draft(pair):
    _, drafts = pair
    with pytest.raises(ValueError, match="quantized"):
        DraftOffload(drafts["nf4"])


def test_plain_models_are_not_quantized(pair):
    target, _ = pair
    assert not is_quantized(target)
