"""Triton kernels for verification: greedy acceptance, lossless rejection sampling, and the rank test.

References (the kernels must match them exactly; tests compare both):
- greedy_verify     <-> spec_adapt.acceptance_rules.greedy_accept
- rejection_verify  <-> spec_adapt.acceptance_rules.rejection_sample
- token_rank        <-> token_rank_reference below
Every kernel splits the vocabulary into chunks so that one row's scan spreads over the GPU at batch 1 too: greedy
verification runs one program per (row, position, chunk) and then one per row to accept; rejection sampling runs one
per (row, chunk), each repeating the row's accept test (a few scalar reads) and scanning its chunk once, then one per
row to pick the sample from the chunks' partials, so no [B, V] residual is written to memory; the rank test runs one
per (row, chunk) and sums the counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block(block: int, chunk: int) -> int:
    """The scan's block for a chunk: a power of two (what tl.arange takes), no wider than the chunk needs."""
    if not (isinstance(chunk, int) and chunk >= 1 and isinstance(block, int) and block >= 1
            and block & (block - 1) == 0):
        raise ValueError(f"kernel chunk must be an int >= 1 and block a power of two, got chunk={chunk!r}, "
                         f"block={block!r}")
    return min(block, triton.next_power_of_2(chunk))


@triton.jit
def _running_max(score, start, best, index):
    """A block's maximum of `score` and the first index reaching it (`start` + its offset), kept when it beats the
    running (best, index): a strictly greater value only, so the first index overall wins ties."""
    block_max = tl.max(score, axis=0)
    block_arg = tl.argmax(score, axis=0).to(tl.int64) + start
    better = block_max > best
    return tl.where(better, block_max, best), tl.where(better, block_arg, index)


