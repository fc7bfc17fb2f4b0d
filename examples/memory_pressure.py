"""Serving under a memory budget (Nightjar's elastic memory): with the draft resident only a few requests fit;
when the policy turns speculation off and the queue waits for memory, the draft's weights leave (DraftOffload) and
the batch grows; when the load falls they come back and speculation resumes. Every request's output is exactly
what stock generate gives for it alone.

    python examples/memory_pressure.py
"""

import torch

from spec_adapt import Adaptive, ModelDrafter
from spec_adapt.drafters.offload import DraftOffload
from spec_adapt.serving.memory import MemoryBudget, kv_bytes_per_token, weight_bytes
from spec_adapt.tools.models import load_model
from spec_adapt.serving.engine import Engine

target, tok = load_model("smollm2-135m")
draft = load_model("smollm2-135m")[0]        # a stand-in draft of the same size, so this runs in seconds

# Room for the weights of both models and the KV of 2 requests of 64 tokens while the draft is resident.
per_request = 64 * (kv_bytes_per_token(target) + kv_bytes_per_token(draft))
memory = MemoryBudget(weight_bytes(target) + weight_bytes(draft) + 2 * per_request)
offload = DraftOffload(ModelDrafter(draft), low=0, persist=2)   # follows the engine's budget (free_memory unset)
engine = Engine(target, drafter=offload, assistant_policy=Adaptive(), max_batch=8, max_new_tokens=32, tokenizer=tok,
                memory=memory, timeline=True)

prompts = ["def quicksort(xs):", "Explain recursion to a child.", "def gcd(a, b):", "List three prime numbers:",
           "def flatten(nested):", "What is a hash map?"]
handles = [engine.submit(p) for p in prompts]                 # a burst: more than the budget holds with the draft
engine.run_until_idle()
late = engine.submit("def binary_search(xs, x):")             # load has fallen: the draft comes back for it
engine.run_until_idle()

for p, h in zip(prompts + ["def binary_search(xs, x):"], handles + [late]):
    ids = tok(p, return_tensors="pt").input_ids
    stock = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    assert h.result() == stock[0, ids.shape[1]:].tolist()
print("every request identical to stock generate")
print("batch sizes over time:", [s["batch_size"] for s in engine.timeline])
print("draft resident:       ", "".join("R" if s["draft_resident"] else "." for s in engine.timeline))
print("events:", [(e["event"], e["step"]) for e in offload.events])
