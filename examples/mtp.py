"""Multi-token prediction (MTP) drafting, batched: the MTP layers a checkpoint ships beside its decoder layers draft
from the target's own hidden states. Runs on a tiny random GLM-4 MoE whose checkpoint is given two MTP layers (a
real one, e.g. zai-org/GLM-4.5 or deepseek-ai/DeepSeek-V3, has them already); output stays token-identical to stock
greedy `generate`.

    python examples/mtp.py
"""

import os
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4MoeConfig

import spec_adapt
from spec_adapt import FixedLength, MTPDrafter


# The checkpoint's folder lives as long as the model (stock's MTP loader reads it again); removed at exit.
SCRATCH = tempfile.TemporaryDirectory()


def tiny_checkpoint_with_mtp(layers: int = 2):
    """A tiny random GLM-4 MoE saved with `layers` MTP layers (the decoder block laid out as the model's last layer
    is saved, under mtp.layers.{k}.mtp_block.), loaded back as a checkpoint with MTP weights is."""
    config = Glm4MoeConfig(vocab_size=16, hidden_size=32, intermediate_size=37, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           num_mtp_layers=layers, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)      # clear-cut greedy choices, like a trained model's
    folder = tempfile.mkdtemp(dir=SCRATCH.name)
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    last = "model.layers.1."
    for k in range(layers):
        for key, value in list(weights.items()):
            if key.startswith(last):
                weights[f"mtp.layers.{k}.mtp_block.{key[len(last):]}"] = \
                    torch.randn(value.shape) * 0.05 if value.dim() > 1 else value.clone()
        for norm in ("enorm", "hnorm", "post_norm"):
            weights[f"mtp.layers.{k}.{norm}.weight"] = torch.ones(32)
        # The layer passes the embedding it reads on: its drafts follow the random model's own next-token habit.
        weights[f"mtp.layers.{k}.eh_proj.weight"] = torch.cat([torch.eye(32), torch.zeros(32, 32)], dim=1)
    save_file(weights, path, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model._keys_to_ignore_on_load_unexpected = [r"^mtp\."]    # where this checkpoint keeps its MTP layers
    return model


model = tiny_checkpoint_with_mtp()
ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 3, 4, 5, 6, 7], [0, 0, 0, 0, 9, 12, 3]])
mask = (ids != 0).long()

# Stock transformers drafts with MTP at batch size 1 only; after enable, use_mtp=True runs batched here.
spec_adapt.enable(model)
out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, use_mtp=True)
stats = spec_adapt.last_stats()
spec_adapt.disable(model)
stock = [model.generate(ids[b:b + 1, int((mask[b] == 0).sum()):], max_new_tokens=16, do_sample=False)[0]
         for b in range(len(ids))]
same = all(out[b, int((mask[b] == 0).sum()):].tolist() == stock[b].tolist() for b in range(len(ids)))
print("identical to stock greedy, row by row:", same)
print(f"use_mtp=True (Adaptive): drafted {stats.drafted}, accepted {stats.accepted}")

# The drafter itself, under any policy: each step drafts at most as many tokens as the checkpoint has MTP layers.
out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                     custom_generate=spec_adapt.generate, drafter=MTPDrafter(model), assistant_policy=FixedLength(2))
stats = spec_adapt.last_stats()
print(f"MTPDrafter, FixedLength(2): drafted {stats.drafted}, accepted {stats.accepted}, "
      f"{stats.new_tokens / max(stats.row_steps, 1):.2f} tokens per row and step")
