"""The KV ledger: per-row bookkeeping over one model's DynamicCache, so rollback moves no data.

A DynamicCache has one physical length P for the whole batch. Rows of a speculative batch accept different numbers
of tokens, so the ledger records, for every physical slot of every row, which token of the row's sequence it holds:

    slots[b, j] = index in row b's token buffer of the token cached at physical slot j, or -1 for a hole.

The token buffer is the generate layout: left padding, prompt, generated tokens. Left-padding slots are holes from
the start. Everything else follows from `slots`:
- attention mask = slots >= 0 (holes are masked out, so they never influence attention);
- position id of buffer index i in row b = i - pad[b] (the same as stock generate's cumsum(mask) - 1);
- rollback of row b to its first k buffer tokens: slots[b][slots[b] >= k] = -1 (no data moves);
- physical trim: drop trailing columns that are holes in every row (`DynamicLayer` tensors are sliced);
- compaction: when holes waste too much memory, gather each row's valid slots to the front (one gather per layer).
  "Too much" is measured by what compaction would give back: the physical length minus the longest row's valid
  count. Holes that padding for shorter rows forces anyway (ragged prompts) are not waste and never trigger it.
- token trees: a forward may append nodes of a tree (`forward(..., parents=...)`). Until `keep_tree` names the
  path that stays, those columns form a pending region: each attends to the committed slots and to its ancestors
  in the region only (a 4-D mask), and holds slot n_cached + its number of ancestors in the region (siblings share a
  slot value: at most one of them is kept). `keep_tree` turns the other columns into holes.
- sliding windows: every layer keeps the ledger's columns and a 4-D mask per layer type enforces each window by
  position. A ledger that knows how far back a later rollback can reach (`rewind`; the target's: never below what
  it keeps) drops, from a sliding layer type's tensors only, the leading columns no row can attend to again (older
  than its window before the next position, or holes): `dropped[type]` columns. Such a layer then holds at most
  window + the step's width entries per row beyond the holes ragged acceptance leaves, however long the call.
- convolution layers (LFM2's short convolutions; Inkling's hybrid layers, attention with four short convolutions
  around it): a convolution's state is the last few inputs of the row. The ledger keeps every input column like a
  KV entry (`conv_inputs[layer, state]`, same columns and holes) and hands each state, before a forward, the last
  `kernel` valid columns of each row: rollback, compaction and row changes move them with the slots. Layers with a
  recurrent state (stateful models) are refused with stock's own reason.
- spare rows: rows that left the batch may stay in the cache tensors, after the live rows, so the model keeps running
  a batch shape the hardware runs faster (on a CPU, some batch sizes run slower than a larger one). They are
  not ledger rows: `slots`, `pad` and `n_cached` describe the live rows only; each forward feeds spares token 0 at
  position 0 and drops their logits. Anything that adds or prunes rows (add_rows, forward_pruned) releases them first.

Worked example, B = 2, row 0 left-padded by 1:
    prefill [pad, a, b] / [c, d, e]          slots = [[-1, 1, 2], [0, 1, 2]]
    verify chunk [x, y, z] / [u, v, -]       slots = [[-1,1,2,3,4,5], [0,1,2,3,4,-1]]   (row 1 drafted one fewer)
    row 0 keeps 5 tokens, row 1 keeps 4      slots = [[-1,1,2,3,4,-1], [0,1,2,3,-1,-1]]  -> trim to 5 columns
"""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch

from . import compat
from .compat import (CONV_MASK_KEYS, FULL_LAYER, MASK_KEYS, PER_ROW_LOGITS_TO_KEEP, DummyLayer, DynamicCache,
                     DynamicIndexedLayer, DynamicLayer, EncoderDecoderCache, LinearAttentionAndFullAttentionLayer,
                     LinearAttentionLayer, attn_implementation, layer_types, with_cache)
from .inputs import encoder_decoder
from .model_kinds import (UnsupportedCacheError, check_no_convolutions, has_convolutions, has_layer,
                          one_mask_refusal, sliding_windows)
from .positions import offsets


# A forward's fixed cost, in prompt tokens, below which padding is cheaper to compute than to skip with a forward a
# row (`KVLedger._prefills_apart`): on a 2-core AMD EPYC a 1.5B model's one-token forward costs what about 14 prompt
# tokens do in a batched prefill (docs/execution.md); the bound leaves room for CPUs with more cores per memory
# channel, whose forwards are more of a fixed cost.
PREFILL_APART_TOKENS = 32


def worth_apart(device, lengths: list[int], width: int | None = None) -> bool:
    """Whether rows of these token counts run faster a row at a time than as one forward `width` wide (default: the
    longest): on a CPU, where the padding exceeds `PREFILL_APART_TOKENS` per extra forward."""
    padding = len(lengths) * (width if width is not None else max(lengths, default=0)) - sum(lengths)
    rows = len(lengths)
    return torch.device(device).type == "cpu" and rows > 1 and padding > PREFILL_APART_TOKENS * (rows - 1)


def check_rollback_cache(cache) -> None:
    """Raise a clear error for caches whose entries cannot be invalidated per row. An empty cache of sliding-window
    layers is accepted: the ledger runs such a model on full layers and enforces the window in its masks. Of an
    encoder-decoder cache, the self-attention part is checked (the cross-attention part is fixed for the call)."""
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"spec_adapt needs a DynamicCache to roll back rejected tokens per row, got {type(cache).__name__}. "
            "Drop `cache_implementation=...` / the `past_key_values` you passed, and generate will create one."
        )
    bad = [type(layer).__name__ for layer in cache.layers if type(layer) not in _KEPT_LAYERS
           or type(layer) in FULL_LAYER and layer.is_initialized
           or isinstance(layer, LinearAttentionLayer) and any(layer.is_recurrent_states_initialized.values())
           or getattr(layer, "indexer_position_ids", None) is not None]
    if bad:
        raise UnsupportedCacheError(
            f"spec_adapt cannot roll back cache layers of type {sorted(set(bad))} per row (linear-attention, "
            "convolution and recurrent layers transform their state, quantized and static layers keep no plain "
            "per-token entries). Generate without a drafter for this model."
        )


# Layers kept per column: attention (an indexed layer's indexer keys too) and convolutions (their input columns);
# a KV-sharing layer holds nothing (it reads the keys its producer layer returns in the same forward).
_KEPT_LAYERS = (DynamicLayer, DynamicIndexedLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer,
                DummyLayer, *FULL_LAYER)

_POSITIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_TAKES_POSITIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def takes_positions(model) -> bool:
    """Whether stock generate passes `model` padding-aware positions: where its forward names `position_ids` and its
    `prepare_inputs_for_generation` keeps them. Otherwise the model numbers tokens itself (WhisperForCausalLM takes
    them only through **kwargs; Kosmos-2's text model counts from the cache length), and the ledger passes none."""
    known = _TAKES_POSITIONS.get(model)
    if known is None:
        known = _TAKES_POSITIONS[model] = "position_ids" in inspect.signature(model.forward).parameters and \
            compat.prepare_passes_positions(model)
    return known


