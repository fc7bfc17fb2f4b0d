"""A draft model's dynamic token tree, EAGLE-2 style: grown by path probability, one draft forward per depth.

Per row, starting from the draft's distribution after the last committed token:
1. every expanded node gets its `branch` best children (greedy: the top tokens of q; sampling: `branch` draws from q
   without replacement, by Gumbel-top-k), scored by path log-probability;
2. the `branch` best new nodes of this depth are fed to the draft in one forward (each attends to its ancestors in
   the draft's own ledger, a pending tree region), which gives their children's distributions;
3. after the plan's depth, the `gammas[b]` best nodes of all depths form the proposal (a reranking). A pooled plan
   spends sum(gammas) on the batch's best nodes whatever their row: confident rows get long trees, others none. Rows
   are compared by path probability calibrated per row, online: the ratio of the accepted tokens the row has had to
   what its drafts' path probabilities predicted (exponentially weighted, `ModelDrafter.calibration`).

Ranking keys never grow along a path, and a later sibling's key never exceeds an earlier sibling's (ties go to the older
node): so the best n nodes always include every chosen node's parent and earlier siblings, and the tree stays a tree.
Greedy, a node's key is its path log-probability (EAGLE-2's). Sampling, recursive rejection sampling
(spec_adapt.acceptance_rules.tree_rejection_sample) stays exact only if whether a node is drafted does not depend on the
token it turns out to be (else the tokens tried are not draws from q), so the key is the one the node's slot has before
its token is drawn: its parent's path log-probability plus the log of the mass its earlier siblings left. Nothing that
ranks above a node depends on that node's token. Under the default coupled rule
(spec_adapt.acceptance_rules.coupled_accept) the Gumbel-top-k draws use the step's keyed noise at the children's
position, so a node's first child is the draft's noisy argmax, the token the target's walk compares with; that rule is
exact whatever the tree holds.
"""

from __future__ import annotations

import torch

from ..tree import ancestry, node_contexts
from .drafter import DraftRequest, Proposal


