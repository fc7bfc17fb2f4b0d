"""Entry points: `model.generate(..., custom_generate=spec_adapt.generate)` and `enable(model)` / `disable(model)`."""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import weakref
from dataclasses import dataclass

import torch

from . import compat
from .compat import GenerateDecoderOnlyOutput, cache_holds_tokens
from .drafters.drafter import ChecksTarget, Drafter, Features, Trees
from .drafters.cross import CrossTokenizerDrafter
from .drafters.early_exit import early_exit_model
from .drafters.lookup import PromptLookupDrafter
from .drafters.model import ModelDrafter
from .drafters.mtp import MTPDrafter, mtp_drafter
from .drafters.shared_kv import SharedKVDrafter
from .drafters.sources import MultiSourceDrafter, SourceState
from .drafters.suffix import SuffixDrafter, SuffixIndex
from .acceptor import Acceptor, EnsembleAcceptor
from .inputs import LEDGER_INPUTS, encoder_decoder
from .ledger import check_rollback_cache
from .model_kinds import check_model_kind, check_one_mask
from .loop import SpeculativeLoop
from .metrics import SpecStats, set_last_stats
from .policies.policy import MAX_WIDTH, Policy, check_policy
from .policies import saved
from .policies.adaptive import Adaptive
from .verifiers import Verifier, check_trees, check_verifier


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the call's speculation statistics. Its cache is stock's (class, layers,
    shapes, each row's committed tokens in stock's columns), so a later plain `generate` can continue from it; it is
    None without `use_cache`, and where a row that stopped early would need a catch-up forward over inputs other than
    tokens (images, encoder outputs), see spec_adapt.returned_cache."""

    spec_stats: SpecStats | None = None


# The inputs generate hands a custom_generate function, in four kinds:
# - those it prepares and the loop computes itself per forward (the mask and the cache are read);
_PREPARED_INPUTS = ("use_cache", "logits_to_keep", "cache_position")
# - those refused by name, with the reason;
_REFUSED_INPUTS = {
    "inputs_embeds": "the loop drafts and verifies token ids: pass input_ids instead of inputs_embeds",
    "decoder_inputs_embeds": "the loop drafts and verifies token ids: pass decoder_input_ids instead",
    "output_attentions": "attentions are not available with speculation: drop output_attentions",
    "output_hidden_states": "hidden states are not available with speculation: drop output_hidden_states",
}
# - those the model's forward takes (images, token types, encoder outputs, ...): passed on as the model's own
#   prepare_inputs_for_generation says (spec_adapt.inputs);
# - anything else: refused with the transformers version and the range spec_adapt is tested on (`_check_inputs`).


def _check_inputs(model, model_kwargs: dict) -> None:
    for name in sorted(model_kwargs):
        if name in _REFUSED_INPUTS:
            raise ValueError(f"spec_adapt does not support the generate input {name!r}: {_REFUSED_INPUTS[name]}.")
    # Named by the forward: its **kwargs take attention options, not model inputs.
    parameters = inspect.signature(model.forward).parameters
    unknown = sorted(name for name, value in model_kwargs.items() if value is not None and name not in parameters)
    if unknown:
        raise ValueError(
            f"spec_adapt does not know these generate inputs: {unknown}: {type(model).__name__}.forward does not take "
            f"them. This is transformers {compat.VERSION}, and spec_adapt is tested on {compat.TESTED_TEXT}. A newer "
            "transformers may hand custom_generate functions inputs under new names: install a tested version "
            "(`make setup`) or report the input."
        )


def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    drafter=None,
    assistant_policy: Policy | None = None,
    spec_stats: SpecStats | None = None,
    spec_streamer=None,
    acceptor: Acceptor | None = None,
    verifier: Verifier | None = None,
    strict: bool = False,
    tokenizer=None,
    assistant_tokenizer=None,
    **model_kwargs,
):
    """Batched speculative decoding, called by transformers as `model.generate(..., custom_generate=generate)`.

    Extra arguments of `model.generate` (transformers passes named parameters of this function through):
    - `drafter`: a draft model (any causal LM sharing the target's tokenizer) or a `Drafter`; None = no speculation.
    - `assistant_policy`: a `Policy` choosing the speculative length each step (default: the policy `enable` set for
      this model, else the process's `Adaptive` for this target, drafter, dtype and device: see `default_policy`).
    - `spec_stats`: a `SpecStats` to fill in (also readable afterwards with `spec_adapt.last_stats()`).
    - `spec_streamer`: a streamer (transformers does not pass `streamer` on to custom_generate functions; a plain
      `streamer=` given to `model.generate` is found and used too).
    - `acceptor`: the accept phase (`spec_adapt.Acceptor(kernels="auto" | "off" | "force")`); default Acceptor().
    - `verifier`: the verify phase (`FullVerifier()`, the default, or `EarlyExitVerifier(layers=..., top_k=...)`).
    - `strict`: True makes a drafter's exception or malformed proposal raise instead of falling back to plain
      decoding (for developing a drafter: a fallback keeps the output right and hides the bug).
    - `tokenizer`, `assistant_tokenizer`: stock's Universal Assisted Generation arguments, the target's and the
      draft's tokenizers: the draft then drafts in its own ids (a `CrossTokenizerDrafter`). `tokenizer` alone serves
      `stop_strings=`, as in stock.
    Greedy output is token-for-token the target's own; sampled output has exactly the target's distribution.
    """
    if stopping_criteria is None:   # called directly rather than through model.generate: let generate prepare
        return model.generate(
            input_ids, generation_config=generation_config, logits_processor=logits_processor,
            custom_generate=generate, drafter=drafter, assistant_policy=assistant_policy, spec_stats=spec_stats,
            spec_streamer=spec_streamer, acceptor=acceptor, verifier=verifier, strict=strict, tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer, **model_kwargs,
        )
    _check_generation_config(generation_config, synced_gpus)
    decoder = encoder_decoder(model)
    # An encoder-decoder model generates its decoder's tokens: its attention_mask is the encoder's, an input.
    attention_mask = model_kwargs.pop("decoder_attention_mask" if decoder else "attention_mask", None)
    cache = compat.pop_cache(model_kwargs)
    positions = model_kwargs.pop("decoder_position_ids" if decoder else "position_ids", None)
    for name in _PREPARED_INPUTS:
        model_kwargs.pop(name, None)
    check_model_kind(model)         # first: a model refused by name is refused whatever inputs it takes
    check_one_mask(model, generation_config.max_length)
    _check_inputs(model, model_kwargs)
    _check_cache(cache)
    # transformers drops an all-ones mask before calling us and records its width (compat.mask_length).
    width = attention_mask.shape[-1] if attention_mask is not None else compat.mask_length(generation_config)
    if width is not None and (width != input_ids.shape[1] or (attention_mask is not None
                                                                and attention_mask.shape[0] != input_ids.shape[0])):
        raise ValueError(f"attention_mask is {width} tokens wide but input_ids has {input_ids.shape[1]} (and "
                         f"{input_ids.shape[0]} rows): give one mask entry per token.")
    _check_left_padding(attention_mask)
    given, ensemble = drafter, _ensemble_weight(generation_config)
    drafter, max_width = _stock_speculation(model, generation_config, drafter)
    drafter = _with_tokenizers(drafter, tokenizer, assistant_tokenizer)
    drafter = with_sources(model, as_drafter(drafter)) if _bare_model(given) and ensemble is None \
        else as_drafter(drafter)
    policy = assistant_policy if assistant_policy is not None else _default_policy(model, drafter, max_width)
    drafter, policy, verifier = check_parts(model, drafter, policy, verifier)
    if acceptor is not None and not isinstance(acceptor, Acceptor):
        raise TypeError(f"acceptor must be a spec_adapt.acceptor.Acceptor, got {type(acceptor).__name__}.")
    acceptor = _ensemble_acceptor(ensemble, drafter, policy, acceptor)
    stats = spec_stats if spec_stats is not None else SpecStats()
    stats.policy = repr(policy)
    stats.lossy = acceptor.lossy if acceptor is not None else None
    if spec_streamer is None:
        spec_streamer = _stock_streamer()       # stock generate already gave it the prompt
    else:
        spec_streamer.put(input_ids[:1].cpu())     # the streamer follows row 0, as stock streamers do (batch 1)

    loop = SpeculativeLoop(
        model, input_ids, attention_mask, drafter=drafter, policy=policy, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, generation_config=generation_config, streamer=spec_streamer,
        stats=stats, cache=cache, acceptor=acceptor, verifier=verifier, strict=strict,
        model_inputs=model_kwargs, positions=positions,
    )
    sequences = loop.run()
    set_last_stats(stats)
    saved.save(policy, _SAVED_AS.get(policy))      # a default policy's state, for the next process's first call
    if generation_config.return_dict_in_generate:
        fields = dict(sequences=sequences, scores=loop.outputs("scores"), logits=loop.outputs("logits"),
                      **compat.output_cache_field(_returned_cache(loop, sequences)))
        if decoder:   # stock's own class: Whisper's generate splits every field per row (stats: `spec_stats=`)
            return compat.GenerateEncoderDecoderOutput(**fields)
        return SpecGenerateOutput(**fields, spec_stats=stats)
    return sequences


def _returned_cache(loop, sequences):
    """Stock's cache for the returned sequences (spec_adapt.returned_cache), or None: without a cache (use_cache=False)
    or where the rows' entries cannot be laid out as stock's."""
    if loop.returns.cache is None:
        return None
    with torch.no_grad():
        return loop.returns.cache.build(sequences, loop.rows_state.lengths, tokens_only=loop.target.inputs is None)


# `tokenizer=` and `assistant_tokenizer=` reach `generate` through transformers' generate, which builds the stop-string
# criteria with the tokenizer (compat.hand_tokenizers_to): one path for custom_generate and for `enable`.
compat.hand_tokenizers_to(generate)


# Policies that live in the process: the one `enable(model, assistant_policy=...)` set per model, and one default
# `Adaptive` per (target, drafter kind, dtype, device). Weak on the model: a deleted model takes its policies along.
_ENABLED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DEFAULTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DEFAULTS_LOCK = threading.Lock()
_SAVED_AS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # default policy -> its file (policies.saved)


def _default_policy(model, drafter, max_width=None) -> Policy:
    enabled = _ENABLED.get(model)
    return enabled if enabled is not None else default_policy(model, drafter, max_width)


def default_policy(model, drafter=None, max_width: int | None = None) -> Adaptive:
    """The process's default `Adaptive` for this target and drafter, in this dtype on this device (drafting at most
    `max_width` tokens a step where given: stock's `num_assistant_tokens` / `prompt_lookup_num_tokens`).

    Made once per process, from what an earlier process's default for them learned (`spec_adapt.policies.saved`:
    saved after each call, `SPEC_ADAPT_POLICY_DIR=off` turns it off), else from the latency profile
    `spec-adapt profile` cached for them (if any), then kept: every later call without an explicit policy learns on
    from where the last one stopped. `reset_default_policies()` forgets."""
    crosses = isinstance(drafter, CrossTokenizerDrafter) or (
        isinstance(drafter, MultiSourceDrafter) and isinstance(drafter.model_drafter, CrossTokenizerDrafter))
    draft_model = _draft_model(drafter) if not crosses else None
    param = next(model.parameters())
    key = (_drafter_key(drafter), str(param.dtype), str(param.device), max_width)
    with _DEFAULTS_LOCK:
        per_model = _DEFAULTS.setdefault(model, {})
        if key not in per_model:
            bound = {} if max_width is None else {"max_gamma": max_width}
            policy = per_model[key] = Adaptive.for_model(model, draft_model, **bound)
            path = _SAVED_AS[policy] = saved.state_path(model, _draft_model(drafter), _drafter_kind(drafter),
                                                        max_width)
            saved.restore(policy, path)
        return per_model[key]


def _draft_model(drafter):
    """The model a drafter drafts with (through a cross-tokenizer or several-source drafter too), or None."""
    if isinstance(drafter, CrossTokenizerDrafter):
        return _draft_model(drafter.inner)
    if isinstance(drafter, MultiSourceDrafter):
        return _draft_model(drafter.model_drafter)
    if isinstance(drafter, SharedKVDrafter):
        return drafter.assistant
    return drafter.model if isinstance(drafter, ModelDrafter) else None


def _drafter_kind(drafter) -> str:
    """The drafter's kind in a saved default policy's name (the draft model itself is in the profile key)."""
    kind = _drafter_key(drafter)
    return "-".join(str(part) for part in kind if isinstance(part, str) and not part.startswith("torch."))


def _drafter_key(drafter) -> tuple:
    if drafter is None:
        return ("none",)
    if isinstance(drafter, ModelDrafter):
        param = next(drafter.model.parameters())
        return (type(drafter).__name__, id(drafter.model), str(param.dtype))
    if isinstance(drafter, SharedKVDrafter):
        param = next(drafter.assistant.parameters())
        return (type(drafter).__name__, id(drafter.assistant), str(param.dtype))
    if isinstance(drafter, CrossTokenizerDrafter):
        return (type(drafter).__name__,) + _drafter_key(drafter.inner)
    if isinstance(drafter, MultiSourceDrafter):
        return (type(drafter).__name__, *drafter.names) + _drafter_key(drafter.model_drafter)
    return (type(drafter).__name__,)


def reset_default_policies(model=None) -> None:
    """Forget what the defaults learned, in this process and on disk (`spec_adapt.policies.saved`): the default
    policies and the default several-source drafter's state (its router's estimates and the suffix index of the
    target's calls, `with_sources`), for `model`, or for every model. The next call starts cold, as a first one."""
    with _DEFAULTS_LOCK:
        if model is None:
            _DEFAULTS.clear()
            _SOURCES.clear()
            saved.forget()
            return
        _SOURCES.pop(model, None)
        for policy in _DEFAULTS.pop(model, {}).values():
            saved.forget(_SAVED_AS.get(policy))


def check_parts(model, drafter, policy, verifier) -> tuple:
    """A call's or an engine's parts, checked once where they enter: the drafter against the target, the policy's
    contract, the verifier against the target, and token trees where both the policy and the drafter plan them.
    Returns (drafter, policy, verifier) as the loop uses them."""
    drafter = as_drafter(drafter)
    if isinstance(drafter, ChecksTarget):
        drafter.validate(model)
    policy = check_policy(policy)
    verifier = check_verifier(verifier)
    verifier.check(model)
    if policy.trees and isinstance(drafter, Trees):
        check_trees(model, verifier)
    if isinstance(drafter, Features) and not verifier.hands_hidden:
        raise ValueError(f"{drafter!r} drafts from the target's hidden states, which {verifier!r} does not hand over "
                         "(it may stop a position before the last layer): verify with FullVerifier().")
    return drafter, policy, verifier


# What the default several-source drafter of a (target, draft model) learned: its router's estimates and the suffix
# index of the target's calls in this process. Weak on both models.
_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _bare_model(drafter) -> bool:
    """A draft model handed over as it is (`drafter=model`, `assistant_model=model`), not a Drafter."""
    return isinstance(drafter, torch.nn.Module) and hasattr(drafter, "get_output_embeddings")


def with_sources(model, drafter, lookup: PromptLookupDrafter | None = None, max_free: int = 32):
    """The default for a draft model: a `MultiSourceDrafter` over it, prompt lookup and the suffix index of this
    target's calls, learning into the state this (target, draft) pair keeps in the process. Other drafters
    (explicit `ModelDrafter`s, multimodal and encoder-decoder drafts, which draft from more than the tokens) stay
    as they are. With `lookup` (the call asked for `prompt_lookup_num_tokens`) a Gemma 4 assistant joins the
    sources too: without it, it drafts alone, as stock's does."""
    joins = _lookup_beside_refusal(model, drafter) is None and (
        type(drafter) is ModelDrafter or (lookup is not None and isinstance(drafter, SharedKVDrafter)))
    if not joins:
        return drafter
    draft_model = _draft_model(drafter)
    with _DEFAULTS_LOCK:
        per_target = _SOURCES.setdefault(model, weakref.WeakKeyDictionary())
        if draft_model not in per_target:
            per_target[draft_model] = (SourceState(max_free), SuffixIndex())
        state, index = per_target[draft_model]
    free = [lookup or PromptLookupDrafter(), SuffixDrafter(index)]
    return MultiSourceDrafter(drafter, free, max_free=max_free, state=state)


def _prompt_input_draft(drafter) -> bool:
    """A draft model `enable` handed the call's images or encoder inputs (`_with_prompt_inputs`)."""
    return type(drafter) is ModelDrafter and bool(drafter.prompt_inputs)


def _lookup_beside_refusal(model, drafter) -> str | None:
    """Why prompt lookup cannot draft beside this draft in the several-source drafter, or None where it can."""
    if _multimodal(model):
        return (f"{type(model).__name__} reads images or audio: its token ids hold placeholders that a draft copied "
                "from the prompt must not repeat")
    if encoder_decoder(model):
        return (f"{type(model).__name__} is an encoder-decoder model: its decoder's tokens are not the prompt, which "
                "its encoder reads")
    if isinstance(drafter, ModelDrafter) and (drafter.prompt_inputs or encoder_decoder(drafter.model)):
        return (f"the draft {type(drafter.model).__name__} drafts from the call's images or encoder inputs beside "
                "its tokens")
    return None


def _check_lookup_beside(model, drafter) -> None:
    """`assistant_model=` with `prompt_lookup_num_tokens`: refused, at the call's start, where the several-source
    drafter cannot hold both (rather than drafting from one and dropping the other without a word)."""
    why = _lookup_beside_refusal(model, drafter)
    if why is not None:
        raise ValueError(f"assistant_model= with prompt_lookup_num_tokens drafts from both through the several-source "
                         f"drafter, which does not serve this call: {why}. Pass one of the two: the draft model "
                         "alone, or prompt_lookup_num_tokens alone.")


def _multimodal(model) -> bool:
    """A target that reads images or audio: its token ids hold placeholders a copied draft must not repeat."""
    config = model.config
    return any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config", "vision_tower"))


def as_drafter(drafter) -> Drafter | None:
    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if compat.is_shared_kv_assistant(drafter):      # a Gemma 4 assistant reads the target's keys, not tokens alone
        return SharedKVDrafter(drafter)
    if _bare_model(drafter):
        return ModelDrafter(drafter)
    raise TypeError(
        f"Cannot draft with {type(drafter).__name__}: pass a causal LM sharing the target's tokenizer or a "
        "spec_adapt Drafter (e.g. ScriptedDrafter)."
    )


# Generation options spec_adapt cannot honour exactly, refused by name rather than silently ignored or approximated:
# (option, is it set?, why and what to do).
_REFUSED = (
    ("guidance_scale", lambda v: v is not None and v != 1,
     "classifier-free guidance keeps its own unconditional cache per generated position, which drafted and rejected "
     "positions would corrupt: generate without assistant_policy/drafter for guided decoding"),
    ("dola_layers", lambda v: v is not None, "DoLa decoding contrasts layers at every position: not combined with "
     "speculation"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search is its own decoding method: not "
     "combined with speculation"),
    ("num_beam_groups", lambda v: v is not None and v > 1, "group beam search is beam search: set num_beams=1"),
    ("diversity_penalty", lambda v: v is not None and v > 0, "diversity_penalty belongs to group beam search"),
    ("constraints", lambda v: bool(v), "constrained beam search is beam search"),
    ("force_words_ids", lambda v: bool(v), "constrained beam search is beam search"),
    ("token_healing", lambda v: bool(v), "token healing rewrites the prompt's tail: heal the prompt first, then "
     "generate"),
    ("prefill_chunk_size", lambda v: v is not None, "the prompt is prefilled in one forward: leave it unset"),
)


def _stock_speculation(model, cfg, drafter):
    """Stock's speculation settings, honoured: `prompt_lookup_num_tokens=n` drafts by prompt lookup up to n tokens a
    step, `assistant_early_exit=k` drafts with the target's first k layers (self-speculation), `num_assistant_tokens`
    bounds the default policy's width and `assistant_confidence_threshold` stops a draft model's row below that top
    probability (the two are read where they differ from generate's defaults, 20 and 0.4, i.e. where someone set
    them). Returns (the drafter, the width bound or None)."""
    lookup, exit_layers = cfg.prompt_lookup_num_tokens, getattr(cfg, "assistant_early_exit", None)
    if getattr(cfg, "use_mtp", None):
        return _mtp_speculation(model, drafter, lookup, exit_layers)
    if lookup is not None and exit_layers is not None:
        raise ValueError("Set prompt_lookup_num_tokens or assistant_early_exit, not both: each is a drafter.")
    if lookup is not None and (_bare_model(drafter) or _prompt_input_draft(drafter)):
        # Stock drafts by prompt lookup alone and leaves the draft model unused; here both draft (several sources).
        _check_count("prompt_lookup_num_tokens", lookup)
        ngram = _check_count("max_matching_ngram_size", getattr(cfg, "max_matching_ngram_size", None) or 2)
        draft, width = _stock_speculation(model, _without_lookup(cfg), drafter)
        draft = as_drafter(draft)
        _check_lookup_beside(model, draft)
        return with_sources(model, draft, PromptLookupDrafter(max_ngram=ngram), lookup), width
    if (lookup is not None or exit_layers is not None) and drafter is not None:
        raise ValueError("prompt_lookup_num_tokens / assistant_early_exit choose the drafter: do not also pass "
                         "drafter= or assistant_model= (a draft model with prompt_lookup_num_tokens drafts from "
                         "both, but not another Drafter).")
    width = _set_by_user(cfg, "num_assistant_tokens")
    threshold = _set_by_user(cfg, "assistant_confidence_threshold")
    if width is not None:
        _check_count("num_assistant_tokens", width)
    if lookup is not None:
        _check_count("prompt_lookup_num_tokens", lookup)
        ngram = getattr(cfg, "max_matching_ngram_size", None) or 2     # stock prompt lookup's default n-gram size
        return PromptLookupDrafter(max_ngram=_check_count("max_matching_ngram_size", ngram)), lookup
    if exit_layers is not None:
        drafter = early_exit_model(model, exit_layers)
    if threshold is not None and not 0 <= threshold <= 1:
        raise ValueError(f"assistant_confidence_threshold must be in [0, 1], got {threshold!r}.")
    if threshold is not None and isinstance(drafter, torch.nn.Module) and not compat.is_shared_kv_assistant(drafter):
        drafter = ModelDrafter(drafter, confidence_threshold=threshold)
    return drafter, width


def _mtp_speculation(model, drafter, lookup, exit_layers):
    """Stock's `use_mtp=True`: draft with the MTP layers of the target's checkpoint, at most as many tokens a step
    as it has layers (stock drafts exactly that many)."""
    if drafter is not None or lookup is not None or exit_layers is not None:
        raise ValueError("use_mtp=True drafts with the target's own multi-token prediction layers: do not also pass "
                         "drafter=, assistant_model=, prompt_lookup_num_tokens or assistant_early_exit.")
    drafter = mtp_drafter(model)
    return drafter, drafter.depth


def _without_lookup(cfg):
    cfg = copy.copy(cfg)
    cfg.prompt_lookup_num_tokens = None
    return cfg


def _ensemble_weight(cfg):
    """Stock's `assistant_ensemble_weight` (lossy ensemble verification), or None. Refused with prompt lookup, as
    stock refuses it: n-gram drafts have no distribution to mix."""
    weight = getattr(cfg, "assistant_ensemble_weight", None)
    if weight is not None and cfg.prompt_lookup_num_tokens is not None:
        raise ValueError("Setting `assistant_ensemble_weight` requires candidate logits from the assistant model. It "
                         "is not supported with prompt lookup decoding.")
    return weight


def _ensemble_acceptor(weight, drafter, policy, acceptor):
    """The accept phase of a call with `assistant_ensemble_weight=w`: an EnsembleAcceptor (in the given acceptor's
    kernel mode), which mixes the draft model's distributions into the target's; the acceptor as given otherwise."""
    if weight is None:
        return acceptor
    if isinstance(drafter, SharedKVDrafter):
        raise ValueError(f"assistant_ensemble_weight with {drafter!r} is not served: its lossy output depends on every "
                         "draft, and a Gemma 4 assistant here attends to committed keys only where stock's also sees "
                         "a rejected draft's, so it would not be stock's ensemble output. Use a draft model as "
                         "assistant_model=, or leave the weight unset (lossless).")
    if type(drafter) is not ModelDrafter and not isinstance(drafter, MTPDrafter):
        kind = f"a {type(drafter).__name__}" if drafter is not None else "no draft"
        raise ValueError(f"assistant_ensemble_weight mixes a draft model's distribution into the target's: pass the "
                         f"draft model itself as assistant_model= (or drafter=); got {kind}.")
    if policy.trees:
        raise ValueError("assistant_ensemble_weight verifies chains of drafts: use a policy that plans no token "
                         "trees.")
    if acceptor is not None and type(acceptor) is not Acceptor:
        raise ValueError(f"assistant_ensemble_weight is an acceptance rule: it does not combine with the acceptor "
                         f"{type(acceptor).__name__}.")
    return EnsembleAcceptor(weight, kernels=acceptor.mode if acceptor is not None else None)


def _set_by_user(cfg, name):
    value = getattr(cfg, name, None)
    return None if value == compat.generation_default(name) else value


def _check_count(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WIDTH:
        raise ValueError(f"{name} must be an int in [1, {MAX_WIDTH}], got {value!r}.")
    return value


def _check_generation_config(cfg, synced_gpus) -> None:
    for name, is_set, why in _REFUSED:
        value = getattr(cfg, name, None)
        if is_set(value):
            raise ValueError(f"spec_adapt does not support {name}={value!r}: {why}.")
    if cfg.num_beams is not None and cfg.num_beams > 1:
        raise ValueError("Speculative decoding does not combine with beam search: set num_beams=1.")
    if cfg.num_return_sequences is not None and cfg.num_return_sequences > 1:
        raise ValueError(
            "num_return_sequences > 1 is not supported with speculation: repeat the rows instead, e.g. "
            "input_ids.repeat_interleave(n, dim=0) (and the attention_mask likewise)."
        )
    if cfg.return_dict_in_generate and (cfg.output_attentions or cfg.output_hidden_states):
        raise ValueError("output_attentions / output_hidden_states are not available with speculation.")
    if synced_gpus:
        raise ValueError("synced_gpus (DeepSpeed ZeRO-3 / FSDP generation) is not supported with speculation.")


def _check_cache(cache) -> None:
    if cache is None:
        return
    check_rollback_cache(cache)
    if cache_holds_tokens(cache):
        raise ValueError(
            "spec_adapt starts from an empty cache: continuing from a filled cache (past_key_values) is not supported. "
            "Pass the whole sequence as input_ids instead."
        )


def _stock_streamer():
    """The `streamer=` a user gave `model.generate`. transformers (5.23) hands a custom_generate function neither it nor
    a way to reach it, though it has already put the prompt into it: without this, a TextIteratorStreamer reader
    would wait forever for `end()`. Read from the calling frame (read-only; None if transformers changes)."""
    frame = inspect.currentframe()
    for _ in range(4):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        if compat.stock_generate_frame(frame):
            return frame.f_locals.get("streamer")
    return None


def _check_left_padding(mask) -> None:
    if mask is None:
        return
    started = mask.cumsum(dim=1) > 0                   # at or after each row's first real token
    if bool(((mask == 0) & started & (mask.flip(1).cumsum(dim=1).flip(1) > 0)).any()):
        raise ValueError(
            "The attention_mask has a gap: a 0 between real tokens of a row. spec_adapt supports left padding "
            "only (zeros before a row's tokens): remove the gap, e.g. tokenize the row's text again."
        )
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "The attention_mask has padding after real tokens (right padding). Decoder-only generation needs left "
            "padding: set tokenizer.padding_side = 'left' before tokenizing the batch. (Stock generate runs it with a "
            "warning that its results are not correct: the next token would be read off a padding position.)"
        )
    if bool((mask.sum(dim=1) == 0).any()):
        raise ValueError("A row of the batch has no real tokens (its attention_mask is all zeros).")


def enable(model, assistant_policy: Policy | None = None):
    """Make `model.generate(**inputs, assistant_model=draft)` (or `drafter=`) run spec_adapt, at any batch size.

    `assistant_policy` becomes the policy of this model's later calls that name none (without it: the process's
    default `Adaptive`, see `default_policy`). A call with neither a draft nor a policy goes to stock transformers
    unchanged. Calling `enable` again replaces the policy. Undo with `disable(model)`."""
    if assistant_policy is not None:
        _ENABLED[model] = check_policy(assistant_policy)
    else:
        _ENABLED.pop(model, None)
    if "generate" in model.__dict__:
        return model
    stock = model.generate

    @functools.wraps(stock)
    def generate_with_policy(*args, assistant_policy=None, **kwargs):
        draft = kwargs.pop("assistant_model", None)
        if draft is not None and kwargs.get("drafter") is not None:
            raise ValueError("Pass the draft as assistant_model or as drafter, not both.")
        if draft is None and kwargs.get("drafter") is None and assistant_policy is None and not _stock_drafts(
                model, kwargs):
            return stock(*args, **kwargs)
        kwargs.setdefault("drafter", _with_prompt_inputs(model, draft, args, kwargs))
        streamer = kwargs.pop("streamer", None)
        return stock(
            *args, custom_generate=generate, assistant_policy=assistant_policy, spec_streamer=streamer, **kwargs
        )

    model.generate = generate_with_policy
    return model


def _with_tokenizers(draft, tokenizer, draft_tokenizer):
    """Stock's Universal Assisted Generation arguments: `assistant_tokenizer=` (the draft's) with `tokenizer=` (the
    target's) make the draft a CrossTokenizerDrafter. Its draft model stops a row below the call's
    `assistant_confidence_threshold`: the ModelDrafter `_stock_speculation` made with the user's threshold keeps it,
    and a bare draft gets stock's 0.4. `tokenizer` alone serves stop_strings (stock's criteria)."""
    if draft_tokenizer is None:
        return draft
    if draft is None:
        raise ValueError("assistant_tokenizer= is the draft's tokenizer: pass the draft as assistant_model= (or "
                         "drafter=) too.")
    if tokenizer is None:
        raise ValueError("A draft with its own tokenizer needs the target's too: pass tokenizer= with "
                         "assistant_tokenizer=.")
    if isinstance(draft, MultiSourceDrafter):
        # prompt_lookup_num_tokens beside the draft (`_stock_speculation`): lookup and the suffix index copy the
        # target's tokens, so the draft model alone crosses tokenizers, a source among them. Its acceptance is not
        # the same draft's with the target's tokenizer: it learns into a state of its own.
        inner = draft.model_drafter
        bare = type(inner) is ModelDrafter and inner.threshold is None    # stock's 0.4 then, as below
        cross = CrossTokenizerDrafter(inner.model if bare else inner, draft_tokenizer, tokenizer)
        return MultiSourceDrafter(cross, draft.free, max_free=draft.max_free, state=SourceState(draft.max_free))
    return CrossTokenizerDrafter(draft, draft_tokenizer, tokenizer)


# Inputs of a call that are not a decoder-only draft's images or features, whatever its forward names.
_NOT_PROMPT_INPUTS = LEDGER_INPUTS | {"attention_mask", "decoder_attention_mask", "labels"}


def _with_prompt_inputs(model, draft, args: tuple, kwargs: dict):
    """A draft model gets what it reads of the call besides the decoder's tokens, handed on here where the call still
    has it (generate encodes images and runs the encoder for the target only): a multimodal draft the call's inputs
    its forward names (pixel values, image grids, ...), read with its prompt; an encoder-decoder draft the call's
    encoder inputs, for its own encoder. The ModelDrafter made for them drafts under the call's
    `assistant_confidence_threshold` where the user set one, as `_stock_speculation` makes a bare draft's."""
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "get_output_embeddings"):
        return draft
    shared = _encoder_inputs(model, draft, args, kwargs) if encoder_decoder(draft) else _image_inputs(draft, kwargs)
    if not shared:
        return draft
    return ModelDrafter(draft, prompt_inputs=shared,
                        confidence_threshold=_call_setting(model, kwargs, "assistant_confidence_threshold"))


