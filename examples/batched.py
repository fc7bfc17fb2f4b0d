"""Batched speculative decoding with `enable`: `assistant_model` + `assistant_policy` on a left-padded batch.

    python examples/batched.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import spec_adapt
from spec_adapt import FixedLength
from spec_adapt.tools.models import load_model

model, tok = load_model()
# Any causal LM with the target's tokenizer can draft; here a random 1-layer one just to show the plumbing
# (it accepts little; the output is the target's all the same).
cfg = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
draft = LlamaForCausalLM(cfg).eval()

chats = [[{"role": "user", "content": q}] for q in ("What is 2 + 2?", "Name three colours.", "Say hello in French.")]
texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
batch = tok(texts, return_tensors="pt", padding=True)        # load_model sets padding_side="left"

plain = model.generate(**batch, max_new_tokens=32, do_sample=False)
spec_adapt.enable(model)
out = model.generate(**batch, max_new_tokens=32, do_sample=False, assistant_model=draft,
                     assistant_policy=FixedLength(2), return_dict_in_generate=True)
spec_adapt.disable(model)

for row in tok.batch_decode(out.sequences[:, batch["input_ids"].shape[1]:], skip_special_tokens=True):
    print("-", row.strip())
print("identical:", torch.equal(plain, out.sequences))
print("acceptance rate:", round(out.spec_stats.acceptance_rate, 3), "steps:", out.spec_stats.steps)
