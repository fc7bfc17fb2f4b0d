"""Multi-token prediction (MTP): drafting with the prediction layers a checkpoint ships beside its decoder layers
(DeepSeek-V3, GLM-4 MoE, Mellum, Sarvam, ...), from the target's own last hidden states: a feature drafter.

Layer k (0-based) of K reads, at position t, the embedding of token t + k + 1 and the hidden state the layer before
it gave at t (the target's last hidden state for layer 0), and its output predicts token t + k + 2. Over a row whose
last committed token is at n - 1, the last position the target has a hidden state for is n - 2: layer 0 there drafts
d_1 (token n), layer 1 reads d_1 and drafts d_2, and so on, so one forward of the K layers drafts K tokens (stock's
`MTPCandidateGenerator` drafts exactly K a step too; a plan asking for more gets K).

The layers' KV cache is one `KVLedger` over a runner that runs all K layers, its slots labelled by position t for
every layer (layer k's entries at t embed token t + k + 1). After a step that accepted a drafts of a row, layer k's
entry at t is right while token t + k + 1 is committed, t + k + 1 <= keep: every layer's entries are right below
keep - K, and the ledger rolls back there; the next forward runs the window from there to n - 2 again (K positions
after a step: stock crops its MTP cache the same way). The target's hidden states of that window are kept here,
row by row, from `take_hidden` until the layers have absorbed them for good.
"""

from __future__ import annotations

import threading
import weakref
from types import SimpleNamespace

import torch

from .. import compat
from ..ledger import KVLedger
from ..model_kinds import check_model_kind
from .drafter import ChecksTarget, DraftRequest, Features, FillsBudget, JoinsRows, Proposal, left_padding, sample_drafts


