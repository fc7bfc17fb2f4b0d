"""The cache `generate(..., return_dict_in_generate=True)` returns: stock's, built from the rows' committed entries.

The ledger's cache is not one a later call could continue from: its rows hold holes where drafts were rejected, its
sliding layers are full layers, its KV-sharing layers are missing, and the rows that finished first have left it. As
each row leaves the batch, the loop copies what it holds (`KVLedger.row_entries`); at the end they are laid out as
stock's generate lays out its cache: a cache of the class and layers stock's generate makes for this model (full,
sliding-window, KV-sharing, indexed and convolution layers), column j holding the entry of the token at column j of
the returned sequences, for every token but the last (which no forward has read yet). Left padding holds zeros (the
attention mask hides it). A row that stopped before the others has, after its end, the padding stock went on feeding
it: one forward of those tokens over the row's cache gives them. That catch-up needs a model that takes tokens alone;
a model with other inputs (images, encoder outputs) gets None there instead, as does any model whose layer kinds this
layout does not know.
"""

from __future__ import annotations

import inspect

import torch

from . import compat
from .compat import (DummyLayer, DynamicCache, DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer,
                     EncoderDecoderCache, LinearAttentionLayer)
from .ledger import takes_positions


class ReturnedCache:
    """Collects the rows' entries as they leave the batch (`keep`), then builds stock's cache (`build`)."""

    def __init__(self, model):
        self.model = model
        self.rows: dict[int, tuple[int, dict]] = {}     # user row -> (left padding, ledger.row_entries)

    def keep(self, ledger, leaving: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy the entries of the live rows `leaving` [B] (bool) marks; `rows` [B] are their user rows."""
        for local in leaving.nonzero().flatten().tolist():
            self.rows[int(rows[local])] = (int(ledger.pad[local]), ledger.row_entries(local))

    def build(self, sequences: torch.Tensor, lengths: torch.Tensor, tokens_only: bool):
        """Stock's cache for `sequences` [B, T] (row b's tokens: its first lengths[b]), or None where it cannot be
        had (see the module docstring). `tokens_only`: the model's forwards take tokens alone (a catch-up may run)."""
        width = sequences.shape[1] - 1
        if len(self.rows) != sequences.shape[0] or width < 1:
            return None
        rows = []
        for b in range(sequences.shape[0]):
            pad, entries = self.rows[b]
            upto = min(int(lengths[b]) - 1, width)
            if upto < width:              # stopped before the others: stock fed it padding up to the end
                if not tokens_only:
                    return None
                entries = self._catch_up(sequences[b], pad, entries, upto, width)
                if entries is None:
                    return None
            rows.append((pad, entries))
        return _lay_out(self.model, rows, width)

    def _catch_up(self, tokens, pad, entries, upto, width):
        """The row's entries up to `width`: one forward of tokens[upto:width] over a cache of its own entries."""
        cache = _lay_out(self.model, [(pad, entries)], upto)
        if cache is None:
            return None
        mask = torch.ones(1, width, dtype=torch.long, device=tokens.device)
        mask[:, :pad] = 0
        kwargs = {}
        if takes_positions(self.model):       # stock's positions: padding-aware, as the ledger's forwards
            kwargs["position_ids"] = torch.arange(upto - pad, width - pad, device=tokens.device)[None]
        if "output_router_logits" in inspect.signature(self.model.forward).parameters:
            kwargs["output_router_logits"] = False
        self.model(input_ids=tokens[None, upto:width], attention_mask=mask, use_cache=True,
                   **compat.with_cache(self.model, cache), **kwargs)
        return _entries_of(cache, width)


def _stock_cache(model, entries: dict):
    """An empty cache of the class and layers stock's generate makes for this model (its dynamic cache)."""
    config = model.config.get_text_config(decoder=True)
    if any(isinstance(key, tuple) and key[0] == "cross" for key in entries):
        return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    return DynamicCache(config=config)


