"""Prepare a model for this CPU (packed linear weights), speculate on it, and check the output against stock
`generate` on the same prepared model. `spec_adapt.unprepare` restores the model."""

import time

import torch

import spec_adapt
from spec_adapt import PromptLookupDrafter
from spec_adapt.execution import eager, prepared
from spec_adapt.tools.models import load_model

model, tok = load_model()                            # SmolLM2-135M-Instruct, float32
batch = tok(["def is_prime(n):\n", "def binary_search(xs, x):\n"], return_tensors="pt", padding=True)
common = dict(max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)

spec_adapt.prepare(model)
print(prepared(model)["detail"])


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


with eager(model):                                   # the model as it was, for comparison
    _, before = timed(lambda: model.generate(**batch, **common))
stock, plain = timed(lambda: model.generate(**batch, **common))
ours, fast = timed(lambda: model.generate(**batch, **common, custom_generate=spec_adapt.generate,
                                          drafter=PromptLookupDrafter()))
print(f"stock generate: eager {before:.2f} s, prepared {plain:.2f} s; spec_adapt prepared {fast:.2f} s")
print("identical to stock generate on the prepared model:", torch.equal(stock, ours))
spec_adapt.unprepare(model)
