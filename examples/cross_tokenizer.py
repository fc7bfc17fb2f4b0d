"""A draft with another tokenizer: SmolLM2-135M-Instruct (49,152 tokens) drafts for Qwen2.5-Coder-1.5B-Instruct
(151,665 tokens), on a batch of two chat prompts; then as the first level of a chain whose middle level is
Qwen2.5-Coder-0.5B-Instruct. Each output is checked against stock greedy generate.

    python examples/cross_tokenizer.py
"""

import torch

import spec_adapt
from spec_adapt import ChainDrafter, FixedLength
from spec_adapt.drafters import CrossTokenizerDrafter
from spec_adapt.tools.models import load_model

target, target_tok = load_model("qwen2.5-coder-1.5b")
draft, _ = load_model("qwen2.5-coder-0.5b")
small, small_tok = load_model("smollm2-135m")

messages = ["Write a Python function that reverses a string.", "What is a binary search?"]
texts = [target_tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
         for m in messages]
batch = target_tok(texts, return_tensors="pt", padding=True)
plain = target.generate(**batch, max_new_tokens=32, do_sample=False)

spec_adapt.enable(target)        # stock's Universal Assisted Generation arguments, at batch size 2
out = target.generate(**batch, max_new_tokens=32, do_sample=False, assistant_model=small, tokenizer=target_tok,
                      assistant_tokenizer=small_tok)
print("SmolLM2 -> 1.5B, identical to plain generate:", torch.equal(out, plain))
print(spec_adapt.last_stats().summary())

chain = ChainDrafter([CrossTokenizerDrafter(small, small_tok, target_tok), draft])
out = target.generate(**batch, max_new_tokens=32, do_sample=False, drafter=chain, assistant_policy=FixedLength(4))
print("SmolLM2 -> 0.5B -> 1.5B, identical to plain generate:", torch.equal(out, plain))
print(spec_adapt.last_stats().summary())
