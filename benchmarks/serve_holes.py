"""Does compacting the target's KV holes sooner speed up serving at overload? Serves one 10-second Poisson schedule
(3 requests/s, SmolLM2, ShareGPT, max batch 8) with target-only and lookup:adaptive, twice each, with the ledger's
compaction threshold (share of holes) and minimum set on the command line.

    python benchmarks/serve_holes.py 0.5 64     # the default ledger settings
    python benchmarks/serve_holes.py 0.15 8     # compact early
"""

import sys

import torch

import spec_adapt.ledger as ledger
from spec_adapt.tools import serve_bench as sb
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

threshold, minimum = float(sys.argv[1]), int(sys.argv[2])
original = ledger.KVLedger.__init__


def patched(self, model, cache=None, compact_threshold=0.5, compact_min=64, kernels="auto"):
    original(self, model, cache, threshold, minimum, kernels)


ledger.KVLedger.__init__ = patched
torch.set_grad_enabled(False)
model, tok = load_model("smollm2-135m")
ds = workloads.with_inputs(workloads.load("sharegpt", 64), tok)
prompts = [tok(p, return_tensors="pt").input_ids[0] for p in ds["input_text"]]
arrivals = sb.schedule(3.0, 10, len(prompts), 0)
for config in ["target", "lookup:adaptive", "target", "lookup:adaptive"]:
    engine = sb.build_engine(config, model, tok, None, 8, 64)
    out = sb.serve(engine, prompts, arrivals)
    print(threshold, minimum, config, round(out["tok_s"], 1), "tok/s")
