"""Which models spec_adapt can run, decided by their kind before anything runs: the checks that refuse a model by
name, and what its layers are.

- `check_model_kind`: stateful models (stock's own reason) and models that take one token at a time over a cache;
- `sliding_windows`: {layer type: window} of a model with sliding-window (or chunked) layers, refusing layer types
  whose cache cannot be rolled back per row and windows without a 4-D mask to enforce them;
- `check_one_mask`, `one_mask_refusal`: a model that builds every layer type's mask from one mask is served only while
  no window binds;
- `has_layer`, `has_convolutions`, `check_no_convolutions`, `check_tree_attention`: what trees and verifications that
  stop mid-way need of a model's layers.

Each reads the model's class, config and layer types through `spec_adapt.compat`; the KV ledger
(`spec_adapt.ledger`) runs what these checks let through.
"""

from __future__ import annotations

from . import compat
from .compat import CONV_TYPES, attn_implementation, layer_types, takes_4d_mask


class UnsupportedCacheError(ValueError):
    """A model, or a cache, whose entries spec_adapt cannot roll back per row; the message says which and why."""


# Model types whose forward cannot take several new tokens over a filled cache, which every verification needs.
_ONE_TOKEN_AT_A_TIME = {
    "blt": "its global model runs over byte patches, and a forward of several new bytes over a filled cache does not "
           "line up with them (it fails inside the model)",
    "cpmant": "its forward reads the whole sequence at every step (it numbers, segments and masks the tokens from all "
              "of input_ids, ignoring the attention mask, then keeps the columns past the cache), so it cannot take "
              "new tokens alone, holes or rows of different lengths",
    "prophetnet": "its decoder takes one token at a time over a cache (`use_cache` is only supported for "
                  "`decoder_input_ids` of length 1, it asserts, in stock's assisted generation too)",
    "voxtral_realtime": "its streaming audio encoder takes the next slice of audio with every generated token, by "
                        "the cache length, and keeps a cache of its own that cannot go back (transformers' own "
                        "tests skip assisted decoding for it: it does not fall in the paradigm of assisted decoding)",
}


def check_model_kind(model) -> None:
    """Stock refuses assisted generation for stateful models (recurrent states cannot go back to an earlier
    token); so does spec_adapt, with the same reason. Models that decode only one token per forward over a cache are
    refused by name, with theirs."""
    if compat.stateful(model):
        raise UnsupportedCacheError(compat.stateful_reason(model))
    reason = _ONE_TOKEN_AT_A_TIME.get(getattr(model.config, "model_type", None))
    if reason is not None:
        raise UnsupportedCacheError(f"spec_adapt cannot run {type(model).__name__}: {reason}. Generate with stock "
                                    "`generate` and no drafter.")


# Layer types whose cache entries the ledger keeps per column: attention (a window is enforced by the mask) and
# short convolutions (the ledger keeps their input columns), alone or beside attention.
_ROLLBACK_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention", "dummy",
                   *CONV_TYPES)


def sliding_windows(model) -> dict[str, int | None] | None:
    """{layer type: its window (None: full attention)} for a model with sliding-window layers; None when every layer
    attends fully. Layer types whose state cannot be rolled back per row are refused with the reason."""
    check_model_kind(model)
    types = layer_types(model)
    bad = sorted({kind for kind, _ in types if kind not in _ROLLBACK_TYPES})
    if bad:
        raise UnsupportedCacheError(
            f"spec_adapt cannot roll back the {bad} layers of {type(model).__name__} per row (their cache transforms "
            "or shares state instead of keeping one entry per token). Generate without a drafter for this model.")
    windows = {kind: kwargs.get("sliding_window") for kind, kwargs in types if kind not in ("conv", "dummy")}
    if all(window is None for window in windows.values()):
        return None
    if not takes_4d_mask(model):
        raise UnsupportedCacheError(
            f"{type(model).__name__} has sliding-window layers, which spec_adapt enforces with 4-D attention masks: "
            f"load it with attn_implementation='sdpa' or 'eager' (it uses {attn_implementation(model)!r}).")
    return windows


def one_mask_refusal(model) -> str:
    """Why a model that takes one mask for all its layer types (`compat.takes_one_mask`) cannot go past its smallest
    window: the message both `check_one_mask` and the ledger raise."""
    windows = [window for window in (sliding_windows(model) or {}).values() if window]
    return (f"{type(model).__name__} builds the masks of its sliding-window layers (window {min(windows)}) from the one "
            "attention mask it is given, which cannot carry both a full and a sliding mask: spec_adapt serves it "
            f"while no window binds, up to {min(windows)} tokens in all (prompt and generated). Generate fewer tokens, "
            "or without a drafter.")


def check_one_mask(model, max_length: int | None) -> None:
    """Refuse up front a call on a model that takes one mask (`compat.takes_one_mask`) where a window would bind."""
    windows = [window for window in (sliding_windows(model) or {}).values() if window]
    if windows and compat.takes_one_mask(model) and (max_length is None or max_length > min(windows)):
        raise ValueError(one_mask_refusal(model))


def has_layer(model, kind: str) -> bool:
    """Whether any decoder layer of `model` has this cache layer type."""
    return any(each == kind for each, _ in layer_types(model))


def has_convolutions(model) -> bool:
    """Whether any decoder layer of `model` has short convolutions (alone or beside attention)."""
    return any(kind in CONV_TYPES for kind, _ in layer_types(model))


def check_no_convolutions(model, what: str) -> None:
    """A convolution layer reads the tokens before it in column order: a tree's siblings would be its predecessors,
    and a forward that stops mid-way leaves no input columns to keep."""
    if has_convolutions(model):
        raise ValueError(f"{type(model).__name__} has convolution layers, which read the previous tokens in order: "
                         f"{what} cannot run on it. Draft chains (a policy without depth) with the FullVerifier.")


def check_tree_attention(model) -> None:
    """Trees need a model that takes a 4-D attention mask: attn_implementation 'sdpa' or 'eager', and no layer that
    reads the tokens before it in column order (a convolution sees a sibling as a predecessor)."""
    check_no_convolutions(model, "token trees")
    if not takes_4d_mask(model):
        raise ValueError(
            f"Token trees need attn_implementation 'sdpa' or 'eager' (each node attends to its ancestors only, through "
            f"a 4-D mask), but {type(model).__name__} uses {attn_implementation(model)!r}. Load it with "
            "attn_implementation='sdpa', or draft chains (a policy without depth)."
        )