def children(q: torch.Tensor, k: int, sampling: bool, gumbel: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., V] -> (tokens [..., k], log q of them [..., k]; -inf where q has fewer than k tokens with mass).
    Sampling: Gumbel-top-k, the first k of an ordered sample without replacement, with `gumbel` (the step's keyed
    noise at the children's position, broadcast to q: the first child is then the token the target's coupled rule
    compares with) or fresh noise."""
    logq = q.clamp(min=0).log()
    keys = logq
    if sampling:
        keys = logq + (gumbel if gumbel is not None else -torch.empty_like(logq).exponential_().log())
    top = keys.topk(min(k, q.shape[-1]), dim=-1).indices
    return top, logq.gather(-1, top)


class TreeDraft:
    """The nodes grown so far for a batch of rows (creation order is topological)."""

    def __init__(self, batch: int, device):
        self.device = device
        self.tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.parents = torch.zeros(batch, 0, dtype=torch.long, device=device)     # node index or -1
        self.scores = torch.zeros(batch, 0, device=device)                         # ranking key (module docstring)
        self.paths = torch.zeros(batch, 0, device=device)                          # path log-probability
        self.depth = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.drawn_from = torch.zeros(batch, 0, dtype=torch.long, device=device)   # index into `dists`
        self.fed = torch.zeros(batch, 0, dtype=torch.long, device=device)         # draft ledger region column or -1
        self.dists: list[torch.Tensor] = []                                        # [B, V] each (sampling only)

    def add(self, parents, tokens, logq, parent_paths, depth, dist_index, sampling) -> torch.Tensor:
        """Add children [B, n, k] (parents [B, n], -2 for a parent that is not expanded: its children rank last;
        tokens / logq [B, n, k]; parent_paths: the parents' path log-probabilities [B, n]); returns their node
        indices [B, n*k]."""
        batch, n, k = tokens.shape
        paths = parent_paths[:, :, None] + logq
        if sampling:        # before the draw: the parent's path and the mass the earlier siblings left
            before = torch.cat([torch.zeros_like(logq[..., :1]), logq.exp().cumsum(-1)[..., :-1]], dim=-1)
            scores = parent_paths[:, :, None] + (1 - before).clamp(min=0).log()
            scores = torch.where(torch.isfinite(logq), scores, float("-inf"))
        else:
            scores = paths
        scores = scores.cummin(dim=-1).values                 # a later sibling never outranks an earlier one
        scores = torch.where(parents[:, :, None] == -2, float("-inf"), scores)
        start = self.tokens.shape[1]
        self.tokens = torch.cat([self.tokens, tokens.reshape(batch, n * k)], dim=1)
        self.parents = torch.cat([self.parents, parents[:, :, None].expand(-1, -1, k).reshape(batch, n * k)], dim=1)
        self.scores = torch.cat([self.scores, scores.reshape(batch, n * k)], dim=1)
        self.paths = torch.cat([self.paths, paths.reshape(batch, n * k)], dim=1)
        self.depth = torch.cat([self.depth, torch.full((batch, n * k), depth, device=self.device)], dim=1)
        self.drawn_from = torch.cat([self.drawn_from, dist_index.reshape(batch, n, 1).expand(-1, -1, k)
                                     .reshape(batch, n * k)], dim=1)
        self.fed = torch.cat([self.fed, torch.full((batch, n * k), -1, device=self.device)], dim=1)
        return torch.arange(start, start + n * k, device=self.device).expand(batch, n * k)

    def best(self, nodes: torch.Tensor, k: int) -> torch.Tensor:
        """The k best of `nodes` [B, M] per row (best first; -inf ones last)."""
        scores = self.scores.gather(1, nodes)
        order = torch.sort(-scores, dim=1, stable=True).indices[:, :k]
        return nodes.gather(1, order)

    def contexts(self, nodes, buffer, lengths) -> torch.Tensor:
        """[B, n, L] token contexts of `nodes`: the committed buffer and each node's path."""
        anc, depth = ancestry(self.parents, torch.ones_like(self.parents, dtype=torch.bool))
        every = node_contexts(buffer, lengths, self.tokens, anc, depth)                   # [B, M, L]
        return every.gather(1, nodes[..., None].expand(-1, -1, every.shape[-1]))

    def choose(self, budgets: torch.Tensor, pooled: bool, offsets: torch.Tensor | None) -> torch.Tensor:
        """[B, M] bool: the best budgets[b] nodes of each row or, pooled, the best sum(budgets) nodes of the batch,
        ranked by key + the row's calibration offset (log observed / predicted acceptance)."""
        keys, limits = self.scores, budgets
        if pooled:          # one row of every node; row-major ties still put a parent before its child
            keys = (keys + (offsets[:, None] if offsets is not None else 0.0)).reshape(1, -1)
            limits = budgets.sum().reshape(1)
        order = torch.sort(-keys, dim=1, stable=True).indices                          # best first, ties: older
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(keys.shape[1], device=self.device).expand_as(order))
        return (rank < limits[:, None]).reshape(self.scores.shape) & torch.isfinite(self.scores)

    def proposal(self, budgets: torch.Tensor, sampling: bool, target_device, pooled: bool = False,
                 offsets: torch.Tensor | None = None) -> tuple[Proposal, torch.Tensor, torch.Tensor]:
        """The chosen nodes (`choose`) per row, in creation order: (Proposal with parents, fed [B, N] region column
        of each proposed node or -1, expected [B]: the draft's own expectation of the accepted count, the sum of the
        proposed nodes' path probabilities)."""
        batch, total = self.tokens.shape
        chosen = self.choose(budgets, pooled, offsets)
        lengths = chosen.long().sum(dim=1)
        width = int(lengths.max()) if batch else 0
        index = torch.arange(total, device=self.device).expand(batch, total)
        picked = torch.where(chosen, index, total + index).sort(dim=1).values[:, :width]   # creation order
        picked = torch.where(picked < total, picked, 0)
        new_index = torch.full((batch, total + 1), -1, dtype=torch.long, device=self.device)
        slot = torch.arange(width, device=self.device).expand(batch, width)
        new_index.scatter_(1, torch.where(slot < lengths[:, None], picked, total), slot)
        new_index = new_index[:, :total]
        old_parents = self.parents.gather(1, picked)
        parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
        tokens = self.tokens.gather(1, picked)
        probs = None
        if sampling and width:
            dists = torch.stack(self.dists, dim=1)                                       # [B, n_dists, V]
            which = self.drawn_from.gather(1, picked)
            probs = dists.gather(1, which[..., None].expand(-1, -1, dists.shape[-1])).to(target_device)
        fed = self.fed.gather(1, picked)
        proposal = Proposal(tokens.to(target_device), lengths.to(target_device), probs,
                            parents=parents.to(target_device))
        expected = torch.where(chosen, self.paths.exp(), 0.0).sum(dim=1)
        return proposal, torch.where(slot < lengths[:, None], fed, -1), expected


