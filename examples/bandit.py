"""Adaptive speculative length: Nightjar's bandit learns, per batch size, which γ gives the most tokens per second,
and turns speculation off when it does not pay. A policy is an object: keep it across calls, save its state.

    python examples/bandit.py
"""

import json

import torch

import spec_adapt
from spec_adapt import SuffixDrafter
from spec_adapt.policies import Nightjar
from spec_adapt.tools.models import load_model
from spec_adapt.recipes import workloads

model, tok = load_model()
prompts = list(workloads.with_inputs(workloads.humaneval(limit=8), tok)["input_text"])
policy = Nightjar(max_gamma=8, exploration="local")      # exploration="uniform" is the paper's exact schedule
drafter = SuffixDrafter()                                 # its index learns from every prompt and output it sees

for start in range(0, len(prompts), 4):
    batch = tok(prompts[start : start + 4], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=48, do_sample=False, custom_generate=spec_adapt.generate,
                         drafter=drafter, assistant_policy=policy)
    stats = spec_adapt.last_stats()
    chosen = [max(r.gammas) for r in stats.trace]
    print(f"batch {start // 4}: {stats.tokens_per_second:.1f} tok/s, alpha {stats.acceptance_rate:.2f}, "
          f"gamma chosen per step {chosen[:12]}...")

state = policy.state_dict()                               # JSON-serializable: reuse it in another process
json.dumps(state)
fresh = Nightjar(max_gamma=8, exploration="local")
fresh.load_state_dict(state)
print("per-batch-size contexts learned:", sorted(state["contexts"]))
