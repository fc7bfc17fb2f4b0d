"""Top-K early exit inside verification (FASER): drafts predicted rejected at a middle layer leave the target's
forward early; output stays token-identical to stock `generate`.

    python examples/early_exit.py
"""

import torch

import spec_adapt
from spec_adapt import EarlyExitVerifier, FixedLength, PromptLookupDrafter
from spec_adapt.tools.models import load_model

model, tok = load_model("smollm2-135m")
prompts = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
           "def fibonacci_iter(n):\n", "Write a haiku about the sea."]
batch = tok(prompts, return_tensors="pt", padding=True)

# Checkpoint after layer 15 of 30, K = 10; gate="auto" times both paths per (batch, width) and keeps the faster.
verifier = EarlyExitVerifier(layers=[15], top_k=10, gate="always")   # "always": show pruning even where it is slower
out = model.generate(**batch, max_new_tokens=48, do_sample=False, custom_generate=spec_adapt.generate,
                     drafter=PromptLookupDrafter(3, 1), assistant_policy=FixedLength(6), verifier=verifier)
stock = model.generate(**batch, max_new_tokens=48, do_sample=False)
print("identical to stock generate:", torch.equal(out, stock))
print("verifier:", spec_adapt.last_stats().verifier)   # positions tested, pruned, layers saved, per checkpoint
