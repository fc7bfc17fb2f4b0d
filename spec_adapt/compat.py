"""Every transformers internal spec_adapt relies on, named in one place.

transformers renames things between releases: 5.24 calls the generation cache `cache` where 5.20-5.23 called it
`past_key_values` (the old name warns and goes away in 5.40). When a release renames something else, the change is
made here, once. Public, documented API (AutoModel, GenerationConfig, LogitsProcessorList, the logits processors)
is imported where it is used; what is listed here is either private or has been renamed within the tested range.

The tested range is `TESTED_TEXT` (pyproject.toml declares it; `constraints.txt` pins the newest end, and
`make test` also runs the identity, contract and entry-point suites on the oldest end).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping

import torch
import transformers
import transformers.modeling_utils
from transformers import DynamicCache, EncoderDecoderCache, GenerationConfig                               # noqa: F401 (re-exported)
from transformers.cache_utils import (                                                  # noqa: F401 (re-exported)
    CacheLayerMixin, DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer, LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionLayer,
    get_layer_types_and_kwargs,
)
from transformers.generation.candidate_generator import (                              # noqa: F401 (re-exported)
    AssistedCandidateGenerator, PromptLookupCandidateGenerator,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria   # noqa: F401
from transformers.generation.utils import (                                             # noqa: F401 (re-exported)
    GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput,
)
from transformers.masking_utils import create_causal_mask as _create_causal_mask

try:        # multi-token prediction layers shipped in a checkpoint beside the model's (transformers >= 5.24)
    from transformers.modeling_layers import MtpModel
except ImportError:
    MtpModel = None

try:        # a KV-sharing layer's cache (type "dummy"): transformers >= 5.21; before, no model builds one
    from transformers.cache_utils import DummyLayer
except ImportError:
    class DummyLayer:                                                                   # noqa: D101 (never built)
        pass

# Models whose cache holds a recurrent state (Mamba and its hybrids, linear attention, RWKV, xLSTM). Up to 5.24 each
# declares `_is_stateful` and stock refuses assisted generation for it; transformers 5.25 dropped the attribute when
# its assisted generation learned to rewind recurrent states at batch 1 (`Cache.activate_past_recording`). These are
# the model types that declared it in 5.24; a model of a type not listed is also stateful where its cache layers are
# recurrent ones (the "linear_attention" layer type).
STATEFUL_MODEL_TYPES = frozenset({
    "bailing_hybrid", "bamba", "deepseek_v4", "falcon_h1", "falcon_mamba", "glm5_next", "glm5_next_text",
    "granitemoehybrid", "jamba", "kimi_linear", "lara_mini", "mamba", "mamba2", "minicpm_ocr", "minicpmv4_6",
    "minicpmv4_7", "nemotron3_5_transcribe", "nemotron_h", "nemotron_h_omni", "olmo_hybrid", "qwen3_5",
    "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp", "qwen4_exp_text",
    "recurrent_gemma", "rwkv", "xlstm", "zamba", "zamba2", "zaya",
})
STOCK_REWINDS_RECURRENT_STATES = hasattr(transformers.cache_utils.Cache, "get_recurrent_states_to_keep")

def stateful(model) -> bool:
    """Whether `model` keeps a recurrent state in its cache (which cannot be taken back per row to an earlier token)."""
    if getattr(model, "_is_stateful", False):
        return True
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in STATEFUL_MODEL_TYPES:
        return True
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def stateful_reason(model) -> str:
    """Why a stateful model gets no drafter: stock's own words where stock refuses it (transformers <= 5.24)."""
    name = type(model).__name__
    if not STOCK_REWINDS_RECURRENT_STATES:
        return (f"assisted generation is not supported with stateful models, such as {name} (its recurrent state "
                "cannot be reset to an earlier token, in stock transformers either). Generate without a drafter.")
    return (f"spec_adapt cannot take back the recurrent state of {name} per row to an earlier token (transformers "
            f"{VERSION} rewinds it in its own assisted generation at batch size 1: call generate without spec_adapt "
            "for this model, or generate without a drafter).")


