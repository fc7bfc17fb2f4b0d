"""Token trees: several continuations per row, verified in one target forward.

A tree proposal is a Proposal whose `parents` [B, S] gives each node's parent within its row (a node index), or -1
for a child of the row's last committed token. Nodes are stored in topological order (a parent comes before its
children), so any prefix of a row's nodes is again a tree: a budget cut keeps the first n nodes. A chain is the
tree whose node i has parent i - 1.

Worked example, one row, committed "... the": nodes [cat, dog, sat, ran] with parents [-1, -1, 0, 1] is

    the ─┬─ cat ── sat
         └─ dog ── ran

depth [1, 1, 2, 2]; node 2 ("sat") sees "... the cat sat": its ancestors-or-self are nodes {0, 2}.

Verification feeds the last committed token (the root, chunk column 0) and node i at chunk column i + 1; every column
attends to the committed context and to its ancestors only (the ledger builds the 4-D mask), at position
committed length - 1 + depth. The accept phase walks down from the root (spec_adapt.acceptance_rules.tree_*), and the
loop commits the accepted path as if it had been a chain.
"""

from __future__ import annotations

import torch


def chain_parents(batch: int, width: int, device=None) -> torch.Tensor:
    """The parents of chains: node i's parent is i - 1."""
    return (torch.arange(width, device=device) - 1).expand(batch, width).clone()


def ancestry(parents: torch.Tensor, used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(anc [B, S, S] bool: anc[b, i, j] = node j is node i or one of its ancestors, depth [B, S] long: 1 for a
    child of the root). `used`: the nodes in use, as counts per row [B] (the first lengths[b]) or a mask [B, S];
    a node not in use gets anc = {itself} and depth 0. Parents must come before their children."""
    batch, width = parents.shape
    device = parents.device
    if used.dim() == 1:
        used = torch.arange(width, device=device)[None, :] < used[:, None]
    anc = torch.zeros(batch, width, width, dtype=torch.bool, device=device)
    depth = torch.zeros(batch, width, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    for i in range(width):                      # parents come first: one pass in node order
        parent = parents[:, i].clamp(min=0)
        has_parent = used[:, i] & (parents[:, i] >= 0)
        anc[:, i] = torch.where(has_parent[:, None], anc[rows, parent], anc[:, i])
        anc[:, i, i] = True
        depth[:, i] = torch.where(used[:, i], torch.where(has_parent, depth[rows, parent] + 1, 1), 0)
    return anc, depth


def tree_problems(parents: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> str | None:
    """What is wrong with a tree (None when it is well formed): a parent index that is not an earlier node of the
    row (which also rules out cycles), or two siblings carrying the same token (the walk down the tree needs one
    child per token)."""
    batch, width = tokens.shape
    if not width:
        return None
    index = torch.arange(width, device=tokens.device)[None, :]
    used = index < lengths[:, None]
    bad = used & ((parents < -1) | (parents >= index))
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        return (f"node {i} of row {b} has parent {int(parents[b, i])}; a parent must be an earlier node of the row "
                "(0..i-1) or -1 for a child of the last committed token")
    same_parent = parents[:, :, None] == parents[:, None, :]
    same_token = tokens[:, :, None] == tokens[:, None, :]
    both = used[:, :, None] & used[:, None, :] & (index[:, :, None] < index[:, None, :])
    twins = same_parent & same_token & both
    if bool(twins.any()):
        b, i, j = twins.nonzero()[0].tolist()
        return f"nodes {i} and {j} of row {b} are siblings with the same token {int(tokens[b, i])}"
    return None


def is_chain(parents: torch.Tensor | None, lengths: torch.Tensor) -> bool:
    if parents is None:
        return True
    width = parents.shape[1]
    used = torch.arange(width, device=parents.device)[None, :] < lengths[:, None]
    return bool(((parents == chain_parents(len(parents), width, parents.device)) | ~used).all())


def chunk_tree(parents: torch.Tensor) -> torch.Tensor:
    """Parents of the verification chunk [root, node 0, node 1, ...] as chunk columns: the root has -1 (it follows
    the committed context), node i's parent p becomes column p + 1 (the root for p = -1)."""
    root = parents.new_full((parents.shape[0], 1), -1)
    return torch.cat([root, parents + 1], dim=1)


def path_nodes(path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """path [B, S] bool (accepted nodes, one chain from the root) -> (nodes [B, A] node indices in depth order,
    padded with 0, counts [B])."""
    batch, width = path.shape
    counts = path.long().sum(dim=1)
    index = torch.arange(width, device=path.device).expand(batch, width)
    order = torch.where(path, index, width + index).sort(dim=1).values       # accepted nodes first, in node order
    most = int(counts.max()) if batch else 0
    nodes = order[:, :most]
    return torch.where(nodes < width, nodes, 0), counts


def node_contexts(buffer: torch.Tensor, base: torch.Tensor, tokens: torch.Tensor, anc: torch.Tensor,
                  depth: torch.Tensor) -> torch.Tensor:
    """[B, S, L] token contexts: row b's committed buffer with node i's ancestors-or-self written after base[b]
    (what a processor that reads input_ids must see at the position after node i). L grows when needed."""
    batch, width = tokens.shape
    need = int((base + depth.max(dim=1).values).max()) if width else 0
    if need > buffer.shape[1]:
        buffer = torch.cat([buffer, buffer.new_zeros(batch, need - buffer.shape[1])], dim=1)
    contexts = buffer[:, None, :].expand(batch, width, buffer.shape[1]).clone()
    b, i, j = anc.nonzero(as_tuple=True)
    contexts[b, i, base[b] + depth[b, j] - 1] = tokens[b, j]
    return contexts


def from_branches(branches: list[list[list[int]]], budgets: list[int], depths: list[int] | None = None):
    """Per row, continuations (token lists, best first) -> per row the (tokens, parents) lists of the trie they
    make: shared prefixes merge, nodes are added branch by branch, row b keeps at most budgets[b] nodes and depth
    depths[b] (None: no limit). A branch that no longer fits is cut where the budget ends."""
    trees = []
    for b, row in enumerate(branches):
        limit = budgets[b]
        max_depth = depths[b] if depths is not None else None
        children: dict[tuple[int, int], int] = {}          # (parent node, token) -> node
        tok, par = [], []
        for branch in row:
            parent = -1
            for d, token in enumerate(branch):
                if max_depth is not None and d >= max_depth:
                    break
                key = (parent, int(token))
                if key not in children:
                    if len(tok) >= limit:
                        break
                    children[key] = len(tok)
                    tok.append(int(token))
                    par.append(parent)
                parent = children[key]
        trees.append((tok, par))
    return trees


def pack_tree_lists(trees: list[tuple[list[int], list[int]]]):
    """Per row (tokens, parents) lists -> (tokens [B, S], parents [B, S], lengths [B]) tensors."""
    width = max((len(t) for t, _ in trees), default=0)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    parents = torch.full((len(trees), width), -1, dtype=torch.long)
    for b, (tok, par) in enumerate(trees):
        tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.long)
        parents[b, : len(par)] = torch.tensor(par, dtype=torch.long)
    lengths = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
    return tokens, parents, lengths
