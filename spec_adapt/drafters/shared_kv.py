"""Assistants that draft from the target's own keys and values: Gemma 4 assistants (`Gemma4AssistantForCausalLM`,
`Gemma4UnifiedAssistantForCausalLM`), what stock's `SinglePositionMultiTokenCandidateGenerator` runs at batch 1.

Such an assistant keeps no cache and computes no keys: each of its layers attends, through cross-attention, to the
keys and values of the target's last layer of its attention type (the layer the target's config marks "store").
Its query sits at the position p of the row's last committed token, and stays there for every draft of a step; its
input is the target's embedding of a token beside a hidden state of the target's width:
- the first draft reads the row's last committed token (at p) and the target's last hidden state at p - 1 (the one
  that predicted it);
- draft k + 1 reads draft k and the hidden state the assistant gave with it (its `post_projection`).

Here every row drafts at once. Its keys are the target's cache columns as the ledger holds them, masked per row:
- full attention: every committed position (holes of rejected drafts and padding masked out);
- sliding attention: the committed positions at most `window + 1` before p, the most recent `window + 1` keys that
  stock's assistant sees after a prompt (its bidirectional window over the last columns). The target's ledger keeps
  its sliding layers' columns `TARGET_MARGIN` positions further back for it.

The target's last hidden state at p - 1 comes from `take_hidden` (a feature drafter), the cache from the request
(`DraftRequest.target`). Nothing here is rolled back: the assistant's state is the target's.
"""

from __future__ import annotations

import torch

from .. import compat
from ..compat import takes_4d_mask
from ..ledger import attention_mask_4d
from .drafter import ChecksTarget, DraftRequest, Features, JoinsRows, Proposal, ReadsTarget
from .mtp import Drafting

TARGET_MARGIN = 2   # stock's assistant sees window + 1 keys; the target's own sliding layers need window - 1


