"""A quantized draft: the 0.5B Qwen2.5-Coder draft loaded in 4-bit NormalFloat (bitsandbytes, on the CPU too)
drafting for the 1.5B target. The target verifies every token, so the output is still exactly the target's.

    python examples/quantized_draft.py
"""

import torch

import spec_adapt
from spec_adapt import Adaptive, ModelDrafter
from spec_adapt.tools.models import load_draft, load_model

# float32: token-identical to stock generate (in bf16 both paths can break a 1-ulp logit tie differently, README).
target, tok = load_model("qwen2.5-coder-1.5b", dtype=torch.float32)
draft = load_draft(target, "qwen2.5-coder-0.5b", quantization="nf4")     # or "int8"; or any model you quantized
print(f"draft weights: {draft.get_memory_footprint() / 2**20:.0f} MB (unquantized fp32: about 2400 MB)")

batch = tok(["def fibonacci(n):", "def is_prime(n):"], return_tensors="pt", padding=True)
stats = spec_adapt.SpecStats()
out = target.generate(**batch, max_new_tokens=32, do_sample=False, custom_generate=spec_adapt.generate,
                      drafter=ModelDrafter(draft), assistant_policy=Adaptive(), spec_stats=stats)
stock = target.generate(**batch, max_new_tokens=32, do_sample=False)
print("identical to stock generate:", torch.equal(out, stock))
print(f"acceptance {stats.accepted}/{stats.drafted}")
