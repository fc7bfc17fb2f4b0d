"""Token trees: several continuations per row, verified in one target forward.

A draft model grows a dynamic tree (the likeliest paths, EAGLE-2 style), prompt lookup turns every continuation it
finds into a branch; `FixedTree` fixes the shape, `Adaptive(trees=True)` learns per batch size whether a tree or
the chain pays. Output stays identical to plain `generate`.

    python examples/trees.py
"""

import torch

import spec_adapt
from spec_adapt import Adaptive, FixedTree, ModelDrafter, PromptLookupDrafter
from spec_adapt.tools.models import load_model
from spec_adapt.tools.synthetic import truncated_copy

model, tok = load_model()
draft = truncated_copy(model, 24)          # a stand-in draft: the target's first 24 of 30 layers

prompts = ['def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
           "def fizzbuzz(n):\n"]
batch = tok(prompts, return_tensors="pt", padding=True)
plain = model.generate(**batch, max_new_tokens=48, do_sample=False)

for name, drafter, policy in [
    ("draft model, chain of 4", ModelDrafter(draft), spec_adapt.FixedLength(4)),
    ("draft model, tree of 12 nodes, depth 4", ModelDrafter(draft, branch=3), FixedTree(12, 4)),
    ("draft model, one budget of 12 x rows", ModelDrafter(draft, branch=3), FixedTree(12, 4, pooled=True)),
    ("prompt lookup, tree of 8 nodes, depth 4", PromptLookupDrafter(), FixedTree(8, 4)),
    ("draft model, Adaptive(trees=True)", ModelDrafter(draft), Adaptive(trees=True)),
]:
    out = model.generate(**batch, max_new_tokens=48, do_sample=False, custom_generate=spec_adapt.generate,
                         drafter=drafter, assistant_policy=policy)
    stats = spec_adapt.last_stats()
    print(f"{name}: identical={torch.equal(plain, out)}, target forwards={stats.steps}, "
          f"drafts accepted={stats.accepted} of {stats.drafted} drafted")