class MTPDrafter(Features, FillsBudget, JoinsRows, ChecksTarget):
    """Drafts with the MTP layers of `model`'s checkpoint (loaded as stock's use_mtp=True loads them), or with
    `mtp` (an `MtpModel` already loaded for `model`). Any batch size, greedy or sampling (the drafts' own
    distributions go to the lossless rejection rule)."""

    def __init__(self, model, mtp=None):
        self.model = model
        self.mtp = mtp if mtp is not None else compat.load_mtp(model)
        self.depth = compat.mtp_depth(self.mtp)
        self.runner = _Layers(self.mtp, self.depth)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.ledger: KVLedger | None = None
        self.held = None       # [B, C, H] the target's last hidden states the layers still need, row b's column 0 at
        self.held_from = None  # [B] this position
        self.held_to = None    # [B] the first position whose hidden state has not been handed yet

    def validate(self, target) -> None:
        if target is not self.model:
            raise ValueError(f"MTPDrafter drafts with the MTP layers of the {type(self.model).__name__} it was made "
                             f"for, from that model's hidden states: generate with that model, not "
                             f"{type(target).__name__}.")
        check_model_kind(target)
        if not compat.takes_4d_mask(self.runner):
            raise ValueError(f"MTP drafting batches rows with padding through 4-D attention masks, but the MTP layers "
                             f"use {compat.attn_implementation(self.runner)!r}: load the model with "
                             "attn_implementation='sdpa' or 'eager'.")

    def begin(self, input_ids, attention_mask):
        pad = left_padding(input_ids, attention_mask)
        self.ledger = KVLedger.empty(self.runner, pad, self.runner.device, full_masks=True)
        self.held = torch.zeros(len(pad), 0, self.runner.hidden_size, dtype=self.runner.dtype,
                                device=self.runner.device)
        self.held_from = self.ledger.pad.clone()
        self.held_to = torch.zeros_like(self.held_from)

    def take_hidden(self, hidden, count):
        """Append each row's new hidden states to those the layers still need (positions from the ledger's
        frontier on), in one gather."""
        hidden = hidden.to(self.held.device, self.held.dtype)
        count = count.to(self.held.device)
        start, end = self.ledger.n_cached, self.held_to + count
        width = int((end - start).clamp(min=0).max()) if len(start) else 0
        positions = start[:, None] + torch.arange(width, device=start.device)[None, :]         # [B, width]
        column = torch.where(positions < self.held_to[:, None], positions - self.held_from[:, None],
                             self.held.shape[1] + positions - self.held_to[:, None])
        both = torch.cat([self.held, hidden], dim=1)
        column = column.clamp(0, max(both.shape[1] - 1, 0))
        self.held = both.gather(1, column[..., None].expand(-1, -1, both.shape[-1])) if both.shape[1] else \
            both.new_zeros(len(start), width, both.shape[-1])
        self.held_from, self.held_to = start, end

    def propose(self, request: DraftRequest) -> Proposal:
        device, target_device = self.runner.device, request.tokens.device
        tokens, lengths = request.tokens.to(device), request.lengths.to(device)
        gammas = request.gammas.to(device).clamp(max=self.depth)
        drafting = gammas > 0
        if bool((self.held_to != lengths - 1)[drafting].any()):
            raise RuntimeError("MTPDrafter holds no target hidden states for some committed positions: the target's "
                               "forwards did not hand them over (a drafter restarted on running rows has none).")
        first = self.ledger.n_cached
        n_valid = torch.where(drafting, lengths - 1 - first, 0)        # the window: positions first .. n - 2
        window = torch.arange(int(n_valid.max()), device=device)[None, :]
        ids = tokens.gather(1, (first[:, None] + 1 + window).clamp(max=tokens.shape[1] - 1))   # layer 0: x_{t+1}
        column = (first - self.held_from)[:, None] + window
        hidden = self.held.gather(1, column.clamp(0, self.held.shape[1] - 1)[..., None].expand(
            -1, -1, self.held.shape[-1]))
        draft = Drafting(request, tokens, lengths, gammas, self.vocab,
                         lambda last: compat.mtp_logits(self.mtp, last[:, None])[:, 0])
        self.runner.feed = SimpleNamespace(hidden=hidden, last=(n_valid - 1).clamp(min=0), choose=draft.choose)
        try:
            self.ledger.forward(ids, n_valid)
        finally:
            self.runner.feed = None
        return draft.proposal(target_device)

    def rollback(self, keep_len):
        """Every layer's entries below keep - K are right (the module docstring); the rows' padding stays."""
        keep = keep_len.to(self.ledger.device) - self.depth
        self.ledger.rollback(torch.maximum(keep, self.ledger.pad))

    def select_rows(self, index):
        self.ledger.select_rows(index)
        index = index.to(self.held.device)
        self.held, self.held_from, self.held_to = self.held[index], self.held_from[index], self.held_to[index]

    def add_rows(self, input_ids, attention_mask, rows):
        """Rows joining a running batch (serving): nothing cached for them yet; the next `take_hidden` (the engine
        hands their prefill's) gives them every prompt position's hidden state, as a call's first rows get."""
        pad = left_padding(input_ids, attention_mask)
        joining = KVLedger.empty(self.runner, pad, self.runner.device, full_masks=True)
        self.ledger.add_rows(joining)
        self.held = torch.cat([self.held, self.held.new_zeros((len(pad),) + tuple(self.held.shape[1:]))])
        self.held_from = torch.cat([self.held_from, joining.pad])
        self.held_to = torch.cat([self.held_to, torch.zeros_like(joining.pad)])

    def end(self, tokens=None, lengths=None):
        self.ledger = self.held = self.held_from = self.held_to = None

    def __repr__(self):
        return f"MTPDrafter({type(self.model).__name__}, {self.depth} layer{'s' if self.depth > 1 else ''})"


# The MTP layers loaded per target (stock loads them at every call; here once per process): weak on the target.
_LOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOADED_LOCK = threading.Lock()


def mtp_drafter(model) -> MTPDrafter:
    """An MTPDrafter for `model` (what `use_mtp=True` drafts with), its MTP layers loaded once per target."""
    with _LOADED_LOCK:
        mtp = _LOADED.get(model)
        if mtp is None:
            mtp = _LOADED[model] = compat.load_mtp(model)
    return MTPDrafter(model, mtp)


