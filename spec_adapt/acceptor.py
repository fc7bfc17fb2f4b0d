"""The accept phase as an object made per call: the acceptance rule, the kernel mode, and which path ran.

Kernel mode (`Acceptor(kernels=...)`, default from the environment variable SPEC_ADAPT_KERNELS, else "auto"):
- "auto": Triton kernels (spec_adapt.kernels) for CUDA tensors when Triton is installed, PyTorch references otherwise;
- "off": always the references;
- "force": kernels for every tensor (with TRITON_INTERPRET=1 they run on the CPU: that is how CI tests them).
Nothing here is module state: two calls in two threads each have their own Acceptor, and `paths` (operation ->
"triton" | "torch") says what ran in this call only. A different acceptance rule (the quality suite's deliberately
lossy one) is a subclass that overrides `greedy` / `rejection`; the loop and the chain's intermediate levels call
the same `accept`.

Sampling rule (`Acceptor(rule=...)`):
- "coupled" (the default): Gumbel-max coupling (spec_adapt.acceptance_rules.coupled_accept) over the step's keyed noise
  (spec_adapt.noise): every committed token is argmax(scores + g) at its position, whatever was drafted, so a seeded
  call repeats whatever the policy chose and a row samples what it samples alone. A draft model samples its drafts with
  the same noise. It accepts a model draft a little less often than rejection sampling (docs/design.md gives the
  measured cost); point-mass drafts (prompt lookup, n-grams) exactly as often;
- "rejection": lossless rejection sampling (Leviathan et al.; recursive for trees), the most acceptance a model
  draft can get, with its random numbers from torch's global generator in the order the steps draw them: equal in
  distribution, but a seeded call repeats only where every step's widths repeat.
"""

from __future__ import annotations

import copy
import functools
import os

import torch

from . import acceptance_rules as rules

MODES = ("auto", "off", "force")
RULES = ("coupled", "rejection")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kernel mode must be 'auto', 'off' or 'force', got {mode!r}.")
    return mode


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernel(mode: str, tensor: torch.Tensor) -> bool:
    return mode != "off" and triton_available() and (mode == "force" or tensor.is_cuda)