# Model types that read the ledger's 2-D mask of holes wrongly: their rows keep their columns in step (no holes).
_NO_HOLES = {
    "git": "{name} widens a 2-D attention mask by its image tokens' columns whenever its cache holds anything, image "
           "or not, so the mask of a hole would be read shifted",
}


def positions_from_cache(model) -> str | None:
    """Why `model` numbers a token by its physical column in the cache rather than by `position_ids` (None if it
    reads position_ids), or cannot read a mask of holes (`_NO_HOLES`). Such a model (the Bart-family standalone
    decoders, which use cache length + offset; models run without position_ids) sees a shifted position wherever
    the cache holds a hole before a row's tokens, so its rows must keep their columns in step (KVLedger.lockstep).
    Decided once per model by a probe: two forwards of three tokens at position_ids with different gaps."""
    known = _POSITIONS.get(model, False)
    if known is not False:
        return known
    no_holes = _NO_HOLES.get(getattr(model.config, "model_type", None))
    if no_holes is not None:
        reason = no_holes.format(name=type(model).__name__)
    elif encoder_decoder(model):
        reason = (f"{type(model).__name__} is an encoder-decoder model, whose decoder stock runs without position ids "
                  "(it numbers tokens by cache column)")
    elif not takes_positions(model):
        reason = (f"stock generate passes {type(model).__name__} no position_ids (it numbers its tokens by cache "
                  "column)")
    elif getattr(model, "_pp_stage", None) is not None:      # a pipeline stage cannot be probed alone
        reason = None
    else:
        reason = None if _reads_positions(model) is not False else (
            f"{type(model).__name__} numbers tokens by their cache column and ignores position_ids")
    _POSITIONS[model] = reason
    return reason


def _reads_positions(model) -> bool | None:
    """Whether `model` reads position_ids; None where it cannot run on token ids alone (IDEFICS cross-attends to
    images in every forward): stock passes it positions, which it is taken to read, as `GenerationMixin` does."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.tensor([[1, 2, 3]], device=model.device) % vocab
    # An explicit mask: without one, transformers' masks read gaps in position_ids as the starts of packed sequences,
    # and a model that numbers tokens by cache column (Inkling's relative position bias) would seem to read them.
    mask = torch.ones_like(ids)
    outputs = []
    with torch.no_grad():
        for positions in ([0, 1, 2], [0, 3, 7]):     # other gaps: rotary embeddings see only relative positions
            try:
                out = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True,
                            position_ids=torch.tensor([positions], device=model.device))
            except ValueError:          # a forward that needs inputs of its own (the model says which)
                return None
            # Hidden states, where a model has them: soft-capped logits can saturate to the same values.
            outputs.append(out.hidden_states[-1] if getattr(out, "hidden_states", None) else out.logits)
    return not torch.equal(*outputs)


CHUNKED = "chunked_attention"      # its "window" is a chunk: a token sees the earlier tokens of its own chunk only


def new_cache(model, windows) -> DynamicCache | EncoderDecoderCache:
    """The ledger's cache: transformers' own for full attention, plain full layers under sliding windows; an
    encoder-decoder model's pairs the decoder's self-attention cache with its cross-attention cache."""
    if encoder_decoder(model):
        return EncoderDecoderCache(DynamicCache(), DynamicCache())
    if not windows:
        return DynamicCache(config=model.config)
    if not has_convolutions(model):
        return DynamicCache()               # plain layers, created as the model writes them
    cache = DynamicCache(config=model.config)          # convolution layers must exist before the first forward
    for i, layer in enumerate(cache.layers):
        full = FULL_LAYER.get(type(layer))
        if full is LinearAttentionAndFullAttentionLayer:
            cache.layers[i] = full(number_of_states=layer.number_of_states)
        elif full is not None:
            cache.layers[i] = full()
    return cache


def on_device(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device`; no dispatch when it is there already (a step's small tensors usually are)."""
    return t if t.device == device else t.to(device)


def select_positions(x: torch.Tensor, keep) -> torch.Tensor:
    """x [B, W, ...] at the positions `logits_to_keep` names: the last `keep` (an int, 0 = all) or, per row, the columns
    keep [B, K]. What transformers' `slice_logits_to_keep` does, for models (and versions) that do not take it."""
    if torch.is_tensor(keep):
        return x.gather(1, keep.reshape(*keep.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))
    return x[:, -keep:] if keep else x


def _per_type(mask, fn):
    """fn applied to a mask, or to each mask of a {layer type: mask} mapping."""
    return {kind: fn(m) for kind, m in mask.items()} if isinstance(mask, dict) else fn(mask)


def _with_rows(tensor: torch.Tensor, n: int, before: bool = False) -> torch.Tensor:
    """`tensor` [B, ...] with n zero rows appended (or prepended): rows that are all holes."""
    zeros = tensor.new_zeros((n,) + tuple(tensor.shape[1:]))
    return torch.cat([zeros, tensor] if before else [tensor, zeros])