class Drafting:
    """One proposal's state for a drafter that drafts one token per row per forward from a hidden state (MTP layers,
    a Gemma 4 assistant): the drafts, chosen position by position (the request's processors, its sampling, its stop
    rule). `logits_of(hidden [B, H]) -> [B, V']` projects a hidden state to logits (the first `vocab` are kept)."""

    def __init__(self, request: DraftRequest, tokens, lengths, gammas, vocab: int, logits_of):
        batch, most, device = len(lengths), int(gammas.max()), tokens.device
        self.logits_of, self.vocab, self.request, self.lengths, self.gammas = logits_of, vocab, request, lengths, gammas
        self.context = tokens.clone()                          # committed tokens + drafts so far (the processors')
        self.rows = request.rows.to(device)
        self.drafts = torch.zeros(batch, most, dtype=torch.long, device=device)
        self.probs = torch.zeros(batch, most, self.vocab, device=device) if request.wants_probs else None
        self.confidence = torch.zeros(batch, most, device=device)
        self.survival = torch.ones(batch, device=device)
        self.going = gammas > 0                                # rows still drafting
        self.drafted = torch.zeros_like(gammas)

    def choose(self, k: int, last: torch.Tensor) -> torch.Tensor:
        """Draft k per row from the hidden state [B, H] that predicts it: the token the next forward reads. Past
        every row's gamma a drafter may still run (the MTP layers' cache is one), and any token serves: nothing
        proposed follows from it."""
        if k >= self.drafts.shape[1]:
            return torch.zeros(len(last), dtype=torch.long, device=last.device)
        logits = self.logits_of(last)[:, : self.vocab].float().to(self.lengths.device)
        scores = self.request.process(logits, self.context, self.lengths + k, self.rows)
        q = scores.softmax(dim=-1)
        token = sample_drafts(scores, q, self.request, k) if self.request.sampling else scores.argmax(dim=-1)
        self.going &= k < self.gammas
        self.confidence[:, k] = q.gather(1, token[:, None]).squeeze(1)
        if self.probs is not None:
            self.probs[:, k] = q
        self.drafts[:, k] = torch.where(self.going, token, 0)
        self.drafted += self.going.long()
        self.context.scatter_(1, (self.lengths + k)[:, None].clamp(max=self.context.shape[1] - 1), token[:, None])
        stop = self.request.stop
        if stop is not None:           # the plan's rule: a row whose survival fell below it drafts no more
            self.survival = stop.survival(self.survival, self.confidence[:, k])
            self.going &= stop.keeps(self.survival, k + 1)
        return token.to(last.device)

    def proposal(self, device) -> Proposal:
        width = int(self.drafted.max()) if len(self.drafted) else 0
        probs = self.probs[:, :width].to(device) if self.probs is not None else None
        return Proposal(self.drafts[:, :width].to(device), self.drafted.to(device), probs,
                        confidence=self.confidence[:, :width].to(device))


class _Layers:
    """The K MTP layers as the model a KVLedger runs: tokens [B, W] are layer 0's (x_{t+1} at position t), the
    ledger's position ids are t's. Layer k runs at positions shifted by k + 1 on the tokens of layer k - 1 moved one
    place left, the draft of layer k - 1 in each row's last valid column. Its "logits" are the last layer's hidden
    states. `feed` holds, for one forward, the target's hidden states of the window, each row's last valid column
    and the drafting callback."""

    def __init__(self, mtp, depth: int):
        self.mtp, self.depth, self.config = mtp, depth, mtp.config
        self.feed = None

    @property
    def device(self):
        return next(self.mtp.layers.parameters()).device

    @property
    def dtype(self):
        return next(self.mtp.layers.parameters()).dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kwargs):
        hidden, last, tokens = self.feed.hidden, self.feed.last[:, None], input_ids
        for k in range(self.depth):
            mask = attention_mask
            # One mask per attention type (sliding windows, hybrid layers). A convolution's padding mask is not
            # needed: a row's window starts at its first token, and holes come only after its last.
            if isinstance(mask, dict):
                kind = compat.mtp_layer_type(self.mtp, k)
                mask = mask[compat.MASK_KEYS.get(kind, kind)]
            hidden = compat.mtp_layer_forward(self.mtp, k, tokens, hidden, position_ids + k + 1, mask, cache)
            at_last = hidden.gather(1, last[..., None].expand(-1, -1, hidden.shape[-1])).squeeze(1)
            token = self.feed.choose(k, at_last)
            tokens = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1).scatter(1, last, token[:, None])
        return SimpleNamespace(logits=hidden)

    __call__ = forward
