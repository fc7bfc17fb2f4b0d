"""Serving under live load: requests join and leave a running speculative batch.

    python examples/serve.py
"""

import time

from spec_adapt import Adaptive, PromptLookupDrafter
from spec_adapt.tools.models import load_model
from spec_adapt.serving.engine import Engine

model, tok = load_model("smollm2-135m")
# step_timeout: a step whose drafter calls take over 2 s goes on without the drafter instead of holding every request
engine = Engine(model, drafter=PromptLookupDrafter(3, 1), assistant_policy=Adaptive(), max_batch=4, max_new_tokens=32,
                tokenizer=tok, timeline=True, step_timeout=2.0).start()   # a background thread runs the steps
try:
    first = engine.submit("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    time.sleep(0.5)                                           # the others arrive while the first is generating
    later = [engine.submit(text) for text in ("The capital of France is", "List three prime numbers:")]
    for token in first.stream():                              # tokens as they are committed
        print(tok.decode([token]), end="", flush=True)
    print()
    for handle in later:
        print(repr(tok.decode(handle.result(timeout=120))))
    bad = engine.submit([], max_new_tokens=8)                 # refused on its own handle, nobody else disturbed
    print("bad request:", bad.state, bad.error)
finally:
    engine.stop()
print("batch sizes over the steps:", [r["batch_size"] for r in engine.timeline])