class Acceptor:
    """Greedy match or lossless rejection sampling, through a kernel or its reference (see the module docstring)."""

    lockstep = False      # rows commit in step (a target that numbers tokens by cache column; set by the loop)
    draft_probs = False   # whether the accept phase reads the draft's distributions when greedy too (a drafter that
                          # has them then returns them: DraftRequest.acceptor)
    lossy = None          # None: the target's own tokens (greedy) or distribution (sampling); else what the rule is
    judges_first = False  # True: a generate call's first token is judged with the first step's drafts, drafted from
                          # the prompt (stock's ensemble verification); False: it is the prefill's own

    def __init__(self, kernels: str | None = None, rule: str = "coupled"):
        self.mode = check_mode(kernels or os.environ.get("SPEC_ADAPT_KERNELS", "auto"))
        if rule not in RULES:
            raise ValueError(f"rule must be 'coupled' or 'rejection', got {rule!r}.")
        self.rule = rule
        self.paths: dict[str, str] = {}

    def for_call(self) -> "Acceptor":
        """A copy with its own `paths`, so a user's acceptor shared by several calls reports each call apart."""
        fresh = copy.copy(self)
        fresh.paths = {}
        return fresh

    def accept(self, scores, draft_tokens, draft_probs, lengths, sampling: bool, noise=None):
        """scores [B, S+1, V] processed target scores; draft_tokens [B, S]; draft_probs [B, S, V] or None (point
        mass); lengths [B]; noise: the step's keyed noise (spec_adapt.noise.StepNoise; sampling, rule "coupled"),
        None = Gumbel noise from torch's global generator. Returns (accepted [B], next_token [B]); with `lockstep`,
        every row accepts as many as the row that accepted fewest (`spec_adapt.acceptance_rules.lockstep`)."""
        if not sampling:
            accepted, next_token = self.greedy(scores, draft_tokens, lengths)
        elif self.rule == "coupled":
            accepted, next_token = self.coupled(scores, draft_tokens, lengths,
                                                _gumbels(noise, scores, draft_tokens.shape[1] + 1))
        else:
            batch, width = draft_tokens.shape
            uniforms, exponentials = rules.sample_randoms(batch, width, scores.shape[-1], scores.device)
            accepted, next_token = self.rejection(scores.softmax(dim=-1), draft_tokens, draft_probs, lengths,
                                                  uniforms, exponentials)
        return rules.lockstep(accepted, next_token, draft_tokens) if self.lockstep else (accepted, next_token)

    def accept_tree(self, scores, draft_tokens, parents, draft_probs, lengths, sampling: bool, noise=None):
        """A token tree (spec_adapt.tree): scores [B, S+1, V] of the root and the nodes; parents [B, S]. Returns
        (path [B, S] bool, accepted [B], next_token [B]): the accepted nodes, a chain down from the root. Under the
        coupled rule a column's noise is its depth's position (siblings share their parent's position), and the walk
        follows the child equal to argmax(scores + g) there."""
        if not sampling:
            return self.tree_greedy(scores, draft_tokens, parents, lengths)
        if self.rule == "coupled":
            depths = rules.tree_depths(parents)                                        # [B, S+1]
            window = _gumbels(noise, scores, int(depths.max()) + 1 if depths.numel() else 1)
            index = depths[..., None].expand(-1, -1, scores.shape[-1]).to(window.device)
            return self.tree_coupled(scores, draft_tokens, parents, lengths, window.gather(1, index))
        batch, width = draft_tokens.shape
        uniforms, exponentials = rules.sample_randoms(batch, width, scores.shape[-1], scores.device)
        return self.tree_rejection(scores.softmax(dim=-1), draft_tokens, parents, draft_probs, lengths, uniforms,
                                   exponentials)

    def coupled(self, scores, draft_tokens, lengths, gumbels):
        """The coupled rule (spec_adapt.acceptance_rules.coupled_accept): the greedy rule (`greedy`, its kernel where it
        runs) over scores + noise, so a subclass's greedy rule applies to sampling too. `paths` names it "coupled"."""
        out = self.greedy(scores.float() + gumbels.to(scores.device), draft_tokens, lengths)
        self.paths["coupled"] = self.paths.pop("greedy", "torch")
        return out

    def tree_coupled(self, scores, draft_tokens, parents, lengths, gumbels):
        """The coupled rule down a tree: the greedy walk (`tree_greedy`) over scores + each column's noise."""
        out = self.tree_greedy(scores.float() + gumbels.to(scores.device), draft_tokens, parents, lengths)
        self.paths["tree_coupled"] = self.paths.pop("tree_greedy", "torch")
        return out

    def tree_greedy(self, logits, draft_tokens, parents, lengths):
        self.paths["tree_greedy"] = "torch"
        return rules.tree_greedy_accept(logits, draft_tokens, parents, lengths)

    def tree_rejection(self, target_probs, draft_tokens, parents, draft_probs, lengths, uniforms, exponentials):
        self.paths["tree_rejection"] = "torch"
        return rules.tree_rejection_sample(target_probs, draft_tokens, parents, draft_probs, lengths, uniforms,
                                            exponentials)

    def greedy(self, logits, draft_tokens, lengths):
        if self._kernel("greedy", logits):
            from .kernels.verify import greedy_verify

            return greedy_verify(logits, draft_tokens, lengths)
        return rules.greedy_accept(logits, draft_tokens, lengths)

    def rejection(self, target_probs, draft_tokens, draft_probs, lengths, uniforms, exponentials):
        if self._kernel("rejection", target_probs):
            from .kernels.verify import rejection_verify

            return rejection_verify(target_probs, draft_tokens, draft_probs, lengths, uniforms, exponentials)
        return rules.rejection_sample(target_probs, draft_tokens, draft_probs, lengths, uniforms, exponentials)

    def _kernel(self, name: str, tensor: torch.Tensor) -> bool:
        use = use_kernel(self.mode, tensor)
        self.paths[name] = "triton" if use else "torch"
        return use


