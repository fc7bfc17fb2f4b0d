"""Tiny random checkpoints with multi-token prediction (MTP) layers, for every family in transformers that ships
them (`num_mtp_layers`): the model is saved, MTP layers are added to its checkpoint under `mtp.layers.{k}.` (the
decoder block in the checkpoint's own layout, as the model's last layer is saved, under `mtp_block.`) and the model
is loaded again, as a checkpoint with MTP weights is."""

from __future__ import annotations

import os
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

# Checkpoints stay on disk while their models live (stock's MTP loader reads the checkpoint's folder again); one
# folder for the process, removed when it exits.
_FOLDERS = tempfile.TemporaryDirectory(prefix="mtp-")

COMMON = dict(vocab_size=16, hidden_size=32, intermediate_size=37, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=None, pad_token_id=0)
MLA = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, num_key_value_heads=4)
# Per family: its tiny config's own fields, and how many MTP layers its checkpoints may have.
FAMILIES = {
    "glm4_moe": (dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1), 2),
    "sarvam_moe": (dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1), 2),
    "deepseek_v3": (MLA, 2),
    "sarvam_mla": (MLA, 2),
    # Mellum's MTP layer is a sliding-window layer: the main model has one too (the rotary embedding they share
    # holds the sliding layers' parameters only then). Mellum checkpoints have one MTP layer.
    "mellum": (dict(num_local_experts=4, sliding_window=4, layer_types=["sliding_attention", "full_attention"]), 1),
    # Bailing hybrid: MLA full-attention layers among KDA linear-attention ones (a group of 2: [linear, full]).
    "bailing_hybrid": (dict(MLA, layer_group_size=2, num_local_experts=4), 1),
    # Inkling's MTP layers are full-attention ("hybrid": attention with short convolutions) with a dense MLP, its
    # main model's last layer is one too (the block is saved as that layer is). No rotary embedding (a learned
    # relative position bias); its MTP layers read [hidden | embedding] and keep no per-layer post norm.
    "inkling_text": (dict(n_routed_experts=4, n_shared_experts=1, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=8, sliding_window_size=4, rel_extent=16, d_rel=4,
                          logits_mup_width_multiplier=1.0, local_layer_ids=[0], mlp_layer_types=["sparse", "dense"]),
                     1),
    # Step 3.5 (the text model of Step3p7ForConditionalGeneration, which has no causal LM of its own: see WRAPPED).
    # Its config reads the MTP layers' attention and MLP types off `num_nextn_predict_layers` (the checkpoints'
    # name); every layer is full attention (its masks still want a sliding window set); layer 0 MoE, the last layer
    # dense like the MTP layers.
    "step3p5": (dict(n_routed_experts=4, share_expert_dim=16, moe_layers_enum="0", sliding_window=4), 1),
}
# Families whose text model ships only inside a multimodal model: that model's type and its other config fields.
WRAPPED = {"step3p5": ("step3p7", dict(image_token_id=15, vision_config=dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
    max_position_embeddings=4)))}


def config(family: str, mtp_layers: int, vocab: int = 16):
    fields, _ = FAMILIES[family]
    if family in WRAPPED:
        outer, extra = WRAPPED[family]
        text = {**COMMON, **fields, "vocab_size": vocab, "num_nextn_predict_layers": mtp_layers}
        return AutoConfig.for_model(outer, text_config=text, **extra)
    return AutoConfig.for_model(family, **{**COMMON, **fields, "vocab_size": vocab}, num_mtp_layers=mtp_layers)


def mtp_model(family: str, mtp_layers: int = 1, seed: int = 0, vocab: int = 16, head_scale: float = 8.0,
              follow: float = 1.0):
    """A tiny `family` model whose checkpoint has `mtp_layers` MTP layers. Random weights: a random tiny model's
    next token depends mostly on its current one (its layers add little to the embedding), and the MTP layers pass
    the embedding they read on (`follow` weighs the identity in their projection), so their drafts are often the
    target's next tokens, and sometimes not."""
    cfg = config(family, mtp_layers, vocab)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family in WRAPPED else AutoModelForCausalLM
    model = auto.from_config(cfg).eval()
    with torch.no_grad():          # clear-cut greedy choices, like a trained LM (tests/conftest.py)
        model.get_output_embeddings().weight.mul_(head_scale)
    folder = tempfile.mkdtemp(dir=_FOLDERS.name)
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    weights.update(_mtp_weights(weights, cfg.get_text_config(), mtp_layers, seed, follow))
    save_file(weights, path, metadata={"format": "pt"})
    loaded = auto.from_pretrained(folder).eval()
    # Where the checkpoint keeps the MTP layers (stock's MtpModel.from_pretrained reads this; a real checkpoint's
    # class names its own layer numbers).
    loaded._keys_to_ignore_on_load_unexpected = [r"^mtp\."]
    return loaded


def _mtp_weights(weights: dict, cfg, mtp_layers: int, seed: int, follow: float) -> dict:
    last = f"model.layers.{cfg.num_hidden_layers - 1}."
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = cfg.hidden_size
    out = {}
    for k in range(mtp_layers):
        for key, value in weights.items():
            if key.startswith(last):
                random = torch.randn(value.shape, generator=gen) * 0.05
                out[f"mtp.layers.{k}.mtp_block.{key[len(last):]}"] = random if value.dim() > 1 else value.clone()
        # A config with `chain_hidden_post_norm` has no per-layer post norm (stock's MtpLayer), maybe a shared one.
        post = () if hasattr(cfg, "chain_hidden_post_norm") else ("post_norm",)
        for norm in ("enorm", "hnorm", *post):
            out[f"mtp.layers.{k}.{norm}.weight"] = torch.ones(hidden)
        projection = torch.randn(hidden, 2 * hidden, generator=gen) * 0.05
        embedding = slice(hidden, None) if getattr(cfg, "mtp_hidden_states_first", False) else slice(None, hidden)
        projection[:, embedding] += follow * torch.eye(hidden)     # [embedding | hidden] (or [hidden | embedding])
        out[f"mtp.layers.{k}.eh_proj.weight"] = projection
    if getattr(cfg, "chain_hidden_post_norm", False):
        out["mtp.shared_post_norm.weight"] = torch.ones(hidden)
    return out
