"""Dispatch of the hot operations: Triton kernels (spec_adapt.kernels) where they can run, else PyTorch references.

Mode, from the environment variable SPEC_ADAPT_KERNELS or `set_mode`:
- "auto" (default): kernels for CUDA tensors when Triton is installed, references otherwise;
- "off": always the references;
- "force": kernels for every tensor (with TRITON_INTERPRET=1 they run on the CPU: that is how CI tests them).
`paths` records which path each operation took last ("triton" or "torch"); the loop copies it into SpecStats.
"""

from __future__ import annotations

import functools
import os

import torch

from . import accept

_mode = os.environ.get("SPEC_ADAPT_KERNELS", "auto")
paths: dict[str, str] = {}


def set_mode(mode: str) -> None:
    global _mode
    if mode not in ("auto", "off", "force"):
        raise ValueError(f"kernel mode must be 'auto', 'off' or 'force', got {mode!r}")
    _mode = mode


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_kernel(name: str, tensor: torch.Tensor) -> bool:
    use = _mode != "off" and triton_available() and (_mode == "force" or tensor.is_cuda)
    paths[name] = "triton" if use else "torch"
    return use


def greedy(logits, draft_tokens, lengths):
    if _use_kernel("greedy", logits):
        from .kernels.verify import greedy_verify

        return greedy_verify(logits, draft_tokens, lengths)
    return accept.greedy_accept(logits, draft_tokens, lengths)


def rejection(target_probs, draft_tokens, draft_probs, lengths, uniforms, exponentials):
    if _use_kernel("rejection", target_probs):
        from .kernels.verify import rejection_verify

        return rejection_verify(target_probs, draft_tokens, draft_probs, lengths, uniforms, exponentials)
    return accept.rejection_sample(target_probs, draft_tokens, draft_probs, lengths, uniforms, exponentials)


def gather_slots_reference(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache [B, H, P, D], index [B, P'] -> cache[b, :, index[b, j], :] as [B, H, P', D]."""
    idx = index[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3])
    return cache.gather(2, idx)


def gather_slots(cache, index):
    if _use_kernel("compact", cache):
        from .kernels.compact import gather_slots as kernel

        return kernel(cache, index)
    return gather_slots_reference(cache, index)


def token_rank(logits, tokens):
    if _use_kernel("rank", logits):
        from .kernels.verify import token_rank as kernel

        return kernel(logits, tokens)
    from .kernels.verify import token_rank_reference

    return token_rank_reference(logits, tokens)
