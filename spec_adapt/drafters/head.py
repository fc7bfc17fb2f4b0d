"""A draft model's vocabulary projection cut to the tokens it is likely to need (FR-Spec's frequency-ranked draft
head, with the set learned from the call instead of a corpus).

On the Qwen2.5-Coder 0.5B draft the projection onto 151,936 tokens is a fifth to a quarter of a batch-1 draft step
(bf16 and fp32); `benchmarks/draft_head.py` measures both this and the coverage below.
A draft only has to propose what the target will accept, and the target verifies with its own full head, so scoring
a subset is lossless: greedy drafts are the argmax over the subset, sampled drafts come from the softmax over the
subset (zero elsewhere, which rejection sampling handles exactly).

Which subset: byte-level BPE numbers tokens in merge order, so low ids are the frequent ones; but chat answers also
use rare high-id tokens ('```', 'Certainly', identifiers from the prompt). Measured on 32 HumanEval-chat and 32
ShareGPT prompts (0.5B greedy answers, 48 tokens): the 32,768 lowest ids cover 94.1% / 93.4% of answer tokens; with
the special tokens and the prompt's own tokens, 96.4% / 95.8%. So the head keeps the `size` lowest ids, the special
tokens, every prompt token and every token the target committed in earlier calls (the set only grows).
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
from torch import nn

from ..compat import output_cache, with_cache
from ..ledger import select_positions


class ShortHead(nn.Module):
    """Runs `model` (a causal LM) with its vocabulary projection restricted to `self.keep` (bool [V]); logits of the
    other tokens are -inf. Stands in for the model wherever a KV ledger runs it."""

    def __init__(self, model, size: int):
        super().__init__()
        head = model.get_output_embeddings()
        if model.base_model is model or not isinstance(head, nn.Linear):
            raise ValueError(
                f"head_tokens needs a causal LM with a body (`base_model`) and a linear output head; "
                f"{type(model).__name__} has neither a separate body nor an nn.Linear head. Leave head_tokens=None."
            )
        vocab = head.weight.shape[0]
        if not 0 < size <= vocab:
            raise ValueError(f"head_tokens must be within [1, {vocab}] (the draft's vocabulary), got {size!r}.")
        self.model, self.head, self.config = model, head, model.config
        self.keep = torch.zeros(vocab, dtype=torch.bool)
        self.keep[:size] = True
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = getattr(model.config, name, None)
            for i in ids if isinstance(ids, (list, tuple)) else [ids]:
                if i is not None and 0 <= int(i) < vocab:
                    self.keep[int(i)] = True
        self._ids = self._weight = self._bias = None

    @property
    def device(self):
        return self.model.device

    @property
    def size(self) -> int:
        return int(self.keep.sum())

    def add(self, tokens: torch.Tensor) -> None:
        """Score these token ids from now on (the projection is rebuilt once, at the next forward)."""
        ids = tokens.reshape(-1).cpu()
        ids = ids[(ids >= 0) & (ids < len(self.keep))]
        if not bool(self.keep[ids].all()):
            self.keep[ids] = True
            self._ids = None

    def _projection(self):
        weight = self.head.weight
        if self._ids is None or self._ids.device != weight.device:       # new tokens, or the draft moved (offload)
            self._ids = self.keep.nonzero().squeeze(1).to(weight.device)
            self._weight = weight.index_select(0, self._ids)
            self._bias = self.head.bias.index_select(0, self._ids) if self.head.bias is not None else None
        return self._ids, self._weight, self._bias

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True,
                logits_to_keep=0):
        body = self.model.base_model
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=use_cache, **with_cache(body, cache))
        hidden = select_positions(out.last_hidden_state, logits_to_keep)
        ids, weight, bias = self._projection()
        scores = nn.functional.linear(hidden, weight, bias)
        logits = hidden.new_full((*hidden.shape[:-1], len(self.keep)), float("-inf"))
        logits.index_copy_(-1, ids, scores)
        return SimpleNamespace(logits=logits, cache=output_cache(out))


def check_short_head(short: ShortHead) -> None:
    """Refuse a model whose logits are not its body's last hidden state through the linear head (final soft-capping,
    logit scaling): the cut head would then score differently from the model for no reason a user could see.
    Checked once per model (one forward of each)."""
    model = short.model
    if model in _CHECKED:
        return
    ids = short.keep.nonzero()[:8].reshape(1, -1).to(model.device)      # a few tokens (the pad's embedding may be 0)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0, -1]
        cut = short(input_ids=ids, use_cache=False).logits[0, -1]
    kept = short.keep.to(full.device)
    if not torch.allclose(full[kept].float(), cut[kept].float(), rtol=1e-3, atol=1e-3):
        raise ValueError(
            f"head_tokens: {type(model).__name__}'s logits are not its body's output through its linear head "
            "(soft-capping or logit scaling?), so its head cannot be cut. Leave head_tokens=None for this draft."
        )
    _CHECKED.add(model)


_CHECKED: "weakref.WeakSet" = weakref.WeakSet()
