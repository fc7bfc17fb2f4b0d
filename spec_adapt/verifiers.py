"""Phase 2 of the step, verification: the target scores the last committed token and the drafts.

A `Verifier` feeds the chunk [B, W] (row b's first n_valid[b] positions valid: the last committed token and its
drafts) into the target's KV ledger and returns the target's logits. It may keep fewer positions of a row than it
was given (`kept[b] < n_valid[b]`): the loop then cuts that row's proposal to `kept[b]` drafts and gives it no bonus
token (see `Verification`). Either way the accept phase judges every draft it keeps with the target's full logits,
so the output stays exactly the target's.

- `FullVerifier`: one full forward (what stock assisted generation does).
- `EarlyExitVerifier`: FASER's Top-K early exit. It runs the target layer by layer; at a checkpoint layer it
  projects the hidden state of each position i that scores a draft through the final norm and the LM head and
  counts the vocabulary entries above the drafted d_{i+1}. When d_{i+1} ranks >= K, the row's positions after i are
  predicted rejected and leave the remaining layers (the batch narrows to its widest surviving row); position i
  stays to full depth, so d_{i+1} is still judged by full logits. Why that is lossless, greedy and sampling: which
  drafts get verified is decided from the drafts before them (d_{i+2} is dropped because of d_{i+1}), a stopping
  rule like any draft length; no draft is dropped because of its own value, and every kept one is judged exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .acceptor import token_rank
from .compat import attn_implementation, create_causal_mask, takes_4d_mask, with_cache
from .running_estimates import ProbeBackoff, bucket, mean_then_ema
from .policies.cost import FULL
from .ledger import on_device, positions_from_cache
from .model_kinds import check_tree_attention

SUPPORTED = ("llama", "qwen2", "mistral")     # decoder layers with the Llama call signature and a final RMSNorm


@dataclass
class Verification:
    """logits [B, W', V] of the kept positions; kept [B]: positions kept per row (n_valid[b] when not cut).

    A row with kept[b] = k < n_valid[b] keeps drafts d_1..d_k (position k - 1 scores d_k; the dropped position k
    would have scored d_{k+1} or given the bonus token), so it commits d_k with no token after it when all of its
    kept drafts are accepted.

    hidden [B, W', H]: the target's last hidden states at the kept positions, where the ledger keeps them
    (`KVLedger.want_hidden`, for a drafter with `wants_hidden`) and the verifier hands them on (`hands_hidden`); else
    None."""

    logits: torch.Tensor
    kept: torch.Tensor
    hidden: torch.Tensor | None = None


class Verifier:
    """The verification phase. `check(model)` validates once per call, `begin()` starts a call's counters,
    `verify` runs one step, `report()` gives the call's counters to SpecStats.verifier.

    A verifier with `trees = True` also verifies token trees: `verify(..., parents=...)` with the chunk's parents
    [B, W] (spec_adapt.tree.chunk_tree), which it hands to the ledger's forward; it keeps every position."""

    trees = False
    rank_local = False   # True: decides from this process's own timings, which ranks of a sharded target disagree on
    hands_hidden = False  # True: its Verification carries the target's last hidden states when the ledger keeps them
    path = FULL          # the path its last verification took ("full"; "pruned": an early exit), for the StepRecord
    cost = None          # the call's step-cost model, to read (a CostReader the loop hands over: `share_cost`)

    def check(self, model) -> None:
        pass

    def begin(self) -> None:
        pass

    def verify(self, ledger, chunk: torch.Tensor, n_valid: torch.Tensor) -> Verification:
        raise NotImplementedError

    def observe(self, record) -> None:
        """After every step: its StepRecord (committed tokens, step time), e.g. to learn whether a path pays."""

    def report(self) -> dict:
        """This call's counters for SpecStats."""
        return {}


class FullVerifier(Verifier):
    """One full forward of the chunk through the target (a tree's nodes each see their ancestors only)."""

    trees = True
    hands_hidden = True

    def verify(self, ledger, chunk, n_valid, parents=None):
        logits = ledger.forward(chunk, n_valid, parents=parents)
        return Verification(logits, on_device(n_valid, ledger.device), ledger.hidden)

    def __repr__(self):
        return "FullVerifier()"


def check_verifier(verifier) -> "Verifier":
    if verifier is None:
        return FullVerifier()
    if not isinstance(verifier, Verifier):
        raise TypeError(
            f"verifier must be a spec_adapt Verifier (FullVerifier() or EarlyExitVerifier(...)), got "
            f"{type(verifier).__name__}."
        )
    return verifier


def check_trees(model, verifier) -> None:
    """Token trees need a verifier that takes them and a target that takes a 4-D attention mask."""
    if not getattr(verifier, "trees", False):
        raise ValueError(f"The policy plans token trees, but {verifier!r} verifies chains only: use FullVerifier(), "
                         "or a policy without depth (FixedLength, Adaptive).")
    check_tree_attention(model)
    reason = positions_from_cache(model)
    if reason is not None:
        raise ValueError(f"Token trees give sibling nodes one position and different cache columns, but {reason}: "
                         "draft chains (a policy without depth) for this model.")


@dataclass
class PruneStats:
    steps: int = 0                 # verify steps run layer by layer (the pruning path)
    full_steps: int = 0            # verify steps run as one forward (the gate chose it, or nothing to test)
    tested: int = 0                # (position, checkpoint) rank tests
    pruned: int = 0                # positions dropped before the last layer
    layers_saved: int = 0          # position-layers not computed (rows x dropped columns x layers after the cut)
    per_layer: dict = field(default_factory=dict)   # checkpoint -> {"tested": n, "pruned": n}


class EarlyExitVerifier(Verifier):
    """Top-K early exit inside the target's forward (FASER). See the module docstring for why it is lossless.

    layers: checkpoint layer indices (0-based; after that layer's output), or None = the middle layer. top_k: K.
    gate: "auto" (the cost model below), "always" or "never" (prune on every step / never: for measurements).

    Cost model ("auto"): pruning trades a projection through the LM head per tested position (for a 150k
    vocabulary about as much as several decoder layers) against the layers the dropped positions skip, what a
    skipped position saves depends on whether this device is compute-bound at this shape (on a CPU at batch 1 a
    forward costs the weights' read, whatever the width), and a wrong prediction costs accepted tokens. All of it is
    measured rather than guessed: the gate reads the call's step-cost model (`Verifier.cost`, which the call's
    one writer observes each step into on the path it took: each path's verification time by batch size and width,
    "full" and "pruned", the drafting and the host work), and keeps each path's mean committed tokens per step
    itself (tokens, not a step time); per (batch bucket, chunk width) it takes the path with the fewer seconds per
    committed token, trying the other path after 8 steps, then after twice as many each time the other path loses
    again (`ProbeBackoff`), so a change of regime is still seen.
    """

    rank_local = True

    def __init__(self, layers=None, top_k: int = 10, gate: str = "auto"):
        if gate not in ("auto", "always", "never"):
            raise ValueError(f"gate must be 'auto', 'always' or 'never', got {gate!r}.")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}.")
        self.layers, self.top_k, self.gate = layers, top_k, gate
        self.stats = PruneStats()
        self.timing: dict = {}         # (bucket, width) -> {"full": [tokens, n], "pruned": [tokens, n], "probes": ...}
        self._checkpoints: tuple[int, ...] = ()
        self.kernels = "auto"
        self._full = FullVerifier()        # the path the gate compares against

    def __repr__(self):
        return f"EarlyExitVerifier(layers={self.layers}, top_k={self.top_k}, gate={self.gate!r})"

    # -- validation ------------------------------------------------------------------------------------------------
    def check(self, model) -> None:
        kind = getattr(model.config, "model_type", None)
        base = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if kind not in SUPPORTED or base is None or not all(hasattr(base, n) for n in needed):
            raise ValueError(
                f"EarlyExitVerifier runs Llama- and Qwen2-style decoders ({', '.join(SUPPORTED)}), not "
                f"{kind!r}. Use FullVerifier() (the default) for this model."
            )
        if not takes_4d_mask(model):
            raise ValueError(
                f"EarlyExitVerifier needs attn_implementation 'sdpa' or 'eager' (it narrows the attention mask "
                f"mid-forward), got {attn_implementation(model)!r}. Load the target with attn_implementation='sdpa'."
            )
        if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
            raise ValueError("EarlyExitVerifier does not support sliding-window layers; use FullVerifier().")
        depth = len(base.layers)
        layers = [min(depth // 2, depth - 2)] if self.layers is None else list(self.layers)
        bad = [x for x in layers if not isinstance(x, int) or not 0 <= x < depth - 1]
        if bad or not layers or depth < 2:
            raise ValueError(f"EarlyExitVerifier layers must be ints in [0, {depth - 2}] (a checkpoint after the last "
                             f"layer saves nothing), got {self.layers!r}.")
        self._checkpoints = tuple(sorted(set(layers)))

    def begin(self) -> None:
        self.stats = PruneStats()          # per call; what the gate learned (`timing`) carries over

    # -- one step ----------------------------------------------------------------------------------------------------
    def verify(self, ledger, chunk, n_valid, parents=None):
        if parents is not None:
            raise ValueError("EarlyExitVerifier verifies chains only; use FullVerifier() with token trees.")
        self.kernels = ledger.kernels
        batch, width = chunk.shape
        self.path = FULL
        if width < 2:                                 # nothing drafted: nothing to test
            self.stats.full_steps += 1
            return self._full.verify(ledger, chunk, n_valid)
        key = (bucket(batch), width)
        path = self.path = self._choose(key, batch)
        if path == "full":
            result = self._full.verify(ledger, chunk, n_valid)
            self.stats.full_steps += 1
        else:
            logits, kept = ledger.forward_pruned(chunk, n_valid, self._run)
            result = Verification(logits, kept)
            self.stats.steps += 1
        self._last = (key, path, batch)
        return result

    def observe(self, record) -> None:
        # The gate's measure is the step's seconds per committed token, not the verify time alone: a cut saves
        # verification time and costs the tokens its wrong predictions drop (a pruned path can verify faster and
        # still lose, committing fewer tokens per step). The times are the call's writer's; the tokens the gate's.
        last, self._last = getattr(self, "_last", None), None
        if last is not None:
            key, path, batch = last
            self._observe(key, path, batch, sum(record.committed) / max(1, record.batch_size))

    def _run(self, model, tokens, n_valid, mask2d, position_ids, cache, past):
        base = model.model
        hidden = base.embed_tokens(tokens)
        if mask2d is None:      # an explicit mask, so that narrowing can slice it (q > 1 never skips the mask)
            mask2d = torch.ones(tokens.shape[0], past + tokens.shape[1], dtype=torch.long, device=tokens.device)
        mask = create_causal_mask(base.config, hidden, mask2d, cache, position_ids=position_ids)
        cos, sin = base.rotary_emb(hidden, position_ids)
        alive = n_valid                                   # positions each row still carries
        width = tokens.shape[1]
        for index, layer in enumerate(base.layers):
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), position_ids=position_ids,
                           use_cache=True, **with_cache(layer, cache))
            if index not in self._checkpoints or width < 2:
                continue
            alive = self._test(model, index, hidden, tokens, alive)
            narrow = int(alive.max())
            if narrow < width:
                self.stats.layers_saved += tokens.shape[0] * (width - narrow) * (len(base.layers) - index - 1)
                hidden, cos, sin, position_ids = (hidden[:, :narrow], cos[:, :narrow], sin[:, :narrow],
                                                  position_ids[:, :narrow])
                if mask is None:
                    raise RuntimeError("EarlyExitVerifier: the model built no attention mask to narrow")
                mask = mask[..., :narrow, : past + narrow]
                tokens = tokens[:, :narrow]
                for done in cache.layers[: index + 1]:      # layers that already wrote the dropped columns
                    done.keys, done.values = done.keys[:, :, : past + narrow], done.values[:, :, : past + narrow]
                width = narrow
        return model.lm_head(base.norm(hidden)), alive

    def _test(self, model, index, hidden, tokens, alive):
        """Cut each row after its first position i whose draft d_{i+1} ranks >= K at this layer."""
        width = tokens.shape[1]
        i = torch.arange(width - 1, device=tokens.device)[None, :]
        rows, pos = (i < alive[:, None] - 1).nonzero(as_tuple=True)      # positions that score a kept draft
        counts = self.stats.per_layer.setdefault(index, {"tested": 0, "pruned": 0})
        if not len(rows):
            return alive
        logits = model.lm_head(model.model.norm(hidden[rows, pos]))      # [N, V]
        rank, _ = token_rank(logits, tokens[rows, pos + 1], self.kernels)
        bad = rank >= self.top_k
        cut = torch.full_like(alive, width)
        cut.scatter_reduce_(0, rows[bad], pos[bad] + 1, reduce="amin")
        new = torch.minimum(alive, cut)
        counts["tested"] += len(rows)
        counts["pruned"] += int((alive - new).sum())
        self.stats.pruned += int((alive - new).sum())
        self.stats.tested += len(rows)
        return new

    # -- the cost model ------------------------------------------------------------------------------------------------
    def _per_token(self, key, batch: int, path: str) -> float:
        """A step's seconds per committed token on this path: its verification, its drafting and host work (the
        same on either path), over the tokens per row it commits."""
        tokens = self.timing[key][path][0]
        return self.cost.step_time(batch, key[1], {"model": key[1] - 1}, path) / max(tokens, 1e-9)

    def _choose(self, key, batch: int) -> str:
        if self.gate != "auto":
            return "pruned" if self.gate == "always" else "full"
        entry = self.timing.setdefault(key, {"full": None, "pruned": None, "probes": ProbeBackoff(8, 1 << 16)})
        for path in ("pruned", "full"):             # two samples of each path first
            if entry[path] is None or entry[path][1] < 2:
                return path
        best = min(("full", "pruned"), key=lambda p: self._per_token(key, batch, p))
        entry["probes"].wait()
        if entry["probes"].due():
            entry["probing"] = best
            return "pruned" if best == "full" else "full"          # a probe of the path that is losing
        return best

    def _observe(self, key, path, batch: int, tokens: float) -> None:
        if self.gate != "auto":
            return
        entry = self.timing[key]
        entry[path] = mean_then_ema(entry[path], tokens, 1 / 32)     # a mean over the recent past
        best = entry.pop("probing", None)
        if best is not None:        # the probe wins if it now predicts fewer seconds per token than the path it challenged
            entry["probes"].result(won=self._per_token(key, batch, path) < self._per_token(key, batch, best))

    def report(self) -> dict:
        s = self.stats
        return {"pruned_steps": s.steps, "full_steps": s.full_steps, "tested": s.tested, "pruned": s.pruned,
                "layers_saved": s.layers_saved, "per_layer": {k: dict(v) for k, v in s.per_layer.items()}}

