"""What a target's forwards take besides token ids, the attention mask and the cache: images and their encodings,
token types, multi-channel positions (Qwen2-VL's M-RoPE) and an encoder-decoder model's encoder outputs.

`generate` prepares these for a call; which of them a forward consumes is the model's own decision, read from its
`prepare_inputs_for_generation`, asked twice: as the first forward of a call (`is_first_iteration=True`: pixel
values, multimodal encoder outputs, audio features, token types) and as a later one (images dropped, the encoder
outputs kept). So an architecture that transformers serves works without a list of names here.

Inputs as long as the sequence are given per token by its buffer index i (the generate layout: left padding, the
prompt of L columns, generated tokens), following stock's `_update_model_kwargs_for_generation`:
- positions (any number of channels): the prompt's own for i < L; for a generated token the last prompt position
  plus (i - L + 1) in every channel. So a verified draft gets the position one-token decoding would have given it;
- `token_type_ids`: the prompt's for i < L, the last prompt value after it;
- `mm_token_type_ids` (and `moe_mm_token_type_ids`): the prompt's for i < L, 0 (text) after it;
- `image_attention_mask` (IDEFICS: [B, L, images]): the prompt's for i < L, its last row after it.

An encoder-decoder model decodes its `decoder_input_ids`: the ledger's tokens and mask go there, and the encoder
mask and outputs go with every forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from . import compat

# Inputs as long as the sequence and what a generated token gets: None = the last prompt value, an int = that value.
# IDEFICS's image_attention_mask [B, L, images] says which images each token attends to; stock repeats the prompt's
# last row for generated tokens.
_PER_TOKEN = {"token_type_ids": None, "mm_token_type_ids": 0, "moe_mm_token_type_ids": 0, "image_attention_mask": None}
# What the ledger supplies itself, whatever prepare_inputs_for_generation says (the masks besides: see `mask_key`).
LEDGER_INPUTS = frozenset({"input_ids", "decoder_input_ids", "position_ids", "decoder_position_ids", "use_cache",
                           "logits_to_keep", "cache_position", "inputs_embeds", "decoder_inputs_embeds",
                           *compat.CACHE_INPUTS})


def encoder_decoder(model) -> bool:
    """Whether `model` generates its decoder's tokens from an encoder's outputs (T5, BART, Whisper, ...)."""
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _keys(model) -> tuple[str, str]:
    """The names the ledger's tokens and mask go under for `model`."""
    return ("decoder_input_ids", "decoder_attention_mask") if encoder_decoder(model) else ("input_ids", "attention_mask")