def draft_tree(drafter, request: DraftRequest, tokens, lengths, gammas, last) -> Proposal:
    """Grow the tree for the rows with gammas > 0 (the draft ledger already holds their committed tokens; `last`
    [B, V'] are the draft's logits after the last one). Leaves the fed nodes pending in the draft's ledger."""
    device, k, vocab = tokens.device, drafter.branch, drafter.vocab
    depths = torch.where(gammas > 0, request.depths.to(device), 0)
    rows = request.rows.to(device)
    tree = TreeDraft(len(gammas), device)
    batch = len(gammas)
    q = request.process(last[:, :vocab].float(), tokens, lengths, rows).softmax(dim=-1)
    tree.dists.append(q)
    tok, logq = children(q, k, request.sampling, _noise_at(request, 0, device))
    root = torch.where(depths > 0, -1, -2)[:, None]                       # -2: a row that drafts nothing
    frontier = tree.add(root, tok[:, None], logq[:, None], torch.zeros(batch, 1, device=device), 1,
                        torch.zeros(batch, 1, dtype=torch.long, device=device), request.sampling)
    region = 0
    for depth in range(2, int(depths.max()) + 1):
        feed = tree.best(frontier, k)                                     # [B, k]
        alive = torch.isfinite(tree.scores.gather(1, feed)) & (depth <= depths)[:, None]
        n_valid = alive.long().sum(dim=1)
        if not bool(n_valid.any()):
            break
        parent_nodes = tree.parents.gather(1, feed)
        parent_region = torch.where(parent_nodes >= 0, tree.fed.gather(1, parent_nodes.clamp(min=0)), -1)
        logits = drafter.ledger.forward(tree.tokens.gather(1, feed), n_valid, parents=parent_region)   # [B, k, V']
        tree.fed.scatter_(1, feed, torch.where(alive, region + torch.arange(k, device=device)[None], -1))
        region += k
        scores = logits[..., :vocab].float()
        if request.process:
            contexts = tree.contexts(feed, tokens, lengths)
            depth_of = tree.depth.gather(1, feed)
            flat = request.process(scores.flatten(0, 1), contexts.flatten(0, 1), (lengths[:, None] + depth_of)
                                   .flatten(), rows[:, None].expand(-1, k).flatten())
            scores = flat.reshape(batch, k, -1)
        q = scores.softmax(dim=-1)                                        # [B, k, V]
        dist_index = torch.arange(len(tree.dists), len(tree.dists) + k, device=device).expand(batch, k)
        if request.sampling:
            tree.dists.extend(q.unbind(1))
        gumbel = _noise_at(request, depth - 1, device)
        tok, logq = children(q, k, request.sampling, gumbel[:, None] if gumbel is not None else None)
        parents = torch.where(alive, feed, -2)
        frontier = tree.add(parents, tok, logq, tree.paths.gather(1, feed), depth, dist_index, request.sampling)
    offsets = drafter.calibration() if request.pooled else None
    proposal, fed, expected = tree.proposal(gammas, request.sampling, request.tokens.device, request.pooled, offsets)
    drafter.tree_fed, drafter.tree_expected = fed, torch.where(proposal.lengths.to(device) > 0, expected, -1.0)
    return proposal


def _noise_at(request: DraftRequest, k: int, device) -> torch.Tensor | None:
    """[B, V] the step's keyed noise at draft position k (the nodes of depth k + 1), or None (greedy, or no keyed
    noise)."""
    if not request.sampling or request.noise is None:
        return None
    return request.noise.at(k).to(device)
