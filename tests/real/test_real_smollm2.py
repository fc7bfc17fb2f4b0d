"""Integration on the real SmolLM2-135M-Instruct (fp32), loaded once per session from the PyPI package."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import spec_adapt
from spec_adapt import FixedLength, ModelDrafter, PromptLookupDrafter
from spec_adapt.policies import Heuristic
from spec_adapt.recipes import workloads

pytestmark = pytest.mark.real


@pytest.fixture(scope="session")
def batch4(smollm2):
    _, tok = smollm2
    prompts = list(workloads.with_inputs(workloads.sharegpt(limit=2), tok)["input_text"])
    prompts += list(workloads.humaneval(limit=2)["prompt"])
    return tok(prompts, return_tensors="pt", padding=True)


@pytest.fixture(scope="session")
def reference(smollm2, batch4):
    model, _ = smollm2
    return model.generate(**batch4, max_new_tokens=64, do_sample=False)


def generate(model, batch, drafter, policy):
    stats = spec_adapt.SpecStats()
    out = model.generate(**batch, max_new_tokens=64, do_sample=False, custom_generate=spec_adapt.generate,
                         drafter=drafter, assistant_policy=policy, spec_stats=stats)
    return out, stats


def test_draft_is_the_target_itself(smollm2, batch4, reference):
    model, _ = smollm2
    out, stats = generate(model, batch4, ModelDrafter(model), FixedLength(3))     # the draft model alone
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0 and stats.accepted == stats.drafted


def test_random_tiny_draft_sharing_the_tokenizer(smollm2, batch4, reference):
    model, _ = smollm2
    cfg = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id)
    torch.manual_seed(0)
    draft = LlamaForCausalLM(cfg).eval()
    out, stats = generate(model, batch4, ModelDrafter(draft), FixedLength(2))     # the draft model alone
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0 and stats.acceptance_rate < 0.2


def test_prompt_lookup_on_real_prompts(smollm2, batch4, reference):
    model, _ = smollm2
    out, stats = generate(model, batch4, PromptLookupDrafter(), Heuristic(initial=4))
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0
