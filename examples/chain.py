"""A 3-level chain: prompt lookup drafts, an intermediate model verifies, the target has the last word.
The ChainScheduler picks, every step, which levels run and how many tokens to draft.

    python examples/chain.py
"""

import torch

import spec_adapt
from spec_adapt import ChainDrafter, ChainScheduler, PromptLookupDrafter
from spec_adapt.tools.models import load_model
from spec_adapt.tools.models import is_distilled, load_distilled_draft
from spec_adapt.tools.synthetic import truncated_copy

model, tok = load_model()
# The draft distill_draft writes (docs/drafters.md), if you made one, else a stand-in: the first 8 layers.
DRAFT = "results/draft"
middle = load_distilled_draft(model, DRAFT) if is_distilled(DRAFT) else truncated_copy(model, 8)
chain = ChainDrafter([PromptLookupDrafter(3, 2), middle])
scheduler = ChainScheduler(chain)

prompt = 'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n'
batch = tok([prompt, "def fizzbuzz(n):\n"], return_tensors="pt", padding=True)
plain = model.generate(**batch, max_new_tokens=48, do_sample=False)
out = model.generate(**batch, max_new_tokens=48, do_sample=False, custom_generate=spec_adapt.generate,
                     drafter=chain, assistant_policy=scheduler)
print("identical to plain generate:", torch.equal(plain, out))
print("chains chosen (batch size, levels used [0 = lookup, 1 = middle model], W):", scheduler.history[:10])
print(spec_adapt.last_stats().summary())