def _self_attention(cache):
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def _lay_out(model, rows: list, width: int):
    """Stock's cache holding, for each row (pad, entries), its entries at buffer indices < width in columns 0..width-1;
    None where a layer kind is unknown or an entry a layer needs is missing."""
    cache = _stock_cache(model, rows[0][1])
    held = {key if isinstance(key, int) else key[1] for _, entries in rows for key in entries}
    if max(held, default=-1) >= len(_self_attention(cache).layers):
        return None             # layers the model adds to its cache itself (Inkling 2 Loop's passes): unknown here
    for i, layer in enumerate(_self_attention(cache).layers):
        if isinstance(layer, DummyLayer):
            continue
        if isinstance(layer, LinearAttentionLayer):          # convolutions, alone or beside attention (hybrid)
            convs = [entries.get(("conv", i)) for _, entries in rows]
            if any(entry is None for entry in convs):
                return None
            _fill_conv(layer, convs, width)
        if isinstance(layer, DynamicLayer):
            found = [entries.get(i) for _, entries in rows]
            if any(entry is None for entry in found) or not _fill_kv(layer, rows, found, width):
                return None
        elif not isinstance(layer, LinearAttentionLayer):
            return None
    if isinstance(cache, EncoderDecoderCache):
        for i, layer in enumerate(cache.cross_attention_cache.layers):
            found = [entries.get(("cross", i)) for _, entries in rows]
            if any(entry is None for entry in found):
                return None
            layer.update(torch.stack([e["keys"] for e in found]), torch.stack([e["values"] for e in found]))
        cache = EncoderDecoderCache(cache.self_attention_cache, cache.cross_attention_cache)   # its is_updated
    return cache


def _fill_kv(layer, rows, found, width: int) -> bool:
    """Write each row's entries into columns 0..width-1 of a KV layer through the layer's own update (a sliding
    layer keeps its window's last columns, as in stock). False where a column the layer keeps has no entry."""
    window = getattr(layer, "sliding_window", None)
    first = max(width - window + 1, 0) if isinstance(layer, DynamicSlidingWindowLayer) else 0
    out = {}
    for name in ("keys", "values", "indexer_keys"):
        if name not in found[0]:
            continue
        like = found[0][name]
        dim = 1 if name != "indexer_keys" else 0        # the column dim of one row's tensor
        shape = list(like.shape)
        shape[dim] = width
        out[name] = like.new_zeros([len(rows)] + shape)
    for b, ((pad, _), entry) in enumerate(zip(rows, found)):
        index = entry["index"]
        chosen = (index < width).nonzero().flatten()
        held = torch.zeros(width, dtype=torch.bool, device=index.device)
        held[index[chosen]] = True
        if not bool(held[max(first, pad):].all()):
            return False
        for name, tensor in out.items():
            dim = 1 if name != "indexer_keys" else 0
            tensor[b].index_copy_(dim, index[chosen], entry[name].index_select(dim, chosen))
    layer.update(out["keys"], out["values"])
    if "indexer_keys" in out:
        if not isinstance(layer, DynamicIndexedLayer):
            return False
        layer.update_indexer(out["indexer_keys"])
    return True


def _fill_conv(layer, found, width: int) -> None:
    """A convolution layer's states: each row's last `kernel` inputs before column `width` (zeros where fewer)."""
    for s, kernel in found[0]["kernel"].items():
        states = []
        for entry in found:
            chosen = (entry["index"] < width).nonzero().flatten()[-kernel:]
            inputs = entry["inputs"][s][:, chosen]
            states.append(torch.cat([inputs.new_zeros(inputs.shape[0], kernel - inputs.shape[1]), inputs], dim=1))
        state = torch.stack(states)
        layer.lazy_initialization(conv_states=state, state_idx=s, conv_kernel_size=kernel)
        layer.conv_states[s], layer.has_previous_state[s] = state, True


def _entries_of(cache, width: int) -> dict:
    """One row's entries read back from a one-row cache of `width` columns (the catch-up's)."""
    entries = {}
    for i, layer in enumerate(_self_attention(cache).layers):
        if isinstance(layer, LinearAttentionLayer) and any(layer.is_conv_states_initialized.values()):
            entries["conv", i] = _conv_entry(layer, width)
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            held = layer.keys.shape[2]
            device = layer.keys.device
            entries[i] = {"index": torch.arange(width - held, width, device=device),
                          "keys": layer.keys[0], "values": layer.values[0]}
            if getattr(layer, "indexer_keys", None) is not None:
                entries[i]["indexer_keys"] = layer.indexer_keys[0]
    return entries


def _conv_entry(layer, width: int) -> dict:
    """A one-row convolution layer's states as entries: each state's last `kernel` inputs, before column `width`
    (a state with a shorter kernel is padded on the left with zeros, which `_fill_conv` never takes)."""
    states = {s: layer.conv_states[s][0] for s in range(layer.number_of_states) if layer.is_conv_states_initialized[s]}
    kernels = {s: state.shape[-1] for s, state in states.items()}
    most = max(kernels.values())
    inputs = {s: torch.nn.functional.pad(state, (most - kernels[s], 0)) for s, state in states.items()}
    return {"index": torch.arange(width - most, width, device=layer.device), "inputs": inputs, "kernel": kernels}
