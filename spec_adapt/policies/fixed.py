"""The two simplest length policies: a fixed gamma, and transformers' heuristic schedule."""

from __future__ import annotations

import torch

from .policy import MAX_WIDTH, Plan, Policy, StepInfo, check_int


class FixedLength(Policy):
    """Always draft k tokens per row (k = 0: plain decoding through the speculative loop), from whichever source:
    with the several-source drafter, prompt lookup and the suffix index draft at most k tokens a row too."""

    needs_timing = False
    width_binds_free = True

    def __init__(self, k: int):
        self.k = check_int("FixedLength(k)", k, 0, MAX_WIDTH)

    def choose(self, info: StepInfo):
        return self.k

    def state_dict(self):
        return {"k": self.k}

    def load_state_dict(self, state):
        self.k = check_int("FixedLength(k)", state["k"], 0, MAX_WIDTH)

    def __repr__(self):
        return f"FixedLength({self.k})"


class FixedTree(Policy):
    """Draft a tree of up to `nodes` nodes per row, no node deeper than `depth` (spec_adapt.tree). A drafter that
    cannot branch drafts a chain of min(nodes, depth) tokens instead. FixedTree(n, depth=n) allows a chain.
    `pooled=True`: the step's budget is nodes x rows, spent on the batch's likeliest nodes in any row (a draft
    model ranks across rows; model-free drafters keep `nodes` per row)."""

    needs_timing = False
    trees = True          # its plans have a depth: the call checks the target can verify trees

    def __init__(self, nodes: int, depth: int, pooled: bool = False):
        self.nodes = check_int("FixedTree(nodes)", nodes, 1, MAX_WIDTH)
        self.depth = check_int("FixedTree(depth)", depth, 1, MAX_WIDTH)
        if depth > nodes:
            raise ValueError(f"FixedTree(nodes={nodes}, depth={depth}): a tree of {nodes} nodes is at most {nodes} "
                             "deep; use depth <= nodes.")
        if not isinstance(pooled, bool):
            raise ValueError(f"FixedTree(pooled) must be True or False, got {pooled!r}.")
        self.pooled = pooled

    def choose(self, info: StepInfo):
        return Plan(self.nodes, depth=self.depth, pooled=self.pooled)

    def state_dict(self):
        return {"nodes": self.nodes, "depth": self.depth, "pooled": self.pooled}

    def load_state_dict(self, state):
        self.__init__(state["nodes"], state["depth"], state.get("pooled", False))

    def __repr__(self):
        pooled = ", pooled=True" if self.pooled else ""
        return f"FixedTree(nodes={self.nodes}, depth={self.depth}{pooled})"


class Heuristic(Policy):
    """transformers' `num_assistant_tokens_schedule="heuristic"`, per row: +2 after a step in which every drafted
    token was accepted, else -1 (never below `minimum`). Rows start at `initial` (stock: 20) in every call."""

    needs_timing = False

    def __init__(self, initial: int = 20, minimum: int = 1, maximum: int = 64):
        self.initial = check_int("Heuristic(initial)", initial, 0)
        self.minimum = check_int("Heuristic(minimum)", minimum, 0)
        self.maximum = check_int("Heuristic(maximum)", maximum, max(self.minimum, 1), MAX_WIDTH)
        self.lengths: dict[int, int] = {}

    def begin(self, batch_size):
        self.lengths = {}

    def admit(self, rows):
        for row in rows:
            self.lengths.pop(int(row), None)

    def choose(self, info: StepInfo):
        return torch.tensor([self.lengths.get(int(r), self.initial) for r in info.rows], dtype=torch.long)

    def observe(self, record):
        for row, gamma, drafted, accepted in zip(record.rows, record.gammas, record.drafted, record.accepted):
            current = self.lengths.get(row, self.initial)
            if drafted == 0:          # nothing was tried, nothing learned
                continue
            step = 2 if accepted == drafted else -1
            self.lengths[row] = min(self.maximum, max(self.minimum, current + step))

    def reset(self):
        self.lengths = {}

    def state_dict(self):
        return {"initial": self.initial, "minimum": self.minimum, "maximum": self.maximum}

    def load_state_dict(self, state):
        self.__init__(state["initial"], state["minimum"], state["maximum"])

    def __repr__(self):
        return f"Heuristic(initial={self.initial})"
