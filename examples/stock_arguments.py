"""Keep stock transformers code, get batched speculation: after `spec_adapt.enable(model)`, stock's own arguments
(`prompt_lookup_num_tokens`, `assistant_early_exit`, `assistant_model`, `num_assistant_tokens`) run through
spec_adapt at any batch size, where stock refuses a batch. Each output is checked against plain greedy `generate`.

    python examples/stock_arguments.py
"""

import torch

import spec_adapt
from spec_adapt.tools.models import load_model

model, tok = load_model("smollm2-135m")
tok.padding_side = "left"
prompts = ['def count_words(text: str) -> dict:\n    """Count how often each word occurs in text."""\n',
           "Write a haiku about the sea."]
batch = tok(prompts, return_tensors="pt", padding=True)
plain = model.generate(**batch, max_new_tokens=48, do_sample=False)

spec_adapt.enable(model)
for stock_arguments in ({"prompt_lookup_num_tokens": 5}, {"assistant_early_exit": 24, "num_assistant_tokens": 4}):
    out = model.generate(**batch, max_new_tokens=48, do_sample=False, **stock_arguments)
    stats = spec_adapt.last_stats().summary()
    print(f"{stock_arguments}: identical to plain generate: {torch.equal(out, plain)}; "
          f"{stats['accepted']} of {stats['drafted']} drafts accepted in {stats['steps']} steps")
spec_adapt.disable(model)
