"""The draft in the dtype this CPU computes natively (bf16 where native), beside a float32 target. The target verifies
every drafted token, so the draft's precision changes what it proposes, never the output: the result is
token-identical to stock greedy `generate` on the same (prepared, float32) target.

    python examples/draft_dtype.py
"""

import torch

import spec_adapt
from spec_adapt.execution import fastest
from spec_adapt.tools.models import load_model

target, tok = load_model("qwen2.5-coder-1.5b")              # float32: where greedy identity is exact
spec_adapt.prepare(target)
draft, dtype, why = fastest(load_model("qwen2.5-coder-0.5b")[0])   # prepared; bf16 where this CPU computes it natively
print(f"draft dtype: {dtype} ({why})")

messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
batch = tok([tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)], return_tensors="pt")
out = target.generate(**batch, max_new_tokens=48, do_sample=False, custom_generate=spec_adapt.generate, drafter=draft)
stock = target.generate(**batch, max_new_tokens=48, do_sample=False)
print(tok.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))
print("identical to stock generate:", torch.equal(out, stock))
print({k: spec_adapt.last_stats().summary()[k] for k in ("steps", "acceptance_length")})
