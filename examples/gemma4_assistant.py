"""A Gemma 4 assistant, batched: the assistant attends to the target's own keys and values and reads its last hidden
state, so it keeps no cache. Runs on a tiny random Gemma 4 target and assistant (a real pair is
google/gemma-4-E2B-it with google/gemma-4-E2B-it-assistant); output stays token-identical to stock greedy
`generate`, row by row.

    python examples/gemma4_assistant.py
"""

import torch
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM,
                          Gemma4TextConfig)

import spec_adapt
from spec_adapt import FixedLength, SharedKVDrafter


def tiny_pair():
    """A 4-layer Gemma 4 (sliding and full layers, window 4, the last two sharing their keys) and a 2-layer
    assistant that reads its shared keys."""
    common = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
                  sliding_window=4, max_position_embeddings=256, vocab_size=96, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    target = Gemma4ForCausalLM(Gemma4TextConfig(
        hidden_size=32, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, **common)).eval()
    small = Gemma4TextConfig(hidden_size=16, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                             num_kv_shared_layers=2, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                             **common)
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=small, backbone_hidden_size=32)).eval()
    assistant.generation_config.num_assistant_tokens = 3       # what stock drafts a step (checkpoints ship it)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)        # clear-cut greedy choices, like a trained model's
    return target, assistant


target, assistant = tiny_pair()
ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 0, 9, 12, 3]])
mask = (ids != 0).long()

# Stock runs a Gemma 4 assistant at batch size 1 only; after enable, assistant_model= runs it batched.
stock = [target.generate(ids[b:b + 1, int((mask[b] == 0).sum()):], max_new_tokens=16, do_sample=False,
                         pad_token_id=0)[0] for b in range(len(ids))]
spec_adapt.enable(target)
out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                      assistant_model=assistant)
stats = spec_adapt.last_stats()
spec_adapt.disable(target)
same = all(out[b, int((mask[b] == 0).sum()):].tolist() == stock[b].tolist() for b in range(len(ids)))
print("identical to stock greedy, row by row:", same)
print(f"assistant_model= (Adaptive): {stats.drafted} drafted, {stats.accepted} accepted (random weights agree rarely)")

# The drafter itself, under any policy.
out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                      custom_generate=spec_adapt.generate, drafter=SharedKVDrafter(assistant),
                      assistant_policy=FixedLength(3))
stats = spec_adapt.last_stats()
print(f"SharedKVDrafter, FixedLength(3): {stats.drafted} drafted, {stats.accepted} accepted")