class EnsembleAcceptor(Acceptor):
    """Stock's static ensemble verification (`assistant_ensemble_weight=w`, lossy by the user's choice): a row's
    drafts are judged against the mix v = w * p + (1 - w) * q of the target's distribution p and the draft's q,
    position by position, and the token after them comes from p (stock's bonus). Greedy: d_i is accepted while it is
    argmax v_i, and a rejected row's next token is argmax v there, as stock's greedy assisted generation. Sampling:
    rejection sampling with v in place of p (accept with probability v(d)/q(d) = 1 - w + w p(d)/q(d); a rejection
    samples from max(0, v - q), which normalizes to stock's max(0, p - q)). Needs the draft's distributions
    (`draft_probs`): a proposal without them is verified exactly. Its sampling rule is stock's, rejection sampling
    over torch's global generator: the coupled rule's keyed noise would judge drafts by another rule than the one
    the user asked for. As stock's first assisted step drafts from the prompt, the first token too is judged by the
    mix (`judges_first`): the loop commits none after the prefill, whose logits score the first step's first
    draft."""

    draft_probs = True
    judges_first = True

    def __init__(self, weight: float, kernels: str | None = None):
        super().__init__(kernels, rule="rejection")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 < weight < 1.0:
            raise ValueError(f"assistant_ensemble_weight must be in the open interval (0, 1), got {weight!r}.")
        self.weight = float(weight)
        self.lossy = f"assistant_ensemble_weight={weight}"

    def accept(self, scores, draft_tokens, draft_probs, lengths, sampling: bool, noise=None):
        width = draft_tokens.shape[1]
        if draft_probs is None or width == 0:
            return super().accept(scores, draft_tokens, draft_probs, lengths, sampling, noise)
        mixed = scores.float().softmax(dim=-1)
        drafted = torch.arange(width, device=scores.device)[None, :, None] < lengths[:, None, None]
        mix = self.weight * mixed[:, :width] + (1.0 - self.weight) * draft_probs[:, :width].float()
        mixed[:, :width] = torch.where(drafted, mix, mixed[:, :width])
        return super().accept(mixed.log(), draft_tokens, draft_probs, lengths, sampling)

    def accept_tree(self, scores, draft_tokens, parents, draft_probs, lengths, sampling: bool, noise=None):
        raise ValueError("assistant_ensemble_weight verifies chains of drafts: use a policy that plans no token "
                         "trees.")


def _gumbels(noise, scores, width: int) -> torch.Tensor:
    """[B, width, V] Gumbel noise at the step's first `width` positions: the keyed noise (a StepNoise) where the
    caller has one, else fresh draws."""
    if noise is None:
        from .noise import fresh_gumbel

        return fresh_gumbel((scores.shape[0], width, scores.shape[-1]), scores.device)
    return noise.window(0, width).to(scores.device)


def gather_slots_reference(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache [B, H, P, D], index [B, P'] -> cache[b, :, index[b, j], :] as [B, H, P', D]."""
    idx = index[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3])
    return cache.gather(2, idx)


def gather_slots(cache, index, mode: str = "auto"):
    """KV compaction through the kernel or its reference; returns (gathered, path)."""
    if use_kernel(mode, cache):
        from .kernels.compact import gather_slots as kernel

        return kernel(cache, index), "triton"
    return gather_slots_reference(cache, index), "torch"


def token_rank(logits, tokens, mode: str = "auto"):
    """[N, V], [N] -> (rank [N], path): entries with a logit strictly above the token's (Top-K test: rank < K)."""
    if use_kernel(mode, logits):
        from .kernels.verify import token_rank as kernel

        return kernel(logits, tokens), "triton"
    values = logits.float().gather(1, tokens[:, None].long())     # = kernels.verify.token_rank_reference
    return (logits.float() > values).sum(dim=1), "torch"