# Private torch operations `spec_adapt.prepare` (execution.py) calls, the ones Inductor's CPU weight prepacking
# emits. Present in every torch of the declared range (2.6 to 2.15); a build without oneDNN lacks them, and prepare
# then leaves the model as it is and says why.
@functools.cache
def mkldnn_op(name: str):
    """torch.ops.mkldnn.<name> (`_reorder_linear_weight`, `_linear_pointwise`, `_is_mkldnn_bf16_supported`), or None
    where this torch build has no such op."""
    return getattr(torch.ops.mkldnn, name, None) if torch.backends.mkldnn.is_available() else None


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many references hold `tensor`'s storage (torch's private `_storage_Use_Count`, which prepare reads to know
    whether moving a weight would cut an alias off). Raises AttributeError where torch no longer has it."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@functools.cache
def _use_count_alone() -> int:
    """What `storage_use_count` reads for a tensor no other holds: 1 on torch 2.6, 2 on later releases (whose
    `untyped_storage()` object holds a reference of its own while the count is read)."""
    return storage_use_count(torch.empty(1))


def storage_shared(tensor: torch.Tensor) -> bool:
    """Whether another tensor shares `tensor`'s storage (a view, a detached alias, a `state_dict` entry)."""
    return storage_use_count(tensor) > _use_count_alone()


# The ends of the declared ranges (pyproject.toml) the compatibility subset ran on (docs/compatibility.md records
# each run); the Makefile installs the same versions (TORCH_OLDEST, TORCH_NEWEST, TRANSFORMERS_OLDEST,
# TRANSFORMERS_NEWEST; tests/test_install.py checks they agree).
TESTED_ENDS = {"torch": ("2.6.0", "2.15.0"), "transformers": ("5.20.0", "5.25.0")}
TESTED_TEXT = "transformers 5.20 to 5.25, torch 2.6 to 2.15"    # the declared ranges, both ends tested
VERSION = transformers.__version__

# The names generate hands a custom_generate function the cache under (newest first).
CACHE_INPUTS = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def _cache_argument(forward) -> str:
    parameters = inspect.signature(forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    # A forward that takes **kwargs only (a wrapper): the name this transformers' own models take.
    return "cache" if "cache" in inspect.signature(_create_causal_mask).parameters else "past_key_values"


def cache_argument(model) -> str:
    """The keyword `model.forward` takes its cache under: `cache` on transformers >= 5.24, else `past_key_values`."""
    return _cache_argument(getattr(type(model), "forward", None) or model.forward)


def with_cache(model, cache) -> dict:
    """The forward keyword arguments that hand `model` this cache, under the name it expects."""
    return {cache_argument(model): cache}


def pop_cache(model_kwargs: dict):
    """The cache generate prepared for a custom_generate function, under whichever name this release uses."""
    found = [model_kwargs.pop(name) for name in CACHE_INPUTS if name in model_kwargs]
    found = [cache for cache in found if cache is not None]
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def _prepare_cache_argument(prepare) -> str:
    parameters = inspect.signature(prepare).parameters
    return "past_key_values" if "past_key_values" in parameters and "cache" not in parameters else "cache"


def prepare_inputs(model, input_ids, cache, **kwargs) -> dict:
    """`model.prepare_inputs_for_generation`: what a forward of this model consumes of a call's inputs (the cache
    passed under the name this release's function takes)."""
    prepare = type(model).prepare_inputs_for_generation
    return model.prepare_inputs_for_generation(input_ids, **{_prepare_cache_argument(prepare): cache}, **kwargs)


def prepare_passes_positions(model) -> bool:
    """Whether stock generate hands `model`'s forward the position ids it prepared. A model whose
    `prepare_inputs_for_generation` drops them (Kosmos-2's text model, which numbers tokens from padding id + 1 + the
    cache length) gets none. Asked with two tokens and no cache; a model that cannot be asked without inputs of its
    own (images on every forward) is taken to pass them, as `GenerationMixin` does."""
    ids = torch.ones(1, 2, dtype=torch.long, device=model.device)
    try:
        found = prepare_inputs(model, ids, None, attention_mask=torch.ones_like(ids), use_cache=True,
                               position_ids=torch.arange(2, device=model.device)[None])
    except Exception:  # noqa: BLE001 - a model-specific preparation that needs its own inputs
        return True
    return found.get("position_ids") is not None


def generation_positions(model, input_ids, model_kwargs: dict):
    """The position ids `generate` prepares for a decoder-only model's prompt (`_prepare_position_ids_for_generation`,
    which multimodal models override: Qwen2-VL's M-RoPE), or None for a model whose forward takes none."""
    if getattr(model.config, "is_encoder_decoder", False) or \
            "position_ids" not in inspect.signature(model.forward).parameters:
        return None
    return model._prepare_position_ids_for_generation(input_ids, dict(model_kwargs))


def output_cache(output):
    """The cache a model forward returned (`cache` on >= 5.24, `past_key_values` before)."""
    # Only the fields the output holds: reading the old name's alias logs a deprecation notice.
    fields = list(output.keys()) if isinstance(output, Mapping) else list(vars(output))
    return next((getattr(output, name) for name in CACHE_INPUTS if name in fields), None)


def output_cache_field(cache) -> dict:
    """A generate output's cache field: `cache` on >= 5.24, `past_key_values` before."""
    fields = {field.name for field in dataclasses.fields(GenerateDecoderOnlyOutput)}
    return {"cache" if "cache" in fields else "past_key_values": cache}


def layer_types(model) -> list[tuple[str, dict]]:
    """(layer type, its cache kwargs, e.g. {"sliding_window": 8}) per decoder layer, as DynamicCache reads them."""
    config = model.config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(config)
    return list(zip(types, kwargs))


# Layer types with short convolutions beside (or instead of) attention: LFM2's "conv", Inkling's "hybrid" (full
# attention) and "hybrid_sliding" (a sliding window). Their cache layers are `LinearAttentionLayer`s, each holding
# `number_of_states` convolution states.
CONV_TYPES = ("conv", "hybrid", "hybrid_sliding")
# In the mask mapping a model builds (or takes ready-made: `causal_mask_mapping`), a hybrid layer reads its
# attention mask under its attention kind, and each convolution layer type reads the 2-D padding mask of the new
# tokens under its own key (LFM2's under "conv", Inkling's under "linear_attention").
MASK_KEYS = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
CONV_MASK_KEYS = {"conv": "conv", "hybrid": "linear_attention", "hybrid_sliding": "linear_attention"}
# The full-attention cache layer for each sliding one (the ledger runs sliding layers full and masks the window).
FULL_LAYER = {DynamicSlidingWindowLayer: DynamicLayer,
              LinearAttentionAndSlidingWindowAttentionLayer: LinearAttentionAndFullAttentionLayer}


def create_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids=None):
    """transformers.masking_utils.create_causal_mask (its cache argument was renamed: passed by position)."""
    return _create_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids=position_ids)


