"""spec_adapt as a transformers generation method through the `custom_generate/` folder of a clone (how Hub
repositories publish generation methods): `custom_generate=<path>` with `trust_remote_code=True`.

    python examples/custom_generate_folder.py
"""

from pathlib import Path

import torch

from spec_adapt import PromptLookupDrafter
from spec_adapt.tools.models import load_model

CLONE = str(Path(__file__).resolve().parents[1])     # the folder holding custom_generate/generate.py

model, tok = load_model()
inputs = tok(["def fizzbuzz(n):\n", "Name three colours:"], return_tensors="pt", padding=True)
plain = model.generate(**inputs, max_new_tokens=32, do_sample=False)
fast = model.generate(**inputs, max_new_tokens=32, do_sample=False, custom_generate=CLONE, trust_remote_code=True,
                      assistant_model=PromptLookupDrafter())
print("identical to plain generate:", torch.equal(plain, fast))
