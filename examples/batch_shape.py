"""Spare rows: when rows finish, Adaptive keeps them in the target's batch where this machine runs the bigger batch
faster (on a 2-core CPU SmolLM2 ran one token at batch 3 in 1.6x the time of batch 4). The first call measures the
smaller shapes; the next keeps the finished rows as spares. The output is stock generate's either way.

    python examples/batch_shape.py
"""

import time
from collections import Counter

import torch

import spec_adapt
from spec_adapt import Adaptive, PromptLookupDrafter
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

model, tok = load_model("smollm2-135m")
texts = list(workloads.with_inputs(workloads.load("sharegpt", 8), tok)["input_text"])[4:8]
batch = tok(texts, return_tensors="pt", padding=True)
settings = dict(max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)

start = time.perf_counter()
plain = model.generate(**batch, **settings)
print(f"stock generate: {time.perf_counter() - start:.2f} s")

policy = Adaptive()
for call in range(3):
    stats = spec_adapt.SpecStats()
    start = time.perf_counter()
    out = model.generate(**batch, **settings, custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(3, 2),
                         assistant_policy=policy, spec_stats=stats)
    seconds = time.perf_counter() - start
    shapes = Counter((r.batch_size, r.held) for r in stats.trace)
    print(f"call {call}: {seconds:.2f} s, identical: {torch.equal(out, plain)}, steps per (live rows, rows run): "
          f"{dict(sorted(shapes.items(), reverse=True))}")