# Whether models take a [B, K] tensor of per-row positions as `logits_to_keep` (transformers >= 5.21, through
# modeling_utils.slice_logits_to_keep); on older releases such a tensor indexes every row with every row's positions.
PER_ROW_LOGITS_TO_KEEP = hasattr(transformers.modeling_utils, "slice_logits_to_keep")


# -- private fields ---------------------------------------------------------------------------------------------------
def pad_token_tensor(generation_config):
    """The pad token generate resolved for this call (a private field of the prepared GenerationConfig)."""
    return getattr(generation_config, "_pad_token_tensor", None)


def mask_length(generation_config):
    """The width of the attention mask generate dropped because it was all ones (private, set by generate)."""
    return getattr(generation_config, "_mask_length", None)


def attn_implementation(model) -> str | None:
    """The attention implementation a model's decoder layers run (`_attn_implementation` of its text config, for a
    composite model, where the layers read it: PaliGemma 2's Gemma 2 runs eager under a top config that says sdpa,
    and an eager layer adds its mask to the scores, so it must get an additive one)."""
    config = model.config
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        text = config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


def takes_4d_mask(model) -> bool:
    """Whether the model's attention takes an arbitrary 4-D mask (sdpa and eager do; flash attention takes padding
    only): token trees, sliding windows kept by mask and a forward narrowed mid-way all need one."""
    return attn_implementation(model) in ("sdpa", "eager")


# Model types whose forward builds every layer type's attention mask from the one mask it is given (PaliGemma calls
# create_causal_mask on it, whatever it is): a {layer type: mask} mapping fails there.
_ONE_MASK_MODELS = frozenset({"paligemma"})


def takes_one_mask(model) -> bool:
    """Whether `model` takes one attention mask for all its layer types (PaliGemma 2's full and sliding layers)."""
    return getattr(model.config, "model_type", None) in _ONE_MASK_MODELS


