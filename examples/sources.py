"""Several drafting sources in one step: the Qwen2.5-Coder pair on a code-editing request, where the answer restates
most of the prompt's function (prompt lookup drafts it for free) and changes parts of it (the draft model drafts
those). The default for a draft model chooses per row and step; the draft model alone and stock assisted generation
run beside it, every output checked against stock generate.

    python examples/sources.py            # the pair loads from its PyPI packages (make setup)
"""

import time

import torch

import spec_adapt
from spec_adapt import Adaptive, ModelDrafter
from spec_adapt.execution import fastest
from spec_adapt.recipes import workloads
from spec_adapt.tools.models import load_model

target, tok = load_model("qwen2.5-coder-1.5b")
draft, _ = load_model("qwen2.5-coder-0.5b")
spec_adapt.prepare(target)
draft = fastest(draft)[0]          # the draft in its fastest dtype here: it never changes the output
row = workloads.with_inputs(workloads.edit(limit=1), tok)[0]
inputs = tok([row["input_text"]], return_tensors="pt")
common = dict(max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)


def timed(**kwargs):
    start = time.perf_counter()
    out = target.generate(**inputs, **common, **kwargs)
    return out, time.perf_counter() - start


plain, plain_s = timed()
print(f"stock generate: {plain_s:.1f} s")
_, assisted_s = timed(assistant_model=draft)
print(f"stock assisted generation: {plain_s / assisted_s:.2f}x")
for name, drafter in (("draft model alone", lambda: ModelDrafter(draft)), ("several sources (default)", lambda: draft)):
    policy = Adaptive()
    for call in range(2):          # the second call starts from what the first learned
        out, seconds = timed(custom_generate=spec_adapt.generate, drafter=drafter(), assistant_policy=policy)
    stats = spec_adapt.last_stats()
    print(f"{name}: {plain_s / seconds:.2f}x, identical: {torch.equal(out, plain)}, per source: {stats.per_source}")
print(tok.decode(plain[0, inputs["input_ids"].shape[1]:]))
