"""Hand what a policy learned here to vLLM, the engine to serve many users with.

A learned `Adaptive` becomes vLLM's `speculative_config`, with its per-batch-size table
(`num_speculative_tokens_per_batch_size`); `method: custom_class` serves spec_adapt's suffix index (or prompt
lookup) as vLLM's proposer. Written to vllm_speculative_config.json:

    python examples/vllm.py
    vllm serve <target> --speculative-config "$(cat vllm_speculative_config.json)"
"""

import json

import spec_adapt
from spec_adapt import Adaptive, PromptLookupDrafter
from spec_adapt.tools.models import load_model
from spec_adapt.tools.vllm import speculative_config

model, tok = load_model()
policy = Adaptive()
prompts = ["def is_even(n):\n    return n % 2 == 0\n\ndef is_odd(n):\n", "Repeat after me: the cat sat on the mat."]
for batch in ([prompts[0]], prompts):
    inputs = tok(batch, return_tensors="pt", padding=True)
    model.generate(**inputs, max_new_tokens=32, do_sample=False, custom_generate=spec_adapt.generate,
                   drafter=PromptLookupDrafter(), assistant_policy=policy)

config = speculative_config(policy, "custom_class", model="spec_adapt.tools.vllm.SuffixProposer", max_batch=64)
print(json.dumps(config))
with open("vllm_speculative_config.json", "w") as f:
    json.dump(config, f)
