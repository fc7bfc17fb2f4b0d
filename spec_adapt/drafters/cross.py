"""A draft with its own tokenizer: batched, lossless speculation across vocabularies.

The draft reads and writes its own tokens; the target verifies its own. Text is the bridge:
- each row keeps the draft's tokens of the row's committed text: an anchored prefix, fixed where both tokenizations
  share a boundary, then a window re-encoded from the target's text at each drafting step. Only the window (the
  last few dozen target tokens at most) is decoded and encoded again, never the whole context;
- the draft's KV cache is its own ledger in draft tokens; before drafting, each row rolls back to the longest
  prefix its cache shares with the row's new draft tokens, so a window whose tokens did not change costs nothing;
- the draft's continuation is decoded to text and encoded with the target's tokenizer after the row's last
  committed target tokens; the target tokens past them are the proposal. A row whose text ends inside a character
  (byte-level tokenizers split multi-byte characters) or whose last token would merge with the drafted text
  proposes nothing that step.

Lossless by construction: proposals are point masses (q = a one-hot at the proposed token). Speculative sampling
(Leviathan et al., 2023; Chen et al., 2023) accepts d with probability min(1, p(d) / q(d)) = p(d) and resamples
from norm(max(p - q, 0)) = p without d; for any proposal drawn independently of the target's random numbers the
committed token is then distributed exactly as p. This is the point-mass case of Universal Speculative Decoding
(Timor et al., ICML 2025), which needs no mapping between the vocabularies. Greedy output is the target's own
because the target verifies every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..inputs import encoder_decoder
from ..processors import ScoreProcessor
from .drafter import (CatchUp, ChecksTarget, Drafter, DraftRequest, JoinsRows, Observes, Offloads, Proposal,
                   check_proposal, join_rows, left_padding)
from .model import ModelDrafter, head_vocab_size

KEEP = 8            # target tokens left in the window when its start moves forward
MAX_WINDOW = 64     # target tokens after which the window's start moves forward even without a shared boundary
MAX_TAIL = 8        # committed target tokens tried as the context the drafted text is encoded after
PARTIAL = "\ufffd"  # what a decoder writes for the bytes of a character cut by a token boundary


class TextBridge:
    """Text between a draft tokenizer and a target tokenizer: each side's tokens of a span of text."""

    def __init__(self, draft_tokenizer, target_tokenizer):
        for name, tokenizer in (("draft_tokenizer", draft_tokenizer), ("target_tokenizer", target_tokenizer)):
            if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
                raise TypeError(f"{name} must be a tokenizer with encode and decode (e.g. AutoTokenizer), got "
                                f"{type(tokenizer).__name__}.")
        self.draft, self.target = draft_tokenizer, target_tokenizer
        self.draft_start = _start_tokens(draft_tokenizer)

    @staticmethod
    def text(tokenizer, ids: list[int], start: int, end: int) -> str:
        """The text of ids[start:end] as it reads after ids[:start] (decoders that drop a word's leading space at
        the start of a text, as SentencePiece's do, keep it here)."""
        head = ids[max(0, start - 4):start]
        before = _decode(tokenizer, head)
        full = _decode(tokenizer, head + ids[start:end])
        return full[len(before):] if full.startswith(before) else _decode(tokenizer, ids[start:end])

    def encode_draft(self, text: str, before: str = "") -> list[int]:
        """The draft's tokens of `text` as written after `before` (the last words preceding it): a tokenizer that
        marks word starts (SentencePiece's) would otherwise begin `text` with a word start it does not have."""
        if before:
            head = self.draft.encode(before, add_special_tokens=False)
            ids = self.draft.encode(before + text, add_special_tokens=False)
            if ids[: len(head)] == head:
                return ids[len(head):]
        return self.draft.encode(text, add_special_tokens=False)

    def to_target(self, committed: list[int], text: str, most: int) -> list[int]:
        """Up to `most` target tokens that follow `committed` when `text` is written after it: `text` is encoded
        after the shortest tail of committed tokens that the target's tokenizer reproduces. [] if none does."""
        text = text.split(PARTIAL)[0]
        if not text or most <= 0:
            return []
        for k in range(1, min(len(committed), MAX_TAIL) + 1):
            tail = committed[-k:]
            head = _decode(self.target, tail)
            if PARTIAL in head:
                continue
            ids = self.target.encode(head + text, add_special_tokens=False)
            if ids[:k] == tail:
                return ids[k:k + most]
        return []


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _start_tokens(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before a text it encodes (a BOS), which the draft's rows start with."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    return full[: len(full) - len(plain)] if full[len(full) - len(plain):] == plain else []


@dataclass
class _Row:
    """One row's draft tokens: the anchored prefix covers the first `anchor_target` committed target tokens (from
    the row's first real token) with `anchor_draft` draft tokens; the rest of `draft` is the window."""
    draft: list[int]
    anchor_target: int
    anchor_draft: int
    seen: int = 0                                     # committed target tokens when the row last drafted
    fed: list[int] = field(default_factory=list)      # draft + last drafts: what the draft's cache may hold
    first: int = 0                                    # the row's first target token of text (1 after a BOS)
    buffered: list[int] = field(default_factory=list) # the row's tokens in the draft's buffer


class CrossTokenizerDrafter(CatchUp, JoinsRows, Offloads, Observes, ChecksTarget):
    """Drafts with `draft` (a causal LM, or any Drafter working in the draft tokenizer's ids) for a target whose
    tokenizer differs. `generate` builds one when it is given stock's `assistant_tokenizer=` and `tokenizer=`
    (with `custom_generate=spec_adapt.generate` or after `spec_adapt.enable`). As the first level of a ChainDrafter it drafts for a model that shares the target's
    tokenizer, which verifies before the target does.

    The draft drafts greedily in its own vocabulary (width + 1 draft tokens for a width of target tokens: the last
    target token of a text is often cut short); proposals are point masses, exact under sampling too (see the
    module docstring). The call's logits processors are the target's and are not applied to the draft's scores."""

    def __init__(self, draft, draft_tokenizer, target_tokenizer, confidence_threshold: float | None = 0.4):
        """`confidence_threshold`: a draft model's row stops drafting once its top probability falls below it
        (ModelDrafter's early exit), 0.4 as in stock's Universal Assisted Generation: a draft from another model
        family is rarely right where it is unsure, and every drafted token costs a draft forward. None = always
        draft the full width. A Drafter passed as `draft` keeps its own settings."""
        self.bridge = TextBridge(draft_tokenizer, target_tokenizer)
        if isinstance(draft, Drafter):
            self.inner = draft
        elif isinstance(draft, torch.nn.Module) and hasattr(draft, "get_output_embeddings"):
            self.inner = ModelDrafter(draft, confidence_threshold=confidence_threshold)
        else:
            raise TypeError(f"draft must be a causal LM or a Drafter in the draft tokenizer's ids, got "
                            f"{type(draft).__name__}.")
        self.rows: list[_Row] = []
        self.pad = torch.zeros(0, dtype=torch.long)   # target buffer's left padding per active row
        self.draft_pad = torch.zeros(0, dtype=torch.long)
        self.buffer = torch.zeros(0, 0, dtype=torch.long)   # [B, L] the draft's tokens, left padded per row
        self.vocab = None

    def validate(self, target) -> None:
        target_vocab = head_vocab_size(target)
        if len(self.bridge.target) > target_vocab:
            raise ValueError(f"target_tokenizer has {len(self.bridge.target)} tokens but the target's head scores "
                             f"{target_vocab}: pass the target's own tokenizer as target_tokenizer (tokenizer=).")
        self.vocab = len(self.bridge.draft)
        if isinstance(self.inner, ModelDrafter):
            if encoder_decoder(self.inner.model):
                raise ValueError(f"The draft {type(self.inner.model).__name__} is an encoder-decoder model with a "
                                 "tokenizer of its own: its encoder would need the call's source in its own tokens. "
                                 "Draft with an encoder-decoder model of the target's tokenizer, or a causal LM.")
            draft_vocab = head_vocab_size(self.inner.model)
            if len(self.bridge.draft) > draft_vocab:
                raise ValueError(f"draft_tokenizer has {len(self.bridge.draft)} tokens but the draft's head scores "
                                 f"{draft_vocab}: pass the draft's own tokenizer as draft_tokenizer "
                                 "(assistant_tokenizer=).")
            self.inner.vocab = self.vocab = draft_vocab

    def available(self) -> bool:
        return not isinstance(self.inner, Offloads) or self.inner.available()

    def begin(self, input_ids, attention_mask):
        pad = left_padding(input_ids, attention_mask)
        self.rows = [self._new_row(input_ids[b, pad[b]:].tolist()) for b in range(len(pad))]
        self.pad = torch.tensor(pad, dtype=torch.long)
        tokens, mask = self._draft_batch(self.rows)
        self.draft_pad = torch.tensor(left_padding(tokens, mask), dtype=torch.long)
        self.buffer = tokens
        self.inner.begin(tokens, mask)

    def add_rows(self, input_ids, attention_mask, rows):
        pad = left_padding(input_ids, attention_mask)
        new = [self._new_row(input_ids[b, pad[b]:].tolist()) for b in range(len(pad))]
        tokens, mask = self._draft_batch(new)
        join_rows(self.inner, tokens, mask, rows)
        self.rows += new
        self.pad = torch.cat([self.pad, torch.tensor(pad, dtype=torch.long)])
        self.draft_pad = torch.cat([self.draft_pad, torch.tensor(left_padding(tokens, mask), dtype=torch.long)])
        self.buffer = _stack([self.buffer, tokens])

    def _new_row(self, prompt: list[int]) -> _Row:
        bos = self.bridge.target.bos_token_id
        skip = 1 if prompt and bos is not None and prompt[0] == bos else 0   # the draft writes its own start
        start = list(self.bridge.draft_start)
        text = TextBridge.text(self.bridge.target, prompt, skip, len(prompt))
        draft = start + self.bridge.encode_draft(text)
        return _Row(draft, skip, len(start), seen=len(prompt), fed=list(draft), first=skip, buffered=list(draft))

    def _draft_batch(self, rows: list[_Row]):
        """The rows' draft tokens, left padded: (tokens [n, L], mask [n, L])."""
        width = max((len(r.draft) for r in rows), default=0)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            if row.draft:
                tokens[b, width - len(row.draft):] = torch.tensor(row.draft)
                mask[b, width - len(row.draft):] = 1
        return tokens, mask

    def propose(self, request: DraftRequest) -> Proposal:
        batch = request.tokens.shape[0]
        gammas = request.gammas.tolist()
        tokens, lengths = request.tokens.cpu(), request.lengths.tolist()   # one copy; rows that sit out are not read
        committed = [tokens[b, int(self.pad[b]):lengths[b]].tolist() if gammas[b] > 0 else [] for b in range(batch)]
        asks = [0] * batch
        for b in range(batch):
            if gammas[b] > 0 and self._align(self.rows[b], committed[b]) and self.rows[b].draft:
                asks[b] = gammas[b] + 1
        if not any(asks):       # no row can draft this step (every text ends inside a character)
            return Proposal.empty(batch, request.tokens.device)
        self._sync(asks)
        inner = DraftRequest(self.buffer, self.draft_pad + torch.tensor([len(r.draft) for r in self.rows]),
                             torch.tensor(asks, dtype=torch.long), request.rows.cpu(), sampling=False,
                             process=ScoreProcessor(None), acceptor=request.acceptor)
        drafted = _row_lists(check_proposal(self.inner.propose(inner), inner, self.vocab))
        proposals = []
        for b, row in enumerate(self.rows):
            if not asks[b]:
                proposals.append(torch.zeros(0, dtype=torch.long))
                continue
            row.fed = row.draft + drafted[b]
            text = TextBridge.text(self.bridge.draft, row.fed, len(row.draft), len(row.fed))
            proposals.append(torch.tensor(self.bridge.to_target(committed[b], text, gammas[b]), dtype=torch.long))
        return Proposal.pack(proposals, request.tokens.device)

    def _align(self, row: _Row, committed: list[int]) -> bool:
        """Bring the row's draft tokens up to its committed text; False if that text ends inside a character."""
        row.seen = len(committed)
        text = TextBridge.text(self.bridge.target, committed, row.anchor_target, len(committed))
        if text.endswith(PARTIAL):
            return False
        before = self._before(row, committed, row.anchor_target)
        window = self.bridge.encode_draft(text, before)
        row.draft = row.draft[: row.anchor_draft] + window
        if len(committed) - row.anchor_target > 2 * KEEP:
            self._move_anchor(row, committed, window)
        return True

    def _move_anchor(self, row: _Row, committed: list[int], window: list[int]) -> None:
        """Fix the window's start KEEP target tokens before its end when the draft's tokens of the text before that
        point are a prefix of the window's (a boundary both tokenizations share); past MAX_WINDOW, fix it anyway
        (the draft then sees its own tokens of the two pieces: a cost in acceptance only)."""
        point = len(committed) - KEEP
        before = TextBridge.text(self.bridge.target, committed, row.anchor_target, point)
        if before.endswith(PARTIAL):
            return
        head = self.bridge.encode_draft(before, self._before(row, committed, row.anchor_target))
        if window[: len(head)] != head:
            if len(committed) - row.anchor_target <= MAX_WINDOW:
                return
            rest = TextBridge.text(self.bridge.target, committed, point, len(committed))
            row.draft = row.draft[: row.anchor_draft] + head + self.bridge.encode_draft(rest, before[-16:])
        row.anchor_target, row.anchor_draft = point, row.anchor_draft + len(head)

    def _before(self, row: _Row, committed: list[int], point: int) -> str:
        """The text of the few committed tokens before `point` that belong to the row's text (none before its
        start)."""
        start = max(row.first, point - 4)
        return TextBridge.text(self.bridge.target, committed, start, point) if point > start else ""

    def _sync(self, asks: list[int]) -> None:
        """Write the drafting rows' draft tokens into the buffer and roll the draft's cache back to what it shares
        with them."""
        lengths = [int(p) + len(r.draft) for p, r in zip(self.draft_pad.tolist(), self.rows)]
        width = max(lengths, default=0) + max(asks, default=0) + 1
        if width > self.buffer.shape[1]:
            self.buffer = torch.cat([self.buffer, self.buffer.new_zeros(len(self.rows), width - self.buffer.shape[1])], 1)
        keep = []
        for b, row in enumerate(self.rows):
            pad = int(self.draft_pad[b])
            # A drafting row feeds at least its last token: the draft's next-token scores come from that forward.
            shared = min(_shared_prefix(row.fed, row.draft), len(row.draft) - 1) if asks[b] else len(row.fed)
            keep.append(pad + shared)
            if asks[b]:
                same = _shared_prefix(row.buffered, row.draft)
                self.buffer[b, pad + same: pad + len(row.draft)] = torch.tensor(row.draft[same:], dtype=torch.long)
                row.fed, row.buffered = row.draft[:shared], list(row.draft)
        self.inner.rollback(torch.tensor(keep, dtype=torch.long))

    def lag(self, lengths):
        if not self.rows:
            return None
        seen = torch.tensor([r.seen for r in self.rows], dtype=torch.long)
        return (lengths.cpu() - self.pad - seen).clamp(min=0).to(lengths.device)

    def observe(self, record) -> None:
        if isinstance(self.inner, Observes):
            self.inner.observe(record)

    def rollback(self, keep_len):
        """Nothing to do here: the next proposal aligns each row with its committed tokens."""

    def select_rows(self, index):
        index = index.cpu()
        self.rows = [self.rows[i] for i in index.tolist()]
        self.pad, self.draft_pad, self.buffer = self.pad[index], self.draft_pad[index], self.buffer[index]
        self.inner.select_rows(index)

    def end(self, tokens=None, lengths=None):
        self.inner.end()
        self.rows, self.buffer = [], torch.zeros(0, 0, dtype=torch.long)


def _row_lists(proposal: Proposal) -> list[list[int]]:
    tokens, lengths = proposal.tokens.cpu(), proposal.lengths.tolist()
    return [tokens[b, :n].tolist() for b, n in enumerate(lengths)]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _stack(buffers: list[torch.Tensor]) -> torch.Tensor:
    """Row-concatenate [n_i, L_i] buffers, padding each on the right to the widest."""
    width = max(t.shape[1] for t in buffers)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in buffers])
