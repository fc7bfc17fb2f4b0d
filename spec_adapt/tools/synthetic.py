"""A synthetic model family for tests and the lab: drafts derived from a target with controlled agreement.

`perturbed_copy(target, noise)` copies the target and adds Gaussian noise (relative to each tensor's own standard
deviation) to its weights: noise 0 agrees everywhere, larger noise agrees less, so chains with a known best ordering
can be built from one random target. `truncated_copy(target, layers)` keeps the first layers (cheaper, usually worse).
"""

from __future__ import annotations

import copy

import torch

from ..loading import layer_subset_copy


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
    return layer_subset_copy(target, list(range(layers)))


def agreement(target, draft, input_ids, start: int = 0) -> float:
    """Top-1 agreement of two models' next-token predictions over input_ids [B, L], in context; with `start`, only
    the predictions of tokens start.. (e.g. the generated part of prompt + output)."""
    with torch.no_grad():
        a = target(input_ids).logits[:, max(start - 1, 0) :].argmax(-1)
        b = draft(input_ids).logits[:, max(start - 1, 0) :, : target.config.vocab_size].argmax(-1)
    if start:
        a, b = a[:, :-1], b[:, :-1]         # the last position predicts a token that is not there
    return float((a == b).float().mean())


def layered_family(vocab: int = 8192, hidden: int = 512, layers: int = 24, cuts=(1, 4), scales=(1.0, 0.05),
                   seed: int = 0, tie: bool = False):
    """A random Llama target and drafts that are its first `cuts` layers, so their costs follow their depth.

    Agreement is set by how much the dropped layers change the residual stream: the output projections of
    layers [cuts[i], cuts[i+1]) are multiplied by scales[i] (layers from cuts[-1] on by scales[-1]). Small scales
    after the last cut make the deepest draft agree with the target; scale 1 leaves a random model's own layers.
    The head is not tied to the embeddings by default: a tied random model mostly repeats its input, and greedy
    outputs collapse into short loops that any draft predicts. Returns (target, [draft_1, ..., draft_k]),
    cheapest first.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if len(scales) != len(cuts):
        raise ValueError(f"layered_family needs one scale per cut, got cuts={cuts!r} and scales={scales!r}.")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = LlamaForCausalLM(config).eval()
    bounds = list(cuts) + [layers]
    with torch.no_grad():
        for (start, stop), scale in zip(zip(bounds, bounds[1:]), scales):
            for layer in target.model.layers[start:stop]:
                layer.self_attn.o_proj.weight.mul_(scale)
                layer.mlp.down_proj.weight.mul_(scale)
    return target, [truncated_copy(target, cut) for cut in cuts]
