"""A draft model whose head scores only the tokens it is likely to need (FR-Spec's idea; spec_adapt.drafters.head).

    make setup && python examples/short_head.py

The Qwen2.5-Coder 0.5B draft spends about a fifth of each batch-1 step projecting onto its 151,936-token vocabulary.
`ModelDrafter(draft, head_tokens=32768)` scores the 32,768 lowest ids (byte-level BPE numbers frequent merges
first), the special tokens, the prompt's tokens and every token committed in earlier calls. The target verifies with
its full head, so the output is still exactly stock `generate`'s; only the draft step gets cheaper.

One call is one sample, and the trade can go either way per prompt: answer words outside the set lower acceptance,
while every draft step gets cheaper. `python benchmarks/draft_head.py` measures both over many prompts.
"""

import time

import torch

import spec_adapt
from spec_adapt import FixedLength, ModelDrafter
from spec_adapt.tools.models import load_model

target, tok = load_model("qwen2.5-coder-1.5b", dtype=torch.bfloat16)
draft, _ = load_model("qwen2.5-coder-0.5b", dtype=torch.bfloat16)
message = [{"role": "user", "content": "def is_palindrome(s: str) -> bool:\n    \"\"\"True if s reads the same "
                                       "backwards, ignoring case.\"\"\"\n"}]
batch = tok([tok.apply_chat_template(message, add_generation_prompt=True, tokenize=False)], return_tensors="pt")
stock = target.generate(**batch, max_new_tokens=32, do_sample=False)

for name, drafter in [("whole head", ModelDrafter(draft)), ("short head", ModelDrafter(draft, head_tokens=32768))]:
    start = time.perf_counter()
    out = target.generate(**batch, max_new_tokens=32, do_sample=False, custom_generate=spec_adapt.generate,
                          drafter=drafter, assistant_policy=FixedLength(3))
    seconds, stats = time.perf_counter() - start, spec_adapt.last_stats()
    print(f"{name}: {seconds:.2f} s, acceptance {stats.acceptance_rate:.2f}, identical to stock generate: "
          f"{torch.equal(out, stock)}")
    if drafter.short is not None:
        print(f"  the head now scores {drafter.short.size} of {len(drafter.short.keep)} tokens")
print(tok.decode(stock[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))
