"""Logits processors applied position by position, as ordinary generation would apply them.

In a verification pass the score at position i of row b is conditioned on the row's committed tokens plus the first i
drafted tokens, so a processor that reads `input_ids` (repetition penalty, min_new_tokens, no_repeat_ngram, ...) must
see exactly that context, with the length stock generate would have had. Processors that only transform the scores
(temperature, top-k, top-p, ...) are applied to all positions in one call.
"""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from .tree import node_contexts

# Processors whose output does not depend on input_ids.
_CONTEXT_FREE = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TopHLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "InfNanRemoveLogitsProcessor",
        "LogitNormalization", "SuppressTokensLogitsProcessor",
    )
    if hasattr(lp, name)
)


class ScoreProcessor:
    """Wraps a LogitsProcessorList. `__call__` processes one score vector per (context, length) pair."""

    def __init__(self, processors: LogitsProcessorList | None):
        self.processors = processors if processors is not None else LogitsProcessorList()
        self.context_free = all(isinstance(p, _CONTEXT_FREE) or getattr(p, "context_free", False)
                                for p in self.processors)
        # A processor that keeps per-row parameters of its own (serving's RowSampling) answers `for_rows`.
        self.row_aware = any(hasattr(p, "for_rows") for p in self.processors)

    def __bool__(self) -> bool:
        return len(self.processors) > 0

    def __call__(
        self,
        scores: torch.Tensor,     # [N, V] float32
        contexts: torch.Tensor,   # [N, Lmax] long: the token buffer rows these scores condition on
        lengths: torch.Tensor,    # [N] long: context length of each score (tokens contexts[n, :lengths[n]])
        rows: torch.Tensor,       # [N] long: each score's row in the user's batch (for row-aware processors)
    ) -> torch.Tensor:
        if not self.processors:
            return scores
        if self.context_free and not self.row_aware:
            return self.processors(contexts[:, :1], scores)
        if self.context_free:
            for processor in self.processors:
                scores = _for_rows(processor, rows)(contexts[:, :1], scores)
            return scores
        out = torch.empty_like(scores)
        for length in lengths.unique().tolist():
            idx = (lengths == length).nonzero().squeeze(1)
            processors = [_for_rows(p, rows[idx]) for p in self.processors]
            group_scores, group_ids = scores[idx].clone(), contexts[idx, :length]
            for processor in processors:
                group_scores = processor(group_ids, group_scores)
            out[idx] = group_scores
        return out

    def positions(
        self,
        scores: torch.Tensor,      # [B, W, V]: position i of row b conditions on buffer[b, :base[b] + i]
        buffer: torch.Tensor,      # [B, Lmax] long: committed tokens followed by this step's drafts
        base: torch.Tensor,        # [B] long: committed length of each row
        n_positions: torch.Tensor, # [B] long: positions that matter per row (the rest are left unprocessed)
        rows: torch.Tensor,        # [B] long: the rows' indices in the user's batch
    ) -> torch.Tensor:
        if not self.processors:
            return scores
        batch, width, vocab = scores.shape
        offset = torch.arange(width, device=scores.device)
        used = offset[None, :] < n_positions[:, None]                    # [B, W]
        used_rows, cols = used.nonzero(as_tuple=True)
        processed = self(scores[used_rows, cols], buffer[used_rows], base[used_rows] + cols, rows[used_rows])
        out = scores.clone()
        out[used_rows, cols] = processed
        return out


def _for_rows(processor, rows: torch.Tensor):
    """A view of a processor that keeps per-row state, restricted to `rows` of the user's batch. The processors
    transformers builds from a generation config that hold per-row state are these four; the others read only
    input_ids and the scores (tests/test_processors.py runs each at batch 3). A processor of spec_adapt's own that
    keeps per-row state gives its view by `for_rows`."""
    if hasattr(processor, "for_rows"):
        return processor.for_rows(rows)
    if isinstance(processor, lp.EncoderNoRepeatNGramLogitsProcessor):
        view = copy.copy(processor)
        view.batch_size, view.generated_ngrams = len(rows), [processor.generated_ngrams[r] for r in rows.tolist()]
        return view
    if isinstance(processor, lp.EncoderRepetitionPenaltyLogitsProcessor):
        view = copy.copy(processor)
        view.encoder_input_ids = processor.encoder_input_ids[rows.to(processor.encoder_input_ids.device)]
        return view
    ignore = getattr(processor, "prompt_ignore_length", None)
    if isinstance(processor, lp.RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor):
        view = copy.copy(processor)
        view.prompt_ignore_length = ignore.to(rows.device)[rows]
        return view
    if isinstance(processor, lp.PrefixConstrainedLogitsProcessor):
        view = copy.copy(processor)
        row_list, fn = rows.tolist(), processor._prefix_allowed_tokens_fn
        view._prefix_allowed_tokens_fn = lambda batch_id, sent: fn(row_list[batch_id], sent)
        return view
    return processor


def tree_positions(process: ScoreProcessor, scores, buffer, base, tokens, anc, depth, n_nodes, rows):
    """ScoreProcessor.positions for a token tree: column 0 (the root) conditions on the committed tokens, column
    i + 1 on them and node i's ancestors-or-self (spec_adapt.tree). scores [B, S+1, V]; tokens, depth [B, S];
    anc [B, S, S]; n_nodes [B]."""
    if not process:
        return scores
    batch, width = tokens.shape
    contexts = node_contexts(buffer, base, tokens, anc, depth)                     # [B, S, L]
    contexts = torch.cat([contexts.new_zeros(batch, 1, contexts.shape[2]), contexts], dim=1)
    contexts[:, 0, : buffer.shape[1]] = buffer
    lengths = base[:, None] + torch.cat([depth.new_zeros(batch, 1), depth], dim=1)  # [B, S+1]
    used = torch.arange(width + 1, device=scores.device)[None, :] < n_nodes[:, None] + 1
    b, c = used.nonzero(as_tuple=True)
    out = scores.clone()
    out[b, c] = process(scores[b, c], contexts[b, c], lengths[b, c], rows[b])
    return out