class SharedKVDrafter(Features, ReadsTarget, JoinsRows, ChecksTarget):
    """Drafts with a Gemma 4 assistant, which attends to the target's own keys and values, at any batch size, greedy
    or sampling (its distributions go to the lossless rejection rule)."""

    reads_target = TARGET_MARGIN

    def __init__(self, assistant):
        if not compat.is_shared_kv_assistant(assistant):
            raise TypeError(f"SharedKVDrafter drafts with a Gemma 4 assistant ({', '.join(compat.SHARED_KV_ASSISTANTS)}"
                            f"), not {type(assistant).__name__}: pass another draft model as a ModelDrafter.")
        self.assistant = assistant
        self.target = None
        self.store: dict[str, int] = {}
        self.last_hidden: torch.Tensor | None = None   # [B, backbone]: the target's hidden state before each row's end
        self.known = torch.zeros(0, dtype=torch.bool)  # [B]: rows whose last hidden state has been handed

    def validate(self, target) -> None:
        name = type(target).__name__
        if name.startswith(compat.SHARED_KV_NAMED_ONLY):   # stock accepts the pair, then fails at its first draft
            raise ValueError(f"{name} does not return the shared_kv_states a Gemma 4 assistant reads (stock fails the "
                             "same way: `model_outputs` ... need to contain `hidden_states` and `shared_kv_states`). "
                             "Draft for it with another draft model, or generate without one.")
        if not name.startswith(compat.SHARED_KV_TARGETS):
            raise ValueError(f"Expected class name to start with Gemma4 or Gemma3n. Got {name}. Gemma4Assistant "
                             "models require a target model that provides a shared_kv_states dictionary.")
        width = target.config.get_text_config().hidden_size
        if compat.shared_kv_backbone_size(self.assistant) != width:
            raise ValueError(f"{type(self.assistant).__name__} was made for a target of hidden size "
                             f"{compat.shared_kv_backbone_size(self.assistant)}, but {name}'s is {width}: pass the "
                             "assistant trained with this target.")
        store = compat.kv_store_layers(target)
        missing = sorted(compat.shared_kv_layer_types(self.assistant) - set(store))
        if missing:
            raise ValueError(f"{type(self.assistant).__name__} attends to the target's {missing} keys, which {name} "
                             "does not share (no layer of that type is marked 'store' in its config's "
                             "kv_sharing_modes): stock's shared_kv_states would lack them too.")
        if not takes_4d_mask(self.assistant):
            raise ValueError(f"{type(self.assistant).__name__} drafts rows with padding and holes through 4-D masks, "
                             f"but it uses {compat.attn_implementation(self.assistant)!r}: load it with "
                             "attn_implementation='sdpa' or 'eager'.")
        self.target, self.store = target, store

    def begin(self, input_ids, attention_mask):
        self.last_hidden, self.known = None, torch.zeros(len(input_ids), dtype=torch.bool)

    def take_hidden(self, hidden, count):
        """Keep each row's last committed hidden state: column count[b] - 1 (the prompt's forward keeps only its
        last column), the row's earlier one where it committed nothing."""
        count = count.to(hidden.device)
        column = (count - 1).clamp(0, hidden.shape[1] - 1)
        last = hidden.gather(1, column[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)
        if self.last_hidden is not None:
            last = torch.where((count > 0)[:, None], last, self.last_hidden.to(last.device))
        self.last_hidden = last
        self.known = self.known.to(count.device) | (count > 0)

    def add_rows(self, input_ids, attention_mask, rows):
        """Rows joining a running batch (serving): their hidden states come with the next `take_hidden` (the
        engine hands those of their prefill); until then they draft nothing."""
        n = len(input_ids)
        if self.last_hidden is not None:
            self.last_hidden = torch.cat([self.last_hidden, self.last_hidden.new_zeros(n, self.last_hidden.shape[1])])
        self.known = torch.cat([self.known, torch.zeros(n, dtype=torch.bool, device=self.known.device)])

    def propose(self, request: DraftRequest) -> Proposal:
        if request.target is None:
            raise RuntimeError("SharedKVDrafter drafts from the target's cache, which this loop did not hand over "
                               "(DraftRequest.target).")
        tokens, lengths, gammas = request.tokens, request.lengths, request.gammas
        if self.last_hidden is None or not bool(self.known.any()):    # restarted on running rows: none handed yet
            return Proposal.empty(len(lengths), tokens.device)
        gammas = torch.where(self.known.to(gammas.device), gammas, 0)     # a row without its hidden state yet
        ledger = request.target
        device = self.last_hidden.device
        query = (lengths.to(device) - 1 - ledger.pad.to(device))[:, None]             # p per row, [B, 1]
        weight = next(self.assistant.parameters())      # the assistant's dtype and device may differ from the target's
        dtype, place = weight.dtype, weight.device
        shared, masks = {}, {}
        for kind in compat.shared_kv_layer_types(self.assistant):
            keys, values, positions = ledger.layer_columns(self.store[kind], kind)
            seen = (positions >= 0) & (positions < query)
            window = (ledger.windows or {}).get(kind)
            if window is not None:
                seen &= query - positions <= window + 1
            shared[kind] = (keys.to(place, dtype), values.to(place, dtype))
            masks[kind] = attention_mask_4d(self.assistant, seen[:, None, :].to(place))   # [B, 1, 1, C]
        embed = self.target.get_input_embeddings()
        vocab = self.target.get_output_embeddings().weight.shape[0]
        draft = Drafting(request, tokens, lengths, gammas, vocab, lambda logits: logits)
        token = tokens.gather(1, (lengths - 1)[:, None]).squeeze(1)
        hidden = self.last_hidden
        for k in range(int(gammas.max()) if len(gammas) else 0):
            inputs = torch.cat([embed(token[:, None].to(device)), hidden[:, None].to(device, embed.weight.dtype)],
                               dim=-1).to(place, dtype)
            logits, hidden = compat.shared_kv_step(self.assistant, inputs, masks, query.to(place), shared)
            token, hidden = draft.choose(k, logits[:, 0]), hidden[:, 0]
        return draft.proposal(tokens.device)

    def select_rows(self, index):
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[index.to(self.last_hidden.device)]
        self.known = self.known[index.to(self.known.device)]

    def end(self, tokens=None, lengths=None):
        self.last_hidden = None

    def __repr__(self):
        return f"SharedKVDrafter({type(self.assistant).__name__})"