def generation_default(name: str):
    """The value generate fills into a GenerationConfig field left unset (e.g. num_assistant_tokens = 20): a setting
    equal to it may not have been chosen by the user."""
    return GenerationConfig._get_default_generation_params().get(name, getattr(GenerationConfig(), name, None))


def stock_generate_frame(frame) -> bool:
    """Whether a Python frame is transformers' own `generate` (where a user's `streamer=` lives)."""
    return frame.f_code.co_name == "generate" and "transformers" in frame.f_code.co_filename


# -- the arguments generate hands a custom_generate callable ---------------------------------------------------------
# transformers' generate pops `tokenizer=` and `assistant_tokenizer=` off a call's arguments in
# `GenerationMixin._extract_generation_mode_kwargs`, then hands a custom_generate callable only the arguments its
# signature adds to `_sample`'s: the two tokenizers never reach it, and `stop_strings=` fail for want of a tokenizer
# ("could not locate a tokenizer"). For the functions registered here, they stay among the generation-mode arguments
# that generate reads (its stop-string criteria) and hands on.
TOKENIZER_INPUTS = ("tokenizer", "assistant_tokenizer")
_TAKES_TOKENIZERS: list = []


def hand_tokenizers_to(function):
    """Make `model.generate(..., custom_generate=function, tokenizer=..., assistant_tokenizer=...)` build stock's
    stop-string criteria with the tokenizer and pass both tokenizers to `function` (a no-op where generate has no
    `_extract_generation_mode_kwargs`). Returns `function`."""
    from transformers.generation.utils import GenerationMixin

    if not any(function is known for known in _TAKES_TOKENIZERS):
        _TAKES_TOKENIZERS.append(function)
    original = GenerationMixin.__dict__.get("_extract_generation_mode_kwargs")
    if original is None or getattr(original, "hands_tokenizers", False):
        return function

    @functools.wraps(original)
    def extract(self, custom_generate, kwargs, *args, **more):
        given = {name: kwargs.get(name) for name in TOKENIZER_INPUTS}
        found = original(self, custom_generate, kwargs, *args, **more)
        if any(custom_generate is known for known in _TAKES_TOKENIZERS):
            found.update({name: value for name, value in given.items() if value is not None})
        return found

    extract.hands_tokenizers = True
    GenerationMixin._extract_generation_mode_kwargs = extract
    return function


# -- multi-token prediction (MTP) layers ------------------------------------------------------------------------------
def mtp_layer_count(model) -> int | None:
    """How many MTP layers the checkpoint of `model` ships (its text config's `num_mtp_layers`), or None."""
    count = getattr(model.config.get_text_config(), "num_mtp_layers", None)
    return count or None


def load_mtp(model):
    """The MTP layers of `model`'s checkpoint, as stock's `MTPCandidateGenerator` loads them: `MtpModel.from_pretrained`
    on the device of the target's last decoder layer, the embedding, head and rotary embedding shared with it."""
    if MtpModel is None:
        raise ValueError(f"transformers {VERSION} has no MtpModel: multi-token prediction drafting needs transformers "
                         ">= 5.24.")
    if mtp_layer_count(model) is None:
        raise ValueError(f"{type(model).__name__} has no `num_mtp_layers` in its config: its checkpoint ships no "
                         "multi-token prediction layers to draft with (stock's use_mtp=True refuses it too).")
    device = next(p.device for p in model.get_decoder().layers[-1].parameters())
    return MtpModel.from_pretrained(model, device_map={"": device}).eval()


def mtp_depth(mtp) -> int:
    """How many MTP layers an `MtpModel` chains: one drafted token each per forward."""
    return len(mtp.layers)


def mtp_layer_type(mtp, index: int) -> str | None:
    """The attention type of MTP layer `index` (its config's `layer_types`), or None where it has none."""
    types = getattr(mtp.config, "layer_types", None)
    return types[index] if types is not None else None


