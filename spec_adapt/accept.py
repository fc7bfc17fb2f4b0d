"""Acceptance: pure functions in the papers' notation. The Triton kernels must reproduce these exactly.

Glossary, for one row b of a step that drafted `lengths[b]` tokens d_1..d_n (stored at indices 0..n-1):
- target distributions p_0..p_n: p_{i} (index i of `target_*[:, i]`) scores draft token d_{i+1};
  p_n gives the bonus token.
- accepted: the number of leading draft tokens the target agrees with.
- recovered: the token emitted at the first rejection (argmax of p_a in greedy mode; a sample from
  norm(max(0, p_a - q_a)) in sampling mode).
- bonus: the token emitted from p_n when all n drafts were accepted.
Either way a row commits `accepted + 1` tokens: d_1..d_a then `next_token`.

Convention: p = target probabilities, q = draft probabilities, both already passed through the logits processors.
A draft that has no probabilities (n-gram, scripted) is a point mass: q_i = one_hot(d_i).

Worked example (greedy, one row): drafts [7, 3, 9], target argmax per position [7, 3, 4, 8]
-> d_1 = 7 matches, d_2 = 3 matches, d_3 = 9 != 4: accepted = 2, recovered token = 4, committed = [7, 3, 4].
With target argmax [7, 3, 9, 8] all three match: accepted = 3, bonus token = 8, committed = [7, 3, 9, 8].
"""

from __future__ import annotations

import torch


def greedy_accept(
    target_logits: torch.Tensor,   # [B, S+1, V] processed scores (any monotone transform of them works)
    draft_tokens: torch.Tensor,    # [B, S] long; entries at index >= lengths[b] are ignored
    lengths: torch.Tensor,         # [B] long, 0 <= lengths[b] <= S
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification. Returns (accepted [B], next_token [B]): next_token is recovered or bonus."""
    batch, width = draft_tokens.shape
    target_tokens = target_logits.argmax(dim=-1)                     # [B, S+1]
    matches = target_tokens[:, :width] == draft_tokens                 # [B, S]
    matches &= torch.arange(width, device=matches.device)[None, :] < lengths[:, None]
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)             # [B] leading matches
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)  # argmax of p_accepted
    return accepted, next_token


def sample_randoms(
    batch: int, width: int, vocab: int, device: torch.device, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random inputs of one `rejection_sample` call: uniforms [B, S] and exponentials [B, V]."""
    uniforms = torch.rand(batch, width, device=device, generator=generator)
    exponentials = torch.empty(batch, vocab, device=device).exponential_(generator=generator)
    return uniforms, exponentials


def rejection_sample(
    target_probs: torch.Tensor,          # [B, S+1, V] float
    draft_tokens: torch.Tensor,          # [B, S] long
    draft_probs: torch.Tensor | None,    # [B, S, V] float, or None for point-mass drafts
    lengths: torch.Tensor,               # [B] long
    uniforms: torch.Tensor,              # [B, S] in [0, 1)
    exponentials: torch.Tensor,          # [B, V] i.i.d. Exp(1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept d_i iff u_i < p_{i-1}(d_i) / q_i(d_i). At the first rejection, sample from norm(max(0, p - q)); when all
    are accepted, sample the bonus from p_n. Sampling uses the exponential race: argmax_v(w_v / E_v) with
    E ~ Exp(1) is a draw from w / sum(w), so the result is a pure function of the given randoms.
    Arithmetic is float32 whatever the input dtype (the Triton kernel does the same, bit for bit).
    Returns (accepted [B], next_token [B]).
    """
    target_probs, uniforms, exponentials = target_probs.float(), uniforms.float(), exponentials.float()
    draft_probs = draft_probs.float() if draft_probs is not None else None
    batch, width = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_draft = target_probs[:, :width].gather(-1, draft_tokens[..., None]).squeeze(-1)      # [B, S]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)              # [B, S]
    accept = uniforms < p_draft / q_draft
    accept &= torch.arange(width, device=accept.device)[None, :] < lengths[:, None]
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)                                   # [B]

    p_next = target_probs[rows, accepted]                                                  # [B, V]
    rejected = accepted < lengths
    at = accepted.clamp(max=max(width - 1, 0))
    if width == 0:
        residual = p_next
    else:
        if draft_probs is None:
            q_next = torch.zeros_like(p_next)
            q_next[rows, draft_tokens[rows, at]] = 1.0
        else:
            q_next = draft_probs[rows, at]
        residual = (p_next - q_next).clamp(min=0)
        # p == q exactly leaves nothing to reject into; the rejection had probability 0, keep p to stay defined.
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p_next, residual)
        residual = torch.where(rejected[:, None], residual, p_next)
    next_token = (residual / exponentials).argmax(dim=-1)
    return accepted, next_token


def committed_tokens(draft_tokens: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor, fill: int = -1):
    """[B, S+1] tokens each row commits: d_1..d_a, then next_token, then `fill`."""
    batch, width = draft_tokens.shape
    out = torch.full((batch, width + 1), fill, dtype=torch.long, device=draft_tokens.device)
    pos = torch.arange(width + 1, device=draft_tokens.device)[None, :]
    out[:, :width] = torch.where(pos[:, :width] < accepted[:, None], draft_tokens, fill)
    out.scatter_(1, accepted[:, None], next_token[:, None])
    return out