@triton.jit
def _chunk_argmax_kernel(logits, best_out, index_out, vocab, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row-position, vocabulary chunk): the chunk's maximum and the first index reaching it (float32
    comparison), written to best_out / index_out[position * chunks + chunk]."""
    position = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits + position.to(tl.int64) * vocab
    first = chunk.to(tl.int64) * CHUNK
    best = tl.full([], float("-inf"), tl.float32)
    index = first
    for offset in range(0, CHUNK, BLOCK):
        offs = first + offset + tl.arange(0, BLOCK)
        vals = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        best, index = _running_max(vals, first + offset, best, index)
    tl.store(best_out + position * chunks + chunk, best)
    tl.store(index_out + position * chunks + chunk, index)


@triton.jit
def _greedy_accept_kernel(best, index, drafts, lengths, accepted_out, next_out, width, chunks,
                          BLOCK_C: tl.constexpr):
    """One program per row: each position's argmax from its chunks' partial maxima (the lowest chunk wins ties, so the
    first index overall), matched against the draft until the first rejection."""
    row = tl.program_id(0)
    length = tl.load(lengths + row)
    accepted = tl.full([], 0, tl.int64)
    next_token = tl.full([], 0, tl.int64)
    done = tl.full([], 0, tl.int32)
    lanes = tl.arange(0, BLOCK_C)
    for i in range(0, width + 1):
        if done == 0:
            at = (row * (width + 1) + i).to(tl.int64) * chunks + lanes
            vals = tl.load(best + at, mask=lanes < chunks, other=float("-inf"))
            top = tl.max(vals, axis=0)
            winner = tl.min(tl.where(vals == top, lanes, BLOCK_C), axis=0)   # the lowest chunk reaching the max
            token = tl.load(index + (row * (width + 1) + i).to(tl.int64) * chunks + winner)
            draft = tl.load(drafts + row * width + i, mask=i < width, other=-1)
            if (i < length) & (token == draft):
                accepted += 1
            else:
                next_token = token
                done = 1
    tl.store(accepted_out + row, accepted)
    tl.store(next_out + row, next_token)


def greedy_verify(logits: torch.Tensor, draft_tokens: torch.Tensor, lengths: torch.Tensor, block: int = 1024,
                  chunk: int = 8192):
    """logits [B, S+1, V] (fp32/bf16/fp16), draft_tokens [B, S], lengths [B] -> (accepted [B], next_token [B]).

    Every (row, position) and every `chunk` of the vocabulary is its own program, so the work spreads over the GPU
    at batch 1 too; the per-row accept then reads only B x (S+1) x V/chunk partial maxima."""
    batch, width = draft_tokens.shape
    vocab = logits.shape[-1]
    logits = logits.contiguous()
    accepted = torch.empty(batch, dtype=torch.long, device=logits.device)
    next_token = torch.empty_like(accepted)
    if batch:
        block = _block(block, chunk)
        chunks = triton.cdiv(vocab, chunk)
        positions = batch * (width + 1)
        best = torch.empty(positions * chunks, dtype=torch.float32, device=logits.device)
        index = torch.empty(positions * chunks, dtype=torch.long, device=logits.device)
        _chunk_argmax_kernel[(positions, chunks)](logits, best, index, vocab, chunks, CHUNK=chunk, BLOCK=block)
        _greedy_accept_kernel[(batch,)](best, index, draft_tokens.contiguous().long(), lengths.contiguous().long(),
                                        accepted, next_token, width, chunks,
                                        BLOCK_C=max(triton.next_power_of_2(chunks), 2))
    return accepted, next_token


@triton.jit
def _rejection_chunk_kernel(probs, drafts, qprobs, lengths, uniforms, expo, accepted_out, part_total, part_best,
                            part_index, width, vocab, chunks, HAS_Q: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr):
    """One program per (row, vocabulary chunk). Each repeats the row's accept test (width scalar reads), then scans
    its chunk once for three partials: the residual's sum, and the exponential race's winner under the residual and
    under p, since which of the two the row samples from is known only once every chunk's sum is in."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    length = tl.load(lengths + row)
    accepted = tl.full([], 0, tl.int64)
    done = tl.full([], 0, tl.int32)
    for i in range(0, width):
        if done == 0:
            if i < length:
                token = tl.load(drafts + row * width + i)
                p = tl.load(probs + (row * (width + 1) + i).to(tl.int64) * vocab + token).to(tl.float32)
                if HAS_Q:
                    q = tl.load(qprobs + (row * width + i).to(tl.int64) * vocab + token).to(tl.float32)
                else:
                    q = 1.0
                u = tl.load(uniforms + row * width + i).to(tl.float32)
                if u < p / q:
                    accepted += 1
                else:
                    done = 1
            else:
                done = 1
    if chunk == 0:
        tl.store(accepted_out + row, accepted)
    rejected = accepted < length
    p_row = probs + (row * (width + 1) + accepted).to(tl.int64) * vocab
    at = tl.minimum(accepted, tl.maximum(width - 1, 0))
    q_row = qprobs + (row * width + at).to(tl.int64) * vocab
    draft_at = tl.load(drafts + row * width + at, mask=width > 0, other=-1)
    total = tl.full([], 0.0, tl.float32)
    best_r = tl.full([], float("-inf"), tl.float32)
    best_p = tl.full([], float("-inf"), tl.float32)
    first = chunk.to(tl.int64) * CHUNK
    end = tl.minimum(first + CHUNK, vocab)       # the last block may reach past the chunk: never read it twice
    index_r = first
    index_p = first
    for offset in range(0, CHUNK, BLOCK):
        offs = first + offset + tl.arange(0, BLOCK)
        mask = offs < end
        residual = _residual(p_row, q_row, draft_at, offs, end, rejected, HAS_Q)
        total += tl.sum(residual, axis=0)
        p = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
        e = tl.load(expo + row.to(tl.int64) * vocab + offs, mask=mask, other=1.0).to(tl.float32)
        best_r, index_r = _running_max(tl.where(mask, residual / e, float("-inf")), first + offset, best_r, index_r)
        best_p, index_p = _running_max(tl.where(mask, p / e, float("-inf")), first + offset, best_p, index_p)
    at = row * chunks + chunk
    tl.store(part_total + at, total)
    tl.store(part_best + 2 * at, best_r)
    tl.store(part_best + 2 * at + 1, best_p)
    tl.store(part_index + 2 * at, index_r)
    tl.store(part_index + 2 * at + 1, index_p)


