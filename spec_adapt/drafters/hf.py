"""Any transformers `CandidateGenerator` as a batched spec_adapt drafter (one generator per row).

transformers' own speculative decoding runs one sequence at a time through a `CandidateGenerator`
(`get_candidates(input_ids [1, L]) -> (candidate_ids [1, L + k], logits)`, then
`update_candidate_strategy(input_ids, scores, num_matches)`). `CandidateGeneratorDrafter(make)` keeps one generator per
row of the batch, made by `make(ids [1, L])` from the row's unpadded context when it first drafts, and asks each for its row's
continuation. The policy chooses the length: before each call the adapter sets the generator's own length knob where
it has one (`num_assistant_tokens`, `num_output_tokens`) to the row's gamma, and cuts what comes back to gamma.

Drafts are verified as point masses, which is exact for deterministic generators (prompt lookup, a greedy
assistant model, early-exit self-drafting with greedy drafts). A generator that samples its drafts would need its
own q, so it is refused in sampling mode with a clear error (which takes the drafter fallback).
"""

from __future__ import annotations

from typing import Callable

import torch

from .drafter import Drafter, DraftRequest, Proposal, left_padding

_LENGTH_KNOBS = ("num_assistant_tokens", "num_output_tokens")


class CandidateGeneratorDrafter(Drafter):
    def __init__(self, make: Callable[[torch.Tensor], object]):
        """`make(ids [1, L]) -> CandidateGenerator` for one row (its context without padding, when it first drafts:
        the prompt and the first token, which the target's prefill produced)."""
        self.make = make
        self.generators: dict[int, object] = {}
        self.pad: list[int] | None = None
        self.asked: dict[int, tuple[int, int]] = {}      # row -> (its length when asked, tokens proposed)
        self.active: list[int] = []                        # the user's rows of the last proposal, in batch order

    @classmethod
    def prompt_lookup(cls, max_matching_ngram_size: int = 2) -> "CandidateGeneratorDrafter":
        """transformers' PromptLookupCandidateGenerator, per row."""
        from ..compat import PromptLookupCandidateGenerator

        return cls(lambda ids: PromptLookupCandidateGenerator(
            max_matching_ngram_size=max_matching_ngram_size, max_length=1 << 30))

    @classmethod
    def assisted(cls, draft_model) -> "CandidateGeneratorDrafter":
        """transformers' AssistedCandidateGenerator with a draft model (greedy drafts), per row."""
        from transformers import GenerationConfig
        from ..compat import AssistedCandidateGenerator

        def make(ids):
            config = GenerationConfig(do_sample=False, max_length=1 << 30, min_length=0, eos_token_id=None)
            generator = AssistedCandidateGenerator(
                ids.to(draft_model.device), draft_model, config, {"attention_mask": torch.ones_like(ids)})
            generator.assistant_generation_config.assistant_confidence_threshold = None   # the policy decides
            generator.generation_config.assistant_confidence_threshold = None
            return generator

        return cls(make)

    def begin(self, input_ids, attention_mask):
        self.pad = left_padding(input_ids, attention_mask)
        self.generators, self.asked = {}, {}     # a row's generator is made at its first proposal, from its context

    def propose(self, request: DraftRequest) -> Proposal:
        if request.sampling:
            raise NotImplementedError("CandidateGeneratorDrafter verifies drafts as point masses: use it for greedy "
                                      "decoding (or a spec_adapt drafter that returns its probabilities)")
        drafts, self.asked, self.active = [], {}, request.rows.tolist()
        for b, (row, length, gamma) in enumerate(
            zip(request.rows.tolist(), request.lengths.tolist(), request.gammas.tolist())
        ):
            found = torch.zeros(0, dtype=torch.long)
            if gamma:
                ids = request.tokens[b : b + 1, self.pad[row] : length]
                if row not in self.generators:
                    self.generators[row] = self.make(ids)
                found = self._candidates(self.generators[row], ids, gamma)
                self.asked[row] = (length, found.numel())
            drafts.append(found)
        return Proposal.pack(drafts, request.tokens.device)

    @staticmethod
    def _candidates(generator, ids: torch.Tensor, gamma: int) -> torch.Tensor:
        for knob in _LENGTH_KNOBS:
            if hasattr(generator, knob):
                setattr(generator, knob, gamma)
        candidates, _ = generator.get_candidates(ids)
        return candidates[0, ids.shape[1] :][:gamma].cpu().long()

    def rollback(self, keep_len):
        """Tell each generator how many of its candidates were accepted (its own strategy update). The active rows
        are those of the last proposal: rollback follows verification, before finished rows leave."""
        for row, keep in zip(self.active, keep_len.tolist()):
            if row in self.asked:
                length, proposed = self.asked[row]
                scores = torch.zeros(1, proposed + 1, 1)       # only its shape is read: candidates + 1
                self.generators[row].update_candidate_strategy(None, scores, max(0, keep - length))

    def end(self, tokens=None, lengths=None):
        self.generators, self.asked = {}, {}