class ModelInputs:
    """A call's inputs beyond tokens, mask and cache, for every forward of the target (see the module docstring).

    `tokens_key` / `mask_key`: the names the ledger's tokens and mask go under (`decoder_input_ids` and
    `decoder_attention_mask` for an encoder-decoder model)."""

    def __init__(self, model, first: dict, later: dict, positions, per_token: dict, prompt_length: int):
        self.tokens_key, self.mask_key = _keys(model)
        self.first, self.later = first, later
        self.positions = positions          # [..., B, L] prepared position ids, or None (the ledger's own)
        self.per_token = per_token          # {name: (table [B, L], value after the prompt or None = last)}
        self.prompt_length = prompt_length
        self.cross = "encoder_outputs" in later     # attends to an encoder's outputs (a cross-attention cache)

    @classmethod
    def of_call(cls, model, input_ids, attention_mask, cache, extras: dict, positions) -> "ModelInputs | None":
        """The call's inputs, or None for a decoder that takes nothing but tokens, mask and cache (the ledger's own
        inputs then, unchanged). `extras`: what generate prepared besides those; `positions`: its position ids."""
        decoder = encoder_decoder(model)
        extras = {name: value for name, value in extras.items() if value is not None}
        if not extras and not decoder:
            return None
        mask_key = _keys(model)[1]
        asked = dict(extras, use_cache=True, **{mask_key: attention_mask})
        if positions is not None:
            asked["decoder_position_ids" if decoder else "position_ids"] = positions
        first = compat.prepare_inputs(model, input_ids, cache, is_first_iteration=True, **asked)
        later = compat.prepare_inputs(model, input_ids[:, -1:], cache, is_first_iteration=False, **asked)
        per_token = {name: (extras[name], fill) for name, fill in _PER_TOKEN.items()
                     if torch.is_tensor(extras.get(name))}
        keep = lambda found: {k: v for k, v in found.items()        # noqa: E731
                              if k not in LEDGER_INPUTS and k != mask_key and v is not None}
        if positions is not None and positions.shape[-1] != input_ids.shape[1]:
            raise ValueError(f"position_ids cover {positions.shape[-1]} tokens but input_ids has {input_ids.shape[1]}.")
        return cls(model, keep(first), keep(later), positions, per_token, input_ids.shape[1])

    @classmethod
    def shared_encoder(cls, draft, inputs: "ModelInputs | None", own: dict | None = None) -> "ModelInputs | None":
        """A draft decoder's inputs: encoder outputs (and the encoder mask) that every draft forward attends to.

        `own`: an encoder-decoder draft's own encoder outputs for the call ({"encoder_outputs", "attention_mask"}),
        which it attends to as the target does to its own. Without them, the target's (`inputs`), for a draft whose
        forward takes them (Distil-Whisper's decoder as a causal LM, stock assisted generation's encoder sharing).
        None where there are none or the draft reads none: it drafts from the tokens."""
        parameters = inspect.signature(draft.forward).parameters
        found = own if own is not None else inputs.later if inputs is not None else {}
        if "encoder_outputs" not in found or "encoder_outputs" not in parameters:
            return None
        shared = {"encoder_outputs": found["encoder_outputs"]}
        mask = found.get("attention_mask")
        # An encoder-decoder model takes the encoder's mask as its attention_mask (the decoder's has its own name).
        mask_name = "attention_mask" if encoder_decoder(draft) else "encoder_attention_mask"
        if mask is not None and mask_name in parameters:
            shared[mask_name] = mask
        return cls(draft, shared, dict(shared), None, {}, 0)

    # -- per forward ---------------------------------------------------------------------------------------------------
    def forward_kwargs(self, index: torch.Tensor, first: bool) -> dict:
        """The inputs of a forward over the tokens at buffer indices index [B, W] (-1: a hole)."""
        given = self.first if first else self.later
        kwargs = {name: value for name, value in given.items() if name not in self.per_token}
        for name, (table, fill) in self.per_token.items():
            if name in given:
                kwargs[name] = _per_token(table, index, fill)
        return kwargs

    def position_ids(self, index: torch.Tensor) -> torch.Tensor | None:
        """[..., B, W] positions of the tokens at buffer indices index [B, W]; None: the ledger numbers them."""
        if self.positions is None:
            return None
        last = self.prompt_length - 1
        found = _gather(self.positions, index.clamp(0, last))
        return found + (index - last).clamp(min=0)

    def select_rows(self, index: torch.Tensor, batch: int) -> None:
        """Keep only the given rows of a batch of `batch` rows (rows that finished leave)."""
        if self.positions is not None:
            self.positions = self.positions.index_select(-2, index.to(self.positions.device))
        self.per_token = {name: (table[index.to(table.device)], fill) for name, (table, fill) in self.per_token.items()}
        later = {name: _rows(value, index, batch) for name, value in self.later.items()}
        # What the first forward shares with the later ones (encoder outputs, their mask) leaves with its rows too: a
        # ledger that drops its KV (an offloaded draft) runs a first forward again, with the rows that stayed.
        self.first = {name: later[name] if name in later and value is self.later[name] else value
                      for name, value in self.first.items()}
        self.later = later


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table [..., B, L] at index [B, W] -> [..., B, W]."""
    index = index.to(table.device)
    return table.gather(-1, index.expand(*table.shape[:-2], *index.shape))


def _per_token(table: torch.Tensor, index: torch.Tensor, fill) -> torch.Tensor:
    """table [B, L, ...] at index [B, W] -> [B, W, ...]: a column's value, or after the prompt `fill` (None: the last
    prompt column's)."""
    table = table.movedim((0, 1), (-2, -1))                  # [..., B, L], as _gather takes it
    last = table.shape[-1] - 1
    found = _gather(table, index.clamp(0, last))
    if fill is not None:
        found = torch.where(index.to(table.device) <= last, found, torch.full_like(found, fill))
    return found.movedim((-2, -1), (0, 1))


def _rows(value, index: torch.Tensor, batch: int):
    """A row-wise value (a tensor, or a model output of tensors, whose first dimension is the batch) at `index`;
    anything else (an image grid, a flag) unchanged."""
    if torch.is_tensor(value):
        return value[index.to(value.device)] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, Mapping):     # a ModelOutput (encoder outputs) or a dict of them
        selected = {k: _rows(v, index, batch) for k, v in value.items()}
        return type(value)(**selected) if hasattr(value, "to_tuple") else selected
    if isinstance(value, tuple):
        return tuple(_rows(v, index, batch) for v in value)
    return value