@triton.jit
def _rejection_pick_kernel(accepted, lengths, part_total, part_best, part_index, next_out, chunks,
                           BLOCK_C: tl.constexpr):
    """One program per row: the residual when the row was rejected and it has mass (else p), and of that choice the
    chunks' winners, the lowest chunk taking ties, so the first index overall as torch.argmax."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_C)
    live = lanes < chunks
    at = row * chunks + lanes
    total = tl.sum(tl.load(part_total + at, mask=live, other=0.0), axis=0)
    use_residual = (tl.load(accepted + row) < tl.load(lengths + row)) & (total > 0)
    pick = tl.where(use_residual, 0, 1)
    vals = tl.load(part_best + 2 * at + pick, mask=live, other=float("-inf"))
    top = tl.max(vals, axis=0)
    winner = tl.min(tl.where(live & (vals == top), lanes, BLOCK_C), axis=0)
    tl.store(next_out + row, tl.load(part_index + 2 * (row * chunks + winner) + pick))


@triton.jit
def _residual(p_row, q_row, draft_at, offs, end, rejected, HAS_Q: tl.constexpr):
    """max(0, p - q) over a block, below `end`; reads nothing when the row was not rejected (q may not exist then)."""
    mask = (offs < end) & ((offs * 0 + rejected.to(tl.int32)) != 0)   # scalar broadcast to the block
    p = tl.load(p_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(q_row + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        q = tl.where(offs == draft_at, 1.0, 0.0)
    return tl.where(mask, tl.maximum(p - q, 0.0), 0.0)


def rejection_verify(target_probs, draft_tokens, draft_probs, lengths, uniforms, exponentials, block: int = 1024,
                     chunk: int = 8192):
    """Same contract as spec_adapt.acceptance_rules.rejection_sample (draft_probs None = point mass). Every (row,
    `chunk` of the vocabulary) is its own program, so a row's scan spreads over the GPU at batch 1 too."""
    batch, width = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    accepted = torch.empty(batch, dtype=torch.long, device=device)
    next_token = torch.empty_like(accepted)
    if batch:
        block = _block(block, chunk)
        chunks = triton.cdiv(vocab, chunk)
        lengths = lengths.contiguous().long()
        q = draft_probs.contiguous() if draft_probs is not None else target_probs   # unused when HAS_Q is False
        total = torch.empty(batch * chunks, dtype=torch.float32, device=device)
        best = torch.empty(2 * batch * chunks, dtype=torch.float32, device=device)
        index = torch.empty(2 * batch * chunks, dtype=torch.long, device=device)
        _rejection_chunk_kernel[(batch, chunks)](
            target_probs.contiguous(), draft_tokens.contiguous().long(), q, lengths, uniforms.contiguous().float(),
            exponentials.contiguous().float(), accepted, total, best, index, width, vocab, chunks,
            HAS_Q=draft_probs is not None, CHUNK=chunk, BLOCK=block)
        _rejection_pick_kernel[(batch,)](accepted, lengths, total, best, index, next_token, chunks,
                                         BLOCK_C=max(triton.next_power_of_2(chunks), 2))
    return accepted, next_token


@triton.jit
def _rank_kernel(logits, tokens, out, vocab, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, vocabulary chunk): how many of the chunk's logits lie strictly above the token's."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits + row.to(tl.int64) * vocab
    value = tl.load(base + tl.load(tokens + row)).to(tl.float32)
    count = tl.full([], 0, tl.int64)
    first = chunk.to(tl.int64) * CHUNK
    end = tl.minimum(first + CHUNK, vocab)       # the last block may reach past the chunk: never count it twice
    for offset in range(0, CHUNK, BLOCK):
        offs = first + offset + tl.arange(0, BLOCK)
        vals = tl.load(base + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        count += tl.sum((vals > value).to(tl.int64), axis=0)
    tl.store(out + row * chunks + chunk, count)


def token_rank_reference(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[N, V], [N] -> [N]: how many vocabulary entries have a logit strictly above the token's ("in the top K" is
    rank < K), with no top-k materialized."""
    values = logits.float().gather(1, tokens[:, None].long())
    return (logits.float() > values).sum(dim=1)


def token_rank(logits: torch.Tensor, tokens: torch.Tensor, block: int = 1024, chunk: int = 8192) -> torch.Tensor:
    """token_rank_reference's contract; one program per (row, `chunk` of the vocabulary), the chunks' counts summed
    (integers: the order of the sum changes nothing)."""
    n, vocab = logits.shape
    if not n:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    block = _block(block, chunk)
    chunks = triton.cdiv(vocab, chunk)
    counts = torch.empty(n, chunks, dtype=torch.long, device=logits.device)
    _rank_kernel[(n, chunks)](logits.contiguous(), tokens.contiguous().long(), counts, vocab, chunks, CHUNK=chunk,
                              BLOCK=block)
    return counts.sum(dim=1)