def mtp_layer_forward(mtp, index: int, input_ids, hidden, position_ids, attention_mask, cache):
    """One MTP layer over a window: `MtpModel.forward_layer`'s body with the caller's attention mask (stock builds a
    mask without padding: its MTP runs at batch 1). Returns the layer's hidden states [B, W, H]."""
    embeds = mtp.embed_tokens(input_ids).to(hidden.device)
    position_embeddings = None
    if mtp.rotary_emb is not None:
        kwargs = {"layer_type": mtp.config.layer_types[index]} if mtp.has_per_layer_rope else {}
        position_embeddings = mtp.rotary_emb(embeds, position_ids=position_ids, **kwargs)
    hidden = mtp.layers[index](embeds, hidden, position_embeddings=position_embeddings, position_ids=position_ids,
                               attention_mask=attention_mask, **{cache_argument(mtp.layers[index]): cache})
    return mtp.shared_post_norm(hidden) if mtp.use_shared_post_norm else hidden


def mtp_logits(mtp, hidden):
    """Logits [..., V] of MTP hidden states through the shared head, as the target projects its own (muP scaling,
    unpadded vocabulary)."""
    return mtp._project_to_logits(hidden)


# -- assistants that attend to the target's own keys and values (Gemma 4 assistants) --------------------------------
# Stock pairs them by class name (`GenerationMixin._get_candidate_generator`): these assistants with targets named
# Gemma4* or Gemma3n*. Of those, only Gemma 4's forwards return the `shared_kv_states` the assistant reads (stock fails
# on a Gemma 3n target once it drafts).
SHARED_KV_ASSISTANTS = ("Gemma4Assistant", "Gemma4UnifiedAssistant")
SHARED_KV_TARGETS = ("Gemma4",)
SHARED_KV_NAMED_ONLY = ("Gemma3n",)     # stock pairs them by name; their outputs carry no shared_kv_states


def is_shared_kv_assistant(model) -> bool:
    """Whether `model` is an assistant that drafts from the target's shared KV states (stock's
    `SinglePositionMultiTokenCandidateGenerator` serves it)."""
    return isinstance(model, torch.nn.Module) and type(model).__name__.startswith(SHARED_KV_ASSISTANTS)


def kv_store_layers(target) -> dict[str, int]:
    """{layer type: the decoder layer whose keys and values the target shares under that type}: the last layer of
    each type that computes its own (its text config's `kv_sharing_modes` "store"), which stock's target returns as
    `shared_kv_states`. Empty where the config names none."""
    config = target.config.get_text_config()
    try:
        modes = list(config.kv_sharing_modes)
    except (AttributeError, ValueError):
        return {}
    return {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}


def shared_kv_backbone_size(assistant) -> int:
    """The hidden size of the target an assistant was trained with (it reads that target's hidden states)."""
    return assistant.config.backbone_hidden_size


def shared_kv_layer_types(assistant) -> set[str]:
    """The attention types an assistant's layers read the target's keys and values under."""
    return set(assistant.config.get_text_config().layer_types)


def shared_kv_step(assistant, embeds, masks: dict, position_ids, shared: dict):
    """One forward of a Gemma 4 assistant over one position per row: `Gemma4AssistantForCausalLM.forward`'s body
    with the caller's masks ({layer type: 4-D mask over that type's shared columns}; stock builds them from a 2-D
    mask, one row at a time). embeds [B, 1, 2 * backbone] are the target's embedding of the row's last token beside
    the target's (or the assistant's previous) hidden state. Returns (logits [B, 1, V], the hidden state [B, 1,
    backbone] the next draft reads)."""
    hidden = assistant.pre_projection(embeds)
    out = assistant.model(input_ids=None, inputs_embeds=hidden, attention_mask=masks, position_ids=position_ids,
                          shared_kv_states=shared, use_cache=False)
    last = out.last_hidden_state
    if assistant.config.use_ordered_embeddings:
        logits = assistant.masked_embedding(last, assistant.lm_head.weight)
    else:
        logits = assistant.lm_head(last)
    return logits, assistant.post_projection(last)


def cache_holds_tokens(cache) -> bool:
    """Whether a cache a call was handed already holds something. `Cache.get_seq_length` answers for attention
    layers only and refuses a cache of convolution layers alone (a model without attention layers), which is judged
    by its layers' own initialized states."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(isinstance(layer, CacheLayerMixin) for layer in layers):
        return cache.get_seq_length() > 0
    return any(any(getattr(layer, name, {}).values()) for layer in layers
               for name in ("is_conv_states_initialized", "is_recurrent_states_initialized"))