def _call_setting(model, kwargs: dict, name: str):
    """A generation setting of a call `enable` intercepts (its argument, else its generation config's), None where it
    is generate's default (not chosen by the user)."""
    config = kwargs.get("generation_config") or model.generation_config
    value = kwargs.get(name, getattr(config, name, None))
    return None if value == compat.generation_default(name) else value


def _image_inputs(draft, kwargs: dict) -> dict:
    names = inspect.signature(draft.forward).parameters
    return {k: v for k, v in kwargs.items() if k in names and k not in _NOT_PROMPT_INPUTS and v is not None
            and (torch.is_tensor(v) or isinstance(v, dict))}


def _encoder_inputs(model, draft, args: tuple, kwargs: dict) -> dict:
    """The call's encoder inputs under the names the draft's encoder takes: the target's main input (positional,
    `inputs=` or by its name: `input_ids`, `input_features`, ...) as the draft's, and the attention mask."""
    main = args[0] if args else kwargs.get("inputs", kwargs.get(model.main_input_name))
    found = {draft.main_input_name: main, "attention_mask": kwargs.get("attention_mask")}
    return {name: value for name, value in found.items() if value is not None}


def _stock_drafts(model, kwargs) -> bool:
    """Whether a call asks for stock's own drafting (prompt lookup or early exit), by argument or generation config."""
    config = kwargs.get("generation_config") or model.generation_config
    return any(kwargs.get(name, getattr(config, name, None)) is not None for name in _STOCK_DRAFTING) or \
        bool(kwargs.get("use_mtp", getattr(config, "use_mtp", None)))


_STOCK_DRAFTING = ("prompt_lookup_num_tokens", "assistant_early_exit")


def disable(model):
    """Undo `enable(model)` (its policy is forgotten too)."""
    model.__dict__.pop("generate", None)
    _ENABLED.pop(model, None)
    return model
