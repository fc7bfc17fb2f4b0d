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
    width = draft_tokens.shape[1]
    target_tokens = target_logits.argmax(dim=-1)                     # [B, S+1]
    matches = target_tokens[:, :width] == draft_tokens                 # [B, S]
    matches &= torch.arange(width, device=matches.device)[None, :] < lengths[:, None]
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)             # [B] leading matches
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)  # argmax of p_accepted
    return accepted, next_token


def coupled_accept(
    target_scores: torch.Tensor,   # [B, S+1, V] processed scores (masked tokens -inf)
    draft_tokens: torch.Tensor,    # [B, S] long
    lengths: torch.Tensor,         # [B] long
    gumbels: torch.Tensor,         # [B, S+1, V] i.i.d. standard Gumbel noise, position i's at index i
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless sampling by Gumbel-max coupling. The target's token at position i is y_i = argmax(scores_i + g_i),
    an exact sample from softmax(scores_i) (the Gumbel-max trick); d_i is accepted iff d_i == y_{i-1}, and the token
    after the accepted drafts is y_accepted (a correction or the bonus). So every committed token is y at its
    position: the output is the same function of the noise whatever was drafted (any width, any source, a draft
    sampled with the same noise or not), which is what lets a keyed noise (spec_adapt.noise) make seeded calls
    repeat. Exact for any draft, since no committed token depends on one. Its acceptance: a point-mass draft x is
    accepted with probability p(x), as by rejection sampling; a draft sampled from q as argmax(log q + g) with the
    same g is accepted with the probability that the two Gumbel-max samples agree, at least (1 - TV) / (1 + TV) and at
    most 1 - TV (TV the total variation distance of p and q; 1 - TV is rejection sampling's). Returns
    (accepted [B], next_token [B])."""
    return greedy_accept(target_scores.float() + gumbels.float(), draft_tokens, lengths)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, S] parents (node index or -1, parents before children) -> [B, S+1] depth of each tree column: 0 for the
    root (column 0), the node's depth (1 for a child of the root) for node i at column i + 1."""
    batch, width = parents.shape
    depth = torch.zeros(batch, width + 1, dtype=torch.long, device=parents.device)
    for i in range(width):
        depth[:, i + 1] = depth.gather(1, (parents[:, i] + 1).clamp(0, i)[:, None]).squeeze(1) + 1
    return depth


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
        residual = torch.where(rejected[:, None], _residual(p_next, q_next), p_next)
    next_token = (residual / exponentials).argmax(dim=-1)
    return accepted, next_token


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalized. p == q exactly leaves nothing to reject into: the rejection had probability 0,
    and p is kept to stay defined."""
    residual = (p - q).clamp(min=0)
    return torch.where(residual.sum(-1, keepdim=True) <= 0, p, residual)


def committed_tokens(draft_tokens: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor, fill: int = -1):
    """[B, S+1] tokens each row commits: d_1..d_a, then next_token, then `fill`."""
    out = torch.cat([draft_tokens, next_token[:, None]], dim=1)
    out.scatter_(1, accepted[:, None], next_token[:, None])
    return out.masked_fill_(torch.arange(out.shape[1], device=out.device)[None, :] > accepted[:, None], fill)


def lockstep(accepted: torch.Tensor, next_token: torch.Tensor, draft_tokens: torch.Tensor):
    """Every row accepts as many drafts as the row that accepted fewest (for a target that numbers tokens by cache
    column: the rows' columns stay in step). A row cut short commits its next accepted draft as the token after
    them: greedy, that draft is the target's own argmax; sampled, it is the accepted sample at that position, and
    where a row stops depends only on tokens up to there (so the tokens after it, regenerated by the next step, keep
    the target's distribution). Returns (accepted, next_token)."""
    if accepted.numel() < 2:
        return accepted, next_token
    least = int(accepted.min())
    cut = accepted > least
    if not bool(cut.any()):
        return accepted, next_token
    return torch.full_like(accepted, least), torch.where(cut, draft_tokens[:, least], next_token)


# -- trees (spec_adapt.tree) ---------------------------------------------------------------------------------------
# Tree columns: column 0 is the root (the last committed token), node i is column i + 1, so target distribution
# p at column c scores the children of that column's token. A walk keeps `cur`, the column it stands on.

def tree_greedy_accept(
    target_logits: torch.Tensor,   # [B, S+1, V] processed scores of the columns
    draft_tokens: torch.Tensor,    # [B, S] long
    parents: torch.Tensor,         # [B, S] long, -1 = child of the root
    lengths: torch.Tensor,         # [B] long
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy walk down the tree: from the root, step to the child whose token is the target's argmax, while there
    is one (siblings carry distinct tokens, so there is at most one). Returns (path [B, S] bool: the accepted
    nodes, accepted [B]: their count, next_token [B]: the argmax after the last of them)."""
    batch, width = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    best = target_logits.argmax(dim=-1)                                  # [B, S+1]
    cur = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
    path = torch.zeros(batch, width, dtype=torch.bool, device=draft_tokens.device)
    for i in range(width):            # children come after their parent: one pass in node order walks every row
        step = (parents[:, i] + 1 == cur) & (i < lengths) & (draft_tokens[:, i] == best[rows, cur])
        path[:, i] = step
        cur = torch.where(step, i + 1, cur)
    return path, path.long().sum(dim=1), best[rows, cur]


def tree_rejection_sample(
    target_probs: torch.Tensor,        # [B, S+1, V] float
    draft_tokens: torch.Tensor,        # [B, S] long
    parents: torch.Tensor,             # [B, S] long
    draft_probs: torch.Tensor | None,  # [B, S, V]: the distribution node i and its siblings were drawn from, or None
    lengths: torch.Tensor,             # [B] long
    uniforms: torch.Tensor,            # [B, S] in [0, 1): one per node
    exponentials: torch.Tensor,        # [B, V] i.i.d. Exp(1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless multi-candidate speculative sampling down a tree: recursive rejection sampling (Jeon et al. 2024,
    "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without Replacement").

    At the node the walk stands on, its children x_1..x_k are tried in order against a target that starts as p and
    shrinks: child x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); on acceptance the walk moves to x_j
    with p its column's target distribution; on rejection p_{j+1} = norm(max(0, p_j - q_j)) and
    q_{j+1} = q_j without x_j, renormalized. When every child is rejected (or there is none) the next token is drawn
    from what p became. Each step is the classic accept-or-residual rule, whose output follows p_j whatever x_j was;
    so the output follows the target's p.

    Siblings with probabilities must have been drawn from the same q without replacement, in node order. A point-mass
    draft (draft_probs None) may choose its siblings any way that does not look at the target: q_j = one_hot(x_j), so
    x_j is accepted with probability p_j(x_j) and rejected mass leaves only x_j. Returns (path, accepted, next_token)
    as tree_greedy_accept."""
    target_probs, uniforms, exponentials = target_probs.float(), uniforms.float(), exponentials.float()
    batch, width = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    cur = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
    p = target_probs[:, 0]                                               # [B, V] the target at the walk's node
    q = None if draft_probs is None else draft_probs.float()[:, 0].clone()   # sibling proposal, renormalized
    fresh = torch.ones(batch, dtype=torch.bool, device=draft_tokens.device)  # no child of `cur` tried yet
    path = torch.zeros(batch, width, dtype=torch.bool, device=draft_tokens.device)
    for i in range(width):
        tried = (parents[:, i] + 1 == cur) & (i < lengths)
        if not bool(tried.any()):
            continue
        x = draft_tokens[:, i]
        if draft_probs is None:
            q_i = torch.zeros_like(p)
            q_i[rows, x] = 1.0
        else:
            q = torch.where(fresh[:, None], draft_probs[:, i].float(), q)
            q_i = q
        q_x = q_i[rows, x]
        accept = tried & (uniforms[:, i] * q_x < p[rows, x])
        reject = tried & ~accept
        residual = _residual(p, q_i)
        residual = residual / residual.sum(-1, keepdim=True)      # p is tested against the next sibling
        path[:, i] = accept
        cur = torch.where(accept, i + 1, cur)
        p = torch.where(accept[:, None], target_probs[:, i + 1], torch.where(reject[:, None], residual, p))
        if draft_probs is not None:
            without = q_i.clone()
            without[rows, x] = 0.0
            without = without / without.sum(-1, keepdim=True).clamp(min=1e-30)
            q = torch.where(reject[:, None], without, q)
        fresh = torch.where(tried, accept, fresh)
    next_token = (p / exponentials).argmax(dim=-1)
    return path, path.long().sum(dim=1), next_token