def _sees(kind: str, window: int, queries: torch.Tensor, keys: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """[B, W, P + W] bool: which keys (positions [B, P + W]) a layer of this kind sees from each query (positions
    [B, W]): those less than `window` before it, or for a chunked layer those of its own chunk of `window`
    positions, as transformers' sliding and chunked masks do (positions count from a row's first token)."""
    if kind == CHUNKED:
        return (queries // window)[:, :, None] == (keys // window)[:, None, :]
    return distance < window


def _one_mask(model, masks: dict) -> torch.Tensor:
    """The one mask of a model that takes one for all its layer types: exact while no window binds (every layer
    type's mask is the same), refused where one would."""
    first, *others = masks.values()
    if any(not torch.equal(first, other) for other in others):
        raise ValueError(one_mask_refusal(model))
    return first


def _with_columns(tensor: torch.Tensor, n: int, dim: int = 2, after: bool = False) -> torch.Tensor:
    """`tensor` with n zero columns before (or after) the others along `dim`."""
    zeros = tensor.new_zeros(tensor.shape[:dim] + (n,) + tensor.shape[dim + 1:])
    return torch.cat([tensor, zeros] if after else [zeros, tensor], dim=dim)


def _column_tensors(layer) -> list[tuple[str, int]]:
    """(attribute, column dim) of a cache layer's per-token tensors: keys and values [B, H, P, D], and an indexed
    layer's indexer keys [B, P, D] (sparse attention picks among them: they follow every move of the keys)."""
    names = [("keys", 2), ("values", 2)]
    indexer = getattr(layer, "indexer_keys", None)
    return names + [("indexer_keys", 1)] if indexer is not None and indexer.numel() else names


def _map_columns(layer, fn) -> None:
    """Replace each per-token tensor t of `layer` with fn(t, its column dim)."""
    for name, dim in _column_tensors(layer):
        setattr(layer, name, fn(getattr(layer, name), dim))


def attention_mask_4d(model, allowed: torch.Tensor) -> torch.Tensor:
    """allowed [B, Q, K] bool -> the 4-D mask the model's attention takes: bool for sdpa, additive for eager."""
    if attn_implementation(model) == "eager":
        zero = torch.zeros((), dtype=model.dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(model.dtype).min)[:, None]
    return allowed[:, None]


def _causal_allowed(slots: torch.Tensor, width: int) -> torch.Tensor:
    """[B, W, P + W] bool: each of the last `width` columns attends to the valid slots up to itself, and always to
    itself (a padding column attending to nothing would turn into NaN; nothing valid attends to it)."""
    columns = torch.arange(slots.shape[1], device=slots.device)
    query = columns[-width:] if width else columns[:0]
    causal = columns[None, :] <= query[:, None]                                              # [W, P + W]
    return ((slots >= 0)[:, None, :] & causal[None]) | (columns[None, :] == query[:, None])[None]


class KVLedger:
    """One model, its DynamicCache and the per-row slot map. All tensors live on the model's device."""

    def __init__(self, model, cache: DynamicCache | None = None, compact_threshold: float = 0.5, compact_min: int = 64,
                 kernels: str = "auto", rewind: int | None = None, full_masks: bool = False):
        self.model = model
        self.kernels = kernels            # kernel mode of the compaction gather (spec_adapt.acceptor)
        self.compact_path: str | None = None   # "triton" or "torch": what the last compaction ran
        # Compact when compaction would free more than `compact_threshold` of the physical length and at least
        # `compact_min` slots.
        self.compact_threshold, self.compact_min = compact_threshold, compact_min
        self.compactions = 0
        self.device = model.device
        self.windows = sliding_windows(model)
        self.cache = cache if cache is not None and not self.windows else new_cache(model, self.windows)
        # (cache layer, convolution state) -> that convolution's input columns [rows, channels, P]
        self.conv_inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._convolutions = has_convolutions(model)       # decided once: the per-forward hooks skip other models
        self._layer_kinds = [kind for kind, _ in layer_types(model)]
        self._indexed = has_layer(model, "indexed_attention")
        # Sliding layers: how far below the length a rollback keeps a later rollback may go (None: keep every column,
        # as a draft's ledger, which a chain or a cross-tokenizer drafter rewinds into its own drafts, must), the layer
        # type of each layer, and the leading columns each type's tensors no longer hold.
        if rewind is not None and (isinstance(rewind, bool) or not isinstance(rewind, int) or rewind < 0):
            raise ValueError(f"KVLedger(rewind=...) must be None or a count >= 0, got {rewind!r}")
        # A model that takes one mask for all layer types gets the full layers' mask (see `_one_mask`): its sliding
        # layers keep every column.
        self.one_mask = bool(self.windows) and compat.takes_one_mask(model)
        self.rewind = rewind if self.windows and any(self.windows.values()) and not self.one_mask else None
        # What another ledger of this model needs to be built as this one (a row prefilled apart).
        self._settings = dict(compact_threshold=compact_threshold, compact_min=compact_min, kernels=kernels,
                              rewind=rewind, full_masks=full_masks)
        self._kinds = self._layer_kinds if self.rewind is not None else []
        self.dropped: dict[str, int] = {}
        check_rollback_cache(self.cache)
        # What the model's forwards take besides tokens, mask and cache (spec_adapt.inputs; None: nothing). A ledger
        # with such inputs keeps no spare rows (the inputs would need them too).
        self.inputs = None
        self.slots: torch.Tensor | None = None     # [B, P] long
        self.pad: torch.Tensor | None = None       # [B] long, left padding of each row
        self.n_cached: torch.Tensor | None = None  # [B] long, buffer tokens whose KV is cached (a prefix)
        self.spare = 0                             # cache rows after the B live ones, kept only for the batch shape
        self.tree: tuple | None = None   # pending tree region: (first column, parents [B, T], in use [B, T])
        self.first = None    # [B, 1, V] the prefill's logits, for a first step that judges the first token (loop)
        parameters = inspect.signature(model.forward).parameters
        self._keeps_logits = "logits_to_keep" in parameters
        self._takes_positions = takes_positions(model)
        # MoE models configured to return router logits compute an auxiliary training loss from them, which fails on a
        # padded batch: generation needs neither.
        self._no_router_logits = "output_router_logits" in parameters
        # Lockstep (a model numbering tokens by cache column, see positions_from_cache): the owner commits the same
        # count in every row, so no hole opens before a row's tokens, and nothing is compacted (that moves columns).
        self.lockstep = False
        # A pipeline stage after the first holds no cache for layer 0, from which transformers sizes the masks it
        # builds from a 2-D mask: such a model gets its full 4-D mask from the ledger on every forward.
        # `full_masks`: a model that takes only a 4-D mask (the MTP layers' runner, which builds no mask of its own).
        stage = getattr(model, "_pp_stage", None)
        self._full_masks = full_masks or stage is not None and stage.pp_size > 1
        # Feature drafters (`Features`) draft from the model's last hidden states: with `want_hidden` every
        # forward keeps them in `hidden` [B, W, H] (all its columns, whatever logits it keeps); None otherwise.
        self.want_hidden = False
        self.hidden: torch.Tensor | None = None
        # Host bookkeeping that spares a step tensor work and host reads: `_full` is the slot map last seen without
        # a hole (every slots tensor is replaced, never written in place, so identity tells it is unchanged; a
        # rollback that leaves every row every column sets it), and `_one_each` the [B] ones that `ones` hands out
        # for a forward of one valid token a row.
        self._full: torch.Tensor | None = None
        self._one_each: torch.Tensor | None = None
        self._width_each: torch.Tensor | None = None      # `filled`'s tensor, of `_width` each
        self._width = 0

    def use_inputs(self, inputs) -> None:
        """Run every forward with these model inputs (spec_adapt.inputs.ModelInputs; None: tokens only). Inputs that
        carry encoder outputs need a cross-attention cache beside the self-attention one the ledger keeps."""
        self.inputs = inputs
        if inputs is not None and inputs.cross and not isinstance(self.cache, EncoderDecoderCache):
            self.cache = EncoderDecoderCache(self.cache, DynamicCache())

    @classmethod
    def empty(cls, model, pad, device=None, **kwargs) -> "KVLedger":
        """A ledger for rows (left padding `pad`, one per row) with nothing cached yet: the next `forward` starts
        at each row's first token. A draft starts this way, so its prompt is a catch-up like any other."""
        ledger = cls(model, **kwargs)
        device = device if device is not None else ledger.device
        ledger.pad = torch.as_tensor(pad, dtype=torch.long, device=device).reshape(-1)
        ledger.slots = torch.zeros(len(ledger.pad), 0, dtype=torch.long, device=device)
        ledger.n_cached = ledger.pad.clone()
        return ledger

    # -- forward passes --------------------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Run the prompt [B, L] (left padded; mask [B, L] or None). Returns last-position logits [B, V].

        On a CPU, a batch whose padding would cost more than the forwards it takes to skip it is prefilled a row at
        a time, each row without its padding (`_prefill_apart`): a CPU spends as long on a padding token as on a real
        one, and a ragged batch of prompts can be a third padding."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device)
        if self._prefills_apart(attention_mask):
            return self._prefill_apart(input_ids, attention_mask)
        return self._prefill(input_ids, attention_mask)

    def _prefills_apart(self, mask: torch.Tensor) -> bool:
        """Whether to prefill each row apart: on a CPU, for a model that takes tokens alone and numbers them by
        position, with left padding worth more than `PREFILL_APART_TOKENS` per extra forward."""
        if self.inputs is not None or self.lockstep or self._full_masks or self.want_hidden or self.tree is not None:
            return False
        left_padded = bool((mask[:, 1:] >= mask[:, :-1]).all())
        return left_padded and worth_apart(self.device, mask.sum(dim=1).tolist(), mask.shape[1])

    def _prefill_apart(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each row's prompt alone, without its padding, in this ledger (row 0) or in a ledger of its own joined
        to this one (`add_rows`). A row keeps its buffer indices (its padding is counted, not cached): its
        tokens sit in the first columns, holes after them where another row is longer."""
        length = input_ids.shape[1]
        logits = []
        for b, n in enumerate(mask.sum(dim=1).tolist()):
            row = self if b == 0 else KVLedger(self.model, **self._settings)
            logits.append(row._prefill(input_ids[b:b + 1, length - n:], mask[b:b + 1, length - n:], length - n))
            if b:
                self.add_rows(row)
        return torch.cat(logits)

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The prompt [B, L] in one forward; `offset` left-padding tokens before it are counted, not cached."""
        batch, length = input_ids.shape
        self.pad = (attention_mask == 0).long().sum(dim=1) + offset
        index = torch.arange(offset, offset + length, device=self.device)[None, :].expand(batch, length)
        self.slots = torch.where(attention_mask.bool(), index, -1)
        self.n_cached = torch.full((batch,), offset + length, dtype=torch.long, device=self.device)
        self.spare = 0
        logits = self._run(input_ids.to(self.device), self.slots, keep=1, past=0, first=True)
        check_rollback_cache(self.cache)  # layers exist only after the first forward
        self._drop_outside_windows()
        return logits[:, -1]

    def forward(self, tokens: torch.Tensor, n_valid: torch.Tensor, columns: torch.Tensor | None = None,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """Append tokens [B, W]; row b uses its first n_valid[b] (the rest become holes). Returns logits [B, W, V],
        or with `columns` [B, K] (long, < W) only those after row b's tokens columns[b] [B, K, V].

        The valid tokens of row b are its buffer tokens n_cached[b] .. n_cached[b] + n_valid[b] - 1.
        `columns` is for drafts and chain levels, which read few positions: the vocabulary projection of the others
        is work thrown away (for a 150k vocabulary, a large share of a small draft's prompt catch-up).

        `parents` [B, W] makes the tokens tree nodes (see the module docstring): each one's parent as an index into
        the pending tree region's columns (numbered from 0 in the order appended, these tokens included), or -1
        for a child of the committed tokens. They stay pending until `keep_tree`.
        """
        n_valid = on_device(n_valid, self.device)
        if parents is not None:
            return self._forward_tree(tokens, n_valid, parents.to(self.device), columns)
        if self.tree is not None:
            raise RuntimeError("KVLedger: a tree is pending; call keep_tree before a forward of committed tokens")
        new, slots = self._append(tokens.shape[1], n_valid)
        keep = columns.to(self.device) if columns is not None else tokens.shape[1]
        # A ledger that caches nothing yet reads its prompt now: a first forward (a draft's images go with it).
        first = self.physical_length == 0 and self.inputs is not None
        logits = self._run(on_device(tokens, self.device), slots, keep=keep, new=new, first=first)
        self.slots = slots
        self.n_cached = self.n_cached + n_valid
        return logits

    def _forward_tree(self, tokens, n_valid, parents, columns):
        from .tree import ancestry

        if self.tree is None:
            check_no_convolutions(self.model, "token trees")
        batch, width = tokens.shape
        offset = torch.arange(width, device=self.device)[None, :]
        start, before, in_use = self.tree if self.tree is not None else (
            self.physical_length, parents[:, :0], offset[:, :0].expand(batch, 0) > 0)
        parents = torch.cat([before, parents], dim=1)                         # region indices, [B, T]
        in_use = torch.cat([in_use, offset < n_valid[:, None]], dim=1)
        region = parents.shape[1]
        if bool((in_use & (parents >= torch.arange(region, device=self.device))).any()):
            raise ValueError("KVLedger: a tree node's parent must be appended before it")
        anc, depth = ancestry(parents, in_use)                                # [B, T, T], [B, T]
        new = torch.where(in_use[:, -width:], self.n_cached[:, None] + depth[:, -width:] - 1, -1)
        slots = torch.cat([self.slots, new], dim=1)
        valid = slots >= 0
        committed = valid[:, None, :start].expand(batch, width, start)
        own = anc[:, region - width:] & valid[:, None, start:]                # ancestors (and self) that are valid
        allowed = torch.cat([committed, own], dim=2)
        allowed[:, :, -width:] |= torch.eye(width, dtype=torch.bool, device=self.device)   # holes see themselves
        keep = columns.to(self.device) if columns is not None else width
        logits = self._run(tokens.to(self.device), slots, keep=keep, new=new, allowed=allowed)
        self.slots, self.tree = slots, (start, parents, in_use)
        return logits

    def keep_tree(self, kept: torch.Tensor) -> None:
        """End the pending tree region: its columns where kept [B, T] is True stay (per row, a path down from the
        region's first level), the others become holes. n_cached grows by the kept count."""
        if self.tree is None:
            return
        start = self.tree[0]
        kept = kept.to(self.device)[:, : self.tree_width]
        region = self.slots[:, start:]
        self.slots = torch.cat([self.slots[:, :start], torch.where(kept, region, -1)], dim=1)
        self.n_cached = self.n_cached + kept.long().sum(dim=1)
        self.tree = None
        self._trim()

    def forward_pruned(self, tokens: torch.Tensor, n_valid: torch.Tensor, runner):
        """Like `forward`, through `runner`, which may drop the tail of rows mid-forward (Top-K early exit).

        runner(model, tokens, n_valid, mask, position_ids, cache, past) -> (logits [B, W', V], kept [B]): row b keeps
        its first kept[b] <= n_valid[b] positions, W' = max(kept); the runner leaves every cache layer `past + W'`
        long. Dropped positions become holes, exactly like rejected ones. Returns (logits, kept)."""
        if self.inputs is not None:
            raise ValueError(f"{type(self.model).__name__} takes inputs besides token ids (images, encoder outputs): "
                             "a forward that stops mid-way cannot pass them on. Verify with the FullVerifier.")
        check_no_convolutions(self.model, "a verification that stops mid-way (Top-K early exit)")
        if self._indexed:
            raise ValueError(f"{type(self.model).__name__} keeps indexer keys beside its KV cache, which a "
                             "verification that stops mid-way does not cut back: verify with the FullVerifier.")
        self.release_spares()    # a runner sees live rows only
        self._restore_dropped()  # and every column of every layer
        self.hidden = None       # a runner that stops mid-way has no last hidden states for every position
        n_valid = n_valid.to(self.device)
        new, slots = self._append(tokens.shape[1], n_valid)
        mask, position_ids = self._inputs(slots, new)
        past = self.physical_length
        with self._cut_back_on_failure(past):
            logits, kept = runner(self.model, tokens.to(self.device), n_valid, mask, position_ids, self.cache, past)
        kept = torch.minimum(kept.to(self.device), n_valid)
        width = logits.shape[1]
        lengths = {layer.keys.shape[-2] for layer in self._layers()}
        if lengths != {past + width}:
            raise RuntimeError(f"verifier left cache layers of lengths {sorted(lengths)}, expected {past + width}")
        offset = torch.arange(width, device=self.device)[None, :]
        new = torch.where(offset < kept[:, None], new[:, :width], -1)
        self.slots = torch.cat([self.slots, new], dim=1)
        self.n_cached = self.n_cached + kept
        return logits, kept

    def ones(self, batch: int) -> torch.Tensor:
        """[batch] ones on the ledger's device, never written: `n_valid` for a forward of one valid token a row (a
        step without drafts). The ledger knows it by identity, and appends such a column without checking for holes."""
        if self._one_each is None or self._one_each.shape[0] != batch:
            self._one_each = torch.ones(batch, dtype=torch.long, device=self.device)
        return self._one_each

    def filled(self, batch: int, width: int) -> torch.Tensor:
        """[batch] of `width`, never written: `n_valid` for a forward in which every row's `width` tokens are valid
        (a chain every row drafted to the full width, which the proposal check knows on the host). Like `ones`, the
        ledger knows it by identity and appends its columns without checking for holes."""
        if width == 1:
            return self.ones(batch)
        known = self._width_each
        if known is None or known.shape[0] != batch or self._width != width:
            self._width_each, self._width = torch.full((batch,), width, dtype=torch.long, device=self.device), width
        return self._width_each

    def _append(self, width: int, n_valid: torch.Tensor):
        """Slots of `width` new columns (row b's first n_valid[b] valid): (new [B, W], all slots [B, P + W])."""
        every_one = n_valid is self._one_each and width == 1    # every row's one token valid: no hole opens
        dense = every_one or (n_valid is self._width_each and width == self._width)
        if every_one:
            new = self.n_cached[:, None]
        elif width == 1:                 # a step without drafts: one column, at the row's length where it is valid
            new = torch.where(n_valid[:, None] > 0, self.n_cached[:, None], -1)
        elif dense:
            new = self.n_cached[:, None] + offsets(width, self.device)
        else:
            offset = offsets(width, self.device)
            new = torch.where(offset < n_valid[:, None], self.n_cached[:, None] + offset, -1)
        slots = torch.cat([self.slots, new], dim=1)
        if dense and self.slots is self._full:
            self._full = slots
        return new, slots

    def _inputs(self, slots, new):
        """(attention mask [B, P + W] or None, position ids [B, W]) for a forward over `new` given all `slots`."""
        if slots is self._full:          # known without a hole (see `_append`): nothing to mask, no check
            return None, new - self.pad[:, None]
        valid = slots >= 0
        position_ids = torch.where(new >= 0, new - self.pad[:, None], 0)   # holes get 0, like stock's padding
        # An all-valid mask is dropped, as stock generate does: the model then takes the same attention path.
        if bool(valid.all()):
            self._full = slots
            return None, position_ids
        return valid.long(), position_ids

    def _run(self, tokens, slots, keep, new=None, past=None, allowed=None, first=False):
        """The model over `tokens`; logits of the last `keep` columns, or (keep a [B, K] tensor) of columns keep[b].
        `allowed` [B, W, P + W] bool: which slots each token attends to (a tree), instead of the causal mask.
        `first`: the call's first forward (the prompt), which takes the inputs only a first forward takes.
        A forward that fails leaves the cache as the ledger accounts for it: the layers it had already run appended
        their columns, and they are cut back to the `past` columns held before (default: the ledger's length)."""
        index = slots if new is None else new
        mask, position_ids = self._inputs(slots, index)
        # A prompt with model inputs gets the model's own masks, as stock's prefill does (Gemma 3 lets image tokens
        # attend to each other both ways): nothing but left padding is masked there.
        own_masks = first and self.inputs is not None
        if allowed is None and (self._full_masks or self.windows) and not own_masks:
            allowed = _causal_allowed(slots, tokens.shape[1])
        if allowed is not None:
            mask = self._windowed(allowed, slots, position_ids) if self.windows else allowed
        live = tokens.shape[0]
        if self.spare:
            tokens, mask, position_ids = self._with_spares(tokens, mask, position_ids)
            if torch.is_tensor(keep):
                keep = torch.cat([keep, keep.new_zeros((self.spare, keep.shape[1]))])
        if allowed is not None:
            mask = _per_type(mask, lambda m: attention_mask_4d(self.model, m))
        if isinstance(mask, dict) or self._convolutions and allowed is not None:
            mask = self._mask_mapping(mask, index, tokens.shape[0])
        # Per-row columns go to the model only where it gathers them per row; otherwise it keeps all, we select.
        passes = self._keeps_logits and (PER_ROW_LOGITS_TO_KEEP or not torch.is_tensor(keep))
        kwargs = {"logits_to_keep": keep} if passes else {}
        if self._no_router_logits:
            kwargs["output_router_logits"] = False
        if self.want_hidden:             # the last layer's only (transformers >= 5.24 keeps no other)
            kwargs["output_hidden_states"] = -1
        if self._takes_positions:
            given = self.inputs.position_ids(index) if self.inputs is not None else None
            kwargs["position_ids"] = position_ids if given is None else given
        if self.inputs is not None:
            kwargs.update(self.inputs.forward_kwargs(index, first))
            kwargs[self.inputs.tokens_key], kwargs[self.inputs.mask_key] = tokens, mask
        else:
            kwargs.update(input_ids=tokens, attention_mask=mask)
        self._hand_conv_states()
        with self._cut_back_on_failure(self.physical_length if past is None else past):
            out = self.model(use_cache=True, **with_cache(self.model, self.cache), **kwargs)
        self._keep_conv_inputs(tokens.shape[1])
        self.hidden = out.hidden_states[-1][:live] if self.want_hidden else None
        logits = out.logits[:live]
        if passes:                       # the model has already kept only the wanted positions
            return logits
        return select_positions(logits, keep[:live] if torch.is_tensor(keep) else keep)

    def _windowed(self, allowed, slots, position_ids):
        """The allowed matrix [B, W, P + W] per layer type: a sliding layer's token also sees only the tokens less
        than its window before it (positions, not columns: holes do not count), as transformers' sliding masks do.
        One tensor where every layer is of one type (the model takes a single mask), else {layer type: tensor}."""
        keys = slots - self.pad[:, None]                                             # [B, P + W] positions
        distance = position_ids[:, :, None] - keys[:, None, :]                       # [B, W, P + W]
        columns = torch.arange(slots.shape[1], device=slots.device)
        own = columns[None, :] == columns[-position_ids.shape[1]:, None]             # each token's own column
        masks = {kind: allowed if window is None else allowed & (_sees(kind, window, position_ids, keys, distance)
                                                                 | own[None])
                 for kind, window in self.windows.items()}
        masks = {kind: mask[..., self.dropped.get(kind, 0):] for kind, mask in masks.items()}   # what layers hold
        if len(masks) == 1 and not self._convolutions:
            return next(iter(masks.values()))
        return _one_mask(self.model, masks) if self.one_mask else masks

    def _mask_mapping(self, mask, index: torch.Tensor, rows: int) -> dict:
        """A 4-D mask, or {layer type: 4-D mask}, as the mapping the model reads: a hybrid type's under its
        attention kind, and for convolutions the 2-D padding mask of the new columns `index` [B, W] (slots, -1 at
        holes; spare rows after them up to `rows`), so that left padding and holes feed them zeros, as stock's
        padding does. A 4-D mask alone carries no padding for them."""
        kinds = self._layer_kinds
        if not isinstance(mask, dict):
            mask = {kind: mask for kind in kinds if kind not in ("conv", "dummy")}
        mapping = {MASK_KEYS.get(kind, kind): each for kind, each in mask.items()}
        if self._convolutions:
            valid = (index >= 0).long()
            valid = torch.cat([valid, valid.new_ones((rows - len(valid), valid.shape[1]))])
            mapping.update({CONV_MASK_KEYS[kind]: valid for kind in kinds if kind in CONV_MASK_KEYS})
        return mapping

    def _with_spares(self, tokens, mask, position_ids):
        """The forward's inputs with the spare rows after the live ones: token 0 at position 0, attending to every
        slot of their own row (what they attend to is never read; an all-masked row could turn into NaN)."""
        live, width = tokens.shape
        if mask is None:
            mask = tokens.new_ones((live, self.physical_length + width))
        tokens = torch.cat([tokens, tokens.new_zeros((self.spare, width))])
        mask = _per_type(mask, lambda m: torch.cat([m, m.new_ones((self.spare,) + tuple(m.shape[1:]))]))
        position_ids = torch.cat([position_ids, position_ids.new_zeros((self.spare, width))])
        return tokens, mask, position_ids

    # -- commit / rollback -----------------------------------------------------------------------------------------
    def rollback(self, keep_len: torch.Tensor, dropped: list[int] | None = None) -> None:
        """Keep only buffer tokens [0, keep_len[b]) of each row: later slots become holes; then trim the tail.

        `dropped`: where the caller knows it on the host, how many of the last forward's columns each row gives back
        (a chain verification's drafts past what the row accepted). Over a cache without holes whose last forward
        appended every row's columns, the extents then follow without a read of the slots, and a rollback that gives
        nothing back changes no slot (on a GPU, a wait less each step)."""
        keep_len = keep_len.to(self.device)
        if self.tree is not None:   # a pending tree nobody kept: none of it stays
            self.keep_tree(torch.zeros_like(self.slots, dtype=torch.bool))
        # The hint holds only over a cache without holes, and only as counts of this ledger's rows and columns.
        known = (dropped is not None and self.slots is self._full and len(dropped) == self.slots.shape[0]
                 and all(type(d) is int and 0 <= d <= self.slots.shape[1] for d in dropped))
        if known and max(dropped, default=0) == 0:
            self._drop_outside_windows()
            return
        self.slots = torch.where(self.slots < keep_len[:, None], self.slots, -1)
        self.n_cached = torch.minimum(self.n_cached, keep_len)
        if known:                # row b holds every column but its last dropped[b]
            width = self.slots.shape[1]
            used = longest = width - min(dropped)
            shortest = width - max(dropped)
        else:
            used, longest, shortest = self._extent()
        self._trim(used)
        if shortest == self.slots.shape[1]:      # every row holds every column: the next forward needs no hole check
            self._full = self.slots
        self._drop_outside_windows()
        free = self.physical_length - longest       # slots compaction would free: the longest row keeps its own
        if not self.lockstep and free >= self.compact_min and free > self.compact_threshold * self.physical_length:
            self.compact()

    def select_rows(self, index: torch.Tensor, spare: int = 0) -> None:
        """Keep only the given rows (rows that finished leave the batch), and up to `spare` of the cache rows that
        leave as spare rows (see the module docstring): the cache then holds len(index) + spare rows."""
        index = index.to(self.device)
        if self.tree is not None:
            self.tree = (self.tree[0], self.tree[1][index], self.tree[2][index])
        layers = self._layers()
        gone = torch.ones(self.held_rows, dtype=torch.bool, device=self.device)
        gone[index] = False
        spare = min(int(spare), int(gone.sum())) if layers and self.inputs is None and not self.conv_inputs else 0
        physical = torch.cat([index, gone.nonzero().squeeze(1)[:spare]])
        self.conv_inputs = {i: record[physical] for i, record in self.conv_inputs.items()}
        if self.inputs is not None:
            self.inputs.select_rows(index, self.slots.shape[0])
        self.slots, self.pad, self.n_cached = self.slots[index], self.pad[index], self.n_cached[index]
        for layer in layers + self._cross_layers():
            _map_columns(layer, lambda t, dim: t[physical])
        self.spare = spare
        self._trim()

    def release_spares(self) -> None:
        """Drop the spare rows from the cache (before rows are added or pruned)."""
        if self.spare:
            self.select_rows(torch.arange(self.slots.shape[0], device=self.device))

    @property
    def held_rows(self) -> int:
        """Rows in the cache tensors: the live rows and the spares."""
        return self.slots.shape[0] + self.spare

    def add_rows(self, other: "KVLedger") -> None:
        """Append the rows of `other` (the same model, prefilled apart: requests joining a running batch). The
        shorter side gets hole columns on the right, so nothing moves but the concatenation."""
        self.release_spares()
        other.release_spares()
        for ledger in (self, other):      # the joining rows' columns start at 0: every layer holds them again
            ledger._restore_dropped()
        width = max(self.physical_length, other.physical_length)
        for ledger in (self, other):
            ledger._widen(width)
        mine_rows, their_rows = self.slots.shape[0], other.slots.shape[0]
        self.slots = torch.cat([self.slots, other.slots])
        self.pad = torch.cat([self.pad, other.pad])
        self.n_cached = torch.cat([self.n_cached, other.n_cached])
        self._add_conv_rows(other, mine_rows, their_rows)
        mine, theirs = self._layers(), other._layers()
        if not theirs:                 # the joining rows have no KV yet (an offloaded draft): holes for them
            for layer in mine:
                _map_columns(layer, lambda t, dim: _with_rows(t, their_rows))
        elif not mine:                 # no KV here yet: take theirs, with holes for the rows already here
            self.cache = other.cache
            for layer in self._layers():
                _map_columns(layer, lambda t, dim: _with_rows(t, mine_rows, before=True))
        else:
            for a, b in zip(mine, theirs):
                for name, _ in _column_tensors(a):
                    setattr(a, name, torch.cat([getattr(a, name), getattr(b, name)]))

    def drop_kv(self) -> None:
        """Free every cached entry and keep the rows: nothing is cached past each row's padding, so the next
        forward starts from the row's first token (an offloaded draft's catch-up)."""
        self.cache = new_cache(self.model, self.windows)
        self.use_inputs(self.inputs)
        self.dropped, self.conv_inputs = {}, {}
        self.spare = 0
        self.slots = self.slots[:, :0]
        self.n_cached = self.pad.clone()

    def row_entries(self, row: int) -> dict:
        """What live row `row` holds, by cache layer index: the buffer indices of its entries ("index", ascending) and
        their tensors (keys and values [H, n, D], an indexed layer's indexer keys [n, D]); under ("conv", index), a
        convolution layer's input columns per state ("inputs" {state: [C, n]}, "kernel" {state: size}); an
        encoder-decoder model's cross-attention keys and values under ("cross", index). Copies: the row may leave
        the batch after (the cache generate returns is built from them)."""
        cache = self._own_cache
        entries: dict = {}
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
                continue
            kind = self._kinds[i] if i < len(self._kinds) else None
            slots = self.slots[row, self.dropped.get(kind, 0):]
            columns = (slots >= 0).nonzero().flatten()
            entries[i] = {"index": slots[columns]}
            for name, dim in _column_tensors(layer):
                entries[i][name] = getattr(layer, name)[row].index_select(dim - 1, columns)
        columns = (self.slots[row] >= 0).nonzero().flatten()
        for (i, s), inputs in self.conv_inputs.items():
            conv = entries.setdefault(("conv", i), {"index": self.slots[row, columns], "inputs": {}, "kernel": {}})
            conv["inputs"][s], conv["kernel"][s] = inputs[row][:, columns], cache.layers[i].conv_kernel_size[s]
        for i, layer in enumerate(self._cross_layers()):
            entries["cross", i] = {"keys": layer.keys[row].clone(), "values": layer.values[row].clone()}
        return entries

    def layer_columns(self, index: int, kind: str | None):
        """What cache layer `index` (of layer type `kind`) holds for the live rows: (keys, values [B, H, C, D],
        positions [B, C] long, -1 at holes and padding), its columns being the ledger's from those the type dropped
        on. For a drafter that attends to the target's own keys (a Gemma 4 assistant); read-only."""
        layer = self._own_cache.layers[index]
        live, dropped = self.slots.shape[0], self.dropped.get(kind, 0)
        slots = self.slots[:, dropped:]
        positions = torch.where(slots >= 0, slots - self.pad[:, None], -1)
        return layer.keys[:live], layer.values[:live], positions

    def _widen(self, width: int) -> None:
        extra = width - self.physical_length
        if extra <= 0:
            return
        self.slots = torch.cat([self.slots, self.slots.new_full((self.slots.shape[0], extra), -1)], dim=1)
        self.conv_inputs = {i: _with_columns(r, extra, after=True) for i, r in self.conv_inputs.items()}
        for layer in self._layers():
            _map_columns(layer, lambda t, dim: _with_columns(t, extra, dim, after=True))

    def _extent(self) -> tuple[int, int, int]:
        """(columns in use: the last column any row holds a slot in, plus 1; the most slots one row holds; the fewest),
        in one host read: a rollback reads them every step."""
        if not self.slots.numel():
            return 0, 0, 0
        valid = self.slots >= 0
        ends = offsets(valid.shape[1] + 1, self.device)[0, 1:]                   # column c's end: c + 1
        held = valid.sum(dim=1)
        used, longest, shortest = torch.stack([(valid.any(dim=0) * ends).max(), held.max(), held.min()]).tolist()
        return used, longest, shortest

    def compact(self) -> None:
        """Move each row's valid entries to the front of the cache (stable), then trim. Attention is unchanged."""
        valid = self.slots >= 0
        keep = int(valid.sum(dim=1).max())
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :keep]   # valid slots first
        self.slots = torch.where(valid.gather(1, order), self.slots.gather(1, order), -1)
        spares = torch.arange(keep, device=self.device).expand(self.spare, keep)      # their content is never read
        physical = torch.cat([order, spares])
        old = self.dropped
        new = {kind: self._dead_prefix(kind, window) for kind, window in self._sliding()}
        for kind, layer in self._typed_layers():
            # A column a sliding type no longer holds is outside every row's window: any content serves (masked).
            index = (physical[:, new.get(kind, 0):] - old.get(kind, 0)).clamp(min=0)
            _map_columns(layer, lambda t, dim: self._gather(t, dim, index))
        self.dropped = {kind: count for kind, count in new.items() if count}
        self.conv_inputs = {i: r.gather(2, physical[:, None, :].expand(-1, r.shape[1], -1))
                            for i, r in self.conv_inputs.items()}
        self.compactions += 1
        self._trim()

    def _gather(self, tensor: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Columns index [rows, keep] of each row of `tensor` (the compaction gather)."""
        from .acceptor import gather_slots

        heads = tensor if dim == 2 else tensor.unsqueeze(1)
        out, self.compact_path = gather_slots(heads, index, self.kernels)
        return out if dim == 2 else out.squeeze(1)

    @contextlib.contextmanager
    def _cut_back_on_failure(self, length: int):
        """A forward that fails midway has appended columns to the layers it ran: cut every layer back to its first
        `length` columns, what the ledger accounts for, and let the error go on."""
        try:
            yield
        except BaseException:
            for kind, layer in self._typed_layers():
                held = max(length - self.dropped.get(kind, 0), 0)
                if layer.keys.shape[-2] > held:
                    _map_columns(layer, lambda t, dim: t.narrow(dim, 0, held))
            raise

    def _trim(self, length: int | None = None) -> None:
        """Drop the columns after the last one any row holds a slot in (`length`, where the caller has read it)."""
        if self.tree is not None:       # the pending region's columns are counted by its ancestry
            return
        if length is None:
            length = self._extent()[0]
        if length < self.slots.shape[1]:
            self.slots = self.slots[:, :length]
            self.conv_inputs = {i: record[..., :length] for i, record in self.conv_inputs.items()}
            self.dropped = {kind: min(count, length) for kind, count in self.dropped.items()}
            for kind, layer in self._typed_layers():
                held = length - self.dropped.get(kind, 0)
                _map_columns(layer, lambda t, dim: t.narrow(dim, 0, held))

    # -- sliding windows -------------------------------------------------------------------------------------------
    def _sliding(self):
        """(layer type, window) of the sliding types whose columns this ledger drops (none without `rewind`)."""
        if self.rewind is None or self.lockstep or self._full_masks or self.tree is not None:
            return []
        return [(kind, window) for kind, window in self.windows.items() if window is not None]

    def _dead_prefix(self, kind: str, window: int) -> int:
        """Leading columns no row attends to again through a layer of this kind: holes, or tokens at least a window
        before the row's next position, or of a chunk before its (rows never roll back more than `rewind` below what
        they keep)."""
        reach = (self.n_cached - window - self.rewind)[:, None]
        if kind == CHUNKED:                        # the last buffer index before the next position's chunk
            start = self.n_cached - self.rewind - self.pad
            reach = (start - start % window + self.pad - 1)[:, None]
        dead = ((self.slots < 0) | (self.slots <= reach)).all(dim=0)
        live = (~dead).nonzero()
        return int(live[0]) if live.numel() else self.physical_length

    def _drop_outside_windows(self) -> None:
        if not self.dropped and not self._sliding():       # nothing dropped and nothing to drop: no layer to visit
            return
        new = {kind: max(self._dead_prefix(kind, window), self.dropped.get(kind, 0))
               for kind, window in self._sliding()}
        for kind, layer in self._typed_layers():
            cut = new.get(kind, 0) - self.dropped.get(kind, 0)
            if cut > 0:
                _map_columns(layer, lambda t, dim: t.narrow(dim, cut, t.shape[dim] - cut))
        self.dropped = {kind: count for kind, count in new.items() if count}

    def _restore_dropped(self) -> None:
        """Give the sliding types' tensors their dropped columns back, as zeros (masked: outside every window)."""
        for kind, layer in self._typed_layers():
            count = self.dropped.get(kind, 0)
            if count:
                _map_columns(layer, lambda t, dim: _with_columns(t, count, dim))
        self.dropped = {}

    def _typed_layers(self):
        """(layer type, layer) of the layers the ledger keeps per slot (type None where no column is dropped)."""
        kept = set(map(id, self._layers()))
        return [(self._kinds[i] if i < len(self._kinds) else None, layer)       # layers the model adds: none dropped
                for i, layer in enumerate(self._own_cache.layers) if id(layer) in kept]

    @property
    def _own_cache(self):
        """The cache the ledger keeps per slot: an encoder-decoder model's self-attention cache, else the cache."""
        return self.cache.self_attention_cache if isinstance(self.cache, EncoderDecoderCache) else self.cache

    def _layers(self):
        """The KV cache layers the ledger keeps per slot (an encoder-decoder model's self-attention layers)."""
        cache = self._own_cache
        return [layer for layer in cache.layers if isinstance(layer, DynamicLayer) and layer.is_initialized]

    # -- convolution layers ----------------------------------------------------------------------------------------
    def _conv_layers(self) -> dict[int, LinearAttentionLayer]:
        cache = self._own_cache
        return {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionLayer)}

    def _conv_states(self):
        """(cache layer index, state index, layer) of every convolution state the model has written."""
        return [(i, s, layer) for i, layer in self._conv_layers().items() for s in range(layer.number_of_states)
                if layer.is_conv_states_initialized[s]]

    def _hand_conv_states(self) -> None:
        """Before a forward: each convolution state is, per row, its last `kernel` valid input columns (zeros where
        the row has fewer, as after a left-padded prompt), and the layer records what it appends."""
        if not self._convolutions:
            return
        for layer in self._conv_layers().values():
            layer.activate_past_recording()
        last: dict[int, torch.Tensor] = {}        # kernel -> each row's last valid columns (the same for every state)
        for i, s, layer in self._conv_states():
            record = self.conv_inputs.get((i, s))
            if record is None:
                continue                          # nothing cached yet: the forward starts the row from zeros
            kernel = layer.conv_kernel_size[s]
            if kernel not in last:
                last[kernel] = self._last_valid(kernel)
            padded = torch.cat([record.new_zeros(record.shape[:2] + (1,)), record], dim=2)   # column 0: zeros
            state = padded.gather(2, (last[kernel] + 1)[:, None, :].expand(-1, record.shape[1], -1))
            layer.conv_states[s], layer.has_previous_state[s] = state, True

    def _last_valid(self, count: int) -> torch.Tensor:
        """[B, count]: each row's last `count` valid columns in order, -1 where the row has fewer."""
        valid = self.slots >= 0
        rank = valid.long().flip(1).cumsum(1).flip(1)            # valid columns from here to the end
        take = torch.arange(self.physical_length, device=self.device).expand_as(self.slots)
        chosen = torch.where(valid & (rank <= count), take, -1)
        return torch.sort(chosen, dim=1).values[:, -count:] if count else take[:, :0]

    def _keep_conv_inputs(self, width: int) -> None:
        """After a forward of `width` columns: append the input columns each convolution layer recorded (it holds
        its state and them: at least `width` columns)."""
        if not self._convolutions:
            return
        for i, s, layer in self._conv_states():
            full = layer.conv_states[s]
            new = full[..., -width:]
            old = self.conv_inputs.get((i, s))
            self.conv_inputs[i, s] = new if old is None else torch.cat([old, new], dim=2)
            layer.conv_states[s] = full[..., -layer.conv_kernel_size[s]:]        # the record lives here, not there

    def _add_conv_rows(self, other: "KVLedger", mine: int, theirs: int) -> None:
        for i in set(self.conv_inputs) | set(other.conv_inputs):
            a, b = self.conv_inputs.get(i), other.conv_inputs.get(i)
            like = a if a is not None else b
            a = a if a is not None else like.new_zeros((mine,) + like.shape[1:])
            b = b if b is not None else like.new_zeros((theirs,) + like.shape[1:])
            self.conv_inputs[i] = torch.cat([a, b])

    def _cross_layers(self):
        """An encoder-decoder model's cross-attention layers: one row per batch row, fixed for the call."""
        if not isinstance(self.cache, EncoderDecoderCache):
            return []
        return [layer for layer in self.cache.cross_attention_cache.layers if layer.is_initialized]

    @property
    def tree_width(self) -> int:
        """Columns of the pending tree region (0 when none is pending)."""
        return self.physical_length - self.tree[0] if self.tree is not None else 0

    @property
    def physical_length(self) -> int:
        return self.slots.shape[1]
