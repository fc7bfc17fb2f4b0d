"""Draft offload under memory pressure: the 0.5B draft's weights leave for disk while speculation is off and memory is
short, and come back when it is free; output stays token-identical to stock generate.

    python examples/offload.py
"""

import torch

import spec_adapt
from spec_adapt import Adaptive, ModelDrafter
from spec_adapt.drafters.offload import DraftOffload
from spec_adapt.tools.models import load_model

target, tok = load_model("qwen2.5-coder-1.5b")
draft, _ = load_model("qwen2.5-coder-0.5b")
batch = tok(["def is_palindrome(s):", "The three laws of motion are"], return_tensors="pt", padding=True)

# A budget the caller sets (here: memory is short for the first 12 steps). The draft leaves only when the policy has
# also turned speculation off for `persist` steps; manual offload() / reload() work too. Without free_memory= the
# default reads free device memory on a GPU, available RAM on a CPU.
offload = DraftOffload(ModelDrafter(draft), low=1 << 30, persist=2,
                       free_memory=lambda: 0 if offload._steps < 12 else 1 << 40)
out = target.generate(**batch, max_new_tokens=32, do_sample=False, custom_generate=spec_adapt.generate,
                      drafter=offload, assistant_policy=Adaptive())
stock = target.generate(**batch, max_new_tokens=32, do_sample=False)
print("identical to stock generate:", torch.equal(out, stock))
print("events:", offload.events)     # offload / reload with step numbers and seconds (empty if it never had to)
offload.offload()                    # by hand: weights to disk (accelerate's offload files), draft KV dropped
print("offloaded:", offload.offloaded, "draft parameters now hold", sum(p.numel() for p in draft.parameters()))
offload.reload()
