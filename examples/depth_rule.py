"""Depth decided inside the step: `Adaptive(stop_rule=True)` lets the 0.5B draft each row until one more token stops
paying (its calibrated confidence against the step's marginal time), where the default `Adaptive()` drafts a width
chosen before drafting. Prints, per step, how many tokens each policy drafted and how many were accepted.

    make setup && python examples/depth_rule.py
"""

import torch

import spec_adapt
from spec_adapt import Adaptive
from spec_adapt.execution import fastest
from spec_adapt.tools.models import load_model

target, tok = load_model("qwen2.5-coder-1.5b")              # float32, prepared: as the benchmark table runs it
spec_adapt.prepare(target)
draft = fastest(load_model("qwen2.5-coder-0.5b")[0])[0]    # prepared; bf16 where this CPU computes it natively
message = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
inputs = tok([tok.apply_chat_template(message, add_generation_prompt=True, tokenize=False)], return_tensors="pt")
stock = target.generate(**inputs, max_new_tokens=48, do_sample=False)

for name, policy in (("stop_rule=True (depth)", Adaptive(stop_rule=True)), ("default (width)", Adaptive())):
    for call in ("first call", "second call"):       # the second starts from what the first learned
        out = target.generate(**inputs, max_new_tokens=48, do_sample=False, custom_generate=spec_adapt.generate,
                              drafter=draft, assistant_policy=policy)
        trace = spec_adapt.last_stats().trace
        steps = " ".join(f"{r.accepted[0]}/{r.drafted[0]}" for r in trace)
        print(f"{name}, {call}: {len(trace)} steps, accepted/drafted per step: {steps}")
        print("  identical to stock generate:", torch.equal(out, stock))
