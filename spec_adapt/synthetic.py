"""A synthetic model family for tests and the lab: drafts derived from a target with controlled agreement.

`perturbed_copy(target, noise)` copies the target and adds Gaussian noise (relative to each tensor's own standard
deviation) to its weights: noise 0 agrees everywhere, larger noise agrees less, so chains with a known best ordering
can be built from one random target. `truncated_copy(target, layers)` keeps the first layers (cheaper, usually worse).
"""

from __future__ import annotations

import copy

import torch


def perturbed_copy(target, noise: float, seed: int = 0):
    model = copy.deepcopy(target).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 1 and p.numel() > 1:
                scale = p.float().std().item() if p.numel() > 1 else 0.0
                p.add_((torch.randn(p.shape, generator=gen) * noise * scale).to(p.dtype))
    return model


def truncated_copy(target, layers: int):
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    model = type(target)(config).to(target.dtype).eval()
    model.load_state_dict(target.state_dict(), strict=False)
    return model


def agreement(target, draft, input_ids) -> float:
    """Top-1 agreement of two models' next-token predictions over every position of input_ids [B, L]."""
    with torch.no_grad():
        a = target(input_ids).logits.argmax(-1)
        b = draft(input_ids).logits[..., : target.config.vocab_size].argmax(-1)
    return float((a == b).float().mean())
