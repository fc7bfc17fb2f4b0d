"""Triton kernel for KV compaction: the data movement that rollback defers.

Reference: spec_adapt.acceptor.gather_slots_reference (a torch gather along the sequence axis), used by
spec_adapt.ledger.KVLedger.compact. out[b, h, j, :] = cache[b, h, index[b, j], :], for every layer's K and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kernel(src, index, dst, heads, src_len, dst_len, dim, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)                   # one (batch row, head) pair
    j0 = tl.program_id(1) * BLOCK_J         # a block of destination slots
    b = bh // heads
    js = j0 + tl.arange(0, BLOCK_J)
    ds = tl.arange(0, BLOCK_D)
    jmask = js < dst_len
    slots = tl.load(index + b.to(tl.int64) * dst_len + js, mask=jmask, other=0).to(tl.int64)
    mask = jmask[:, None] & (ds[None, :] < dim)
    src_ptr = src + (bh.to(tl.int64) * src_len + slots[:, None]) * dim + ds[None, :]
    vals = tl.load(src_ptr, mask=mask, other=0.0)
    dst_ptr = dst + (bh.to(tl.int64) * dst_len + js[:, None]) * dim + ds[None, :]
    tl.store(dst_ptr, vals, mask=mask)


def gather_slots(cache: torch.Tensor, index: torch.Tensor, block_j: int = 16) -> torch.Tensor:
    """cache [B, H, P, D], index [B, P'] (slots to keep, in order) -> [B, H, P', D] (double-buffered)."""
    batch, heads, length, dim = cache.shape
    out_len = index.shape[1]
    cache = cache.contiguous()
    out = torch.empty(batch, heads, out_len, dim, dtype=cache.dtype, device=cache.device)
    if out.numel():
        grid = (batch * heads, triton.cdiv(out_len, block_j))
        _gather_kernel[grid](cache, index.contiguous().long(), out, heads, length, out_len, dim, BLOCK_J=block_j,
                             BLOCK_D=triton.next_power_of_2(dim))
    return out
