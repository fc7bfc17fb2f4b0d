"""transformers compatibility at the boundary: the cache under either name, inputs classified, no deprecation
warning from spec_adapt's own calls, and stock's speculation arguments honoured after `enable`."""

from __future__ import annotations

import logging
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteriaList
from transformers.utils import logging as hf_logging

import spec_adapt
from spec_adapt import (EarlyExitVerifier, FixedLength, FixedTree, ModelDrafter, MultiSourceDrafter,
                        PromptLookupDrafter, compat)
from spec_adapt.api import _stock_speculation
from spec_adapt.drafters.early_exit import early_exit_model

from conftest import PAD, cached_model, ragged_batch, stock_greedy, tiny_model

PACKAGE = str(Path(spec_adapt.__file__).resolve().parent)


def direct_call(model, ids, mask, **inputs):
    """spec_adapt.generate as transformers calls a custom_generate function, with the given prepared inputs."""
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.update(do_sample=False, max_length=ids.shape[1] + 12, pad_token_id=PAD, eos_token_id=None)
    config._pad_token_tensor = torch.tensor(PAD)
    return spec_adapt.generate(model, ids, stopping_criteria=StoppingCriteriaList(), generation_config=config,
                               attention_mask=mask, drafter=PromptLookupDrafter(2, 1),
                               assistant_policy=FixedLength(3), **inputs)


@pytest.mark.parametrize("name", compat.CACHE_INPUTS)
def test_the_cache_is_accepted_under_either_name(name):
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=8)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=12)
    out = direct_call(model, ids, mask, **{name: compat.DynamicCache(config=model.config)})
    assert torch.equal(out, reference)


@pytest.mark.parametrize("name", ["brand_new_input", "encoder_outputs", "pixel_values"])
def test_an_input_the_model_does_not_take_is_refused_naming_the_versions(name):
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=8)
    with pytest.raises(ValueError) as error:
        direct_call(model, ids, mask, **{name: torch.ones(2)})
    message = str(error.value)
    assert name in message and "does not take" in message
    assert compat.VERSION in message and compat.TESTED_TEXT in message


@pytest.mark.parametrize("name", ["inputs_embeds"])
def test_a_known_unsupported_input_is_refused_with_its_reason(name):
    model = cached_model("llama")
    ids, mask = ragged_batch(2, seed=8)
    with pytest.raises(ValueError, match=f"input '{name}': .*(not supported|pass input_ids)"):
        direct_call(model, ids, mask, **{name: torch.ones(2)})


class _DeprecationsFromSpecAdapt(logging.Handler):
    """Records FutureWarning / DeprecationWarning, and transformers' logged deprecation notices, raised while a
    spec_adapt frame is on the stack (transformers warns from inside the model, so a warning's own location never
    names the caller)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.found: list[str] = []

    def _record(self, message) -> None:
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
        if frames:
            self.found.append(f"{message} (from {frames[-1].filename}:{frames[-1].lineno})")

    def emit(self, record) -> None:
        if "deprecat" in record.getMessage().lower():
            self._record(record.getMessage())

    def __enter__(self):
        self._warn = warnings.warn

        def warn(message, category=None, stacklevel=1, source=None, **kwargs):
            if isinstance(category, type) and issubclass(category, (FutureWarning, DeprecationWarning)):
                self._record(message)
            return self._warn(message, category, stacklevel + 1, source, **kwargs)

        warnings.warn = warn
        hf_logging.warning_once.cache_clear()           # notices already logged once in this process log again
        hf_logging.get_logger().addHandler(self)
        return self

    def __exit__(self, *exc):
        warnings.warn = self._warn
        hf_logging.get_logger().removeHandler(self)


def test_no_deprecation_warning_comes_from_spec_adapt_calls():
    """Every way spec_adapt runs a model: the target's ledger, a draft model, a cut draft head, trees, the
    early-exit verifier, self-speculation and prompt lookup."""
    target = cached_model("llama")
    draft = cached_model("llama", seed=1)
    ids, mask = ragged_batch(2, seed=9)
    calls = [
        dict(drafter=ModelDrafter(draft), assistant_policy=FixedLength(3)),
        dict(drafter=ModelDrafter(draft, head_tokens=40), assistant_policy=FixedLength(2)),
        dict(drafter=ModelDrafter(draft), assistant_policy=FixedTree(4, depth=2)),
        dict(drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(3),
             verifier=EarlyExitVerifier(layers=[0], top_k=4)),
        dict(prompt_lookup_num_tokens=3),
        dict(assistant_early_exit=1),
    ]
    spec_adapt.enable(target)
    try:
        with _DeprecationsFromSpecAdapt() as seen:
            for kwargs in calls:
                target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                                eos_token_id=None, max_new_tokens=8, strict=True, **kwargs)
    finally:
        spec_adapt.disable(target)
    assert seen.found == []


def test_the_deprecation_check_sees_a_warning_from_a_spec_adapt_frame():
    """The check above can fail: a warning raised under a spec_adapt frame is recorded."""
    with _DeprecationsFromSpecAdapt() as seen:
        warnings.warn("old name", FutureWarning)                 # called from this test: no spec_adapt frame
        assert seen.found == []
        probe = ("import warnings\nwarnings.warn('renamed', FutureWarning)\n"
                 "hf_logging.get_logger('transformers.models').warning_once('x is deprecated')")
        exec(compile(probe, f"{PACKAGE}/probe.py", "exec"), {"hf_logging": hf_logging})
    assert len(seen.found) == 2 and "renamed" in seen.found[0] and "deprecated" in seen.found[1]


def identity_tail(model):
    """`model` with every layer after the first passing its input through (zero output projections): its first
    layer and head compute exactly what the whole model computes, as a perfect early exit."""
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.mark.parametrize("stock_argument", ["prompt_lookup_num_tokens", "assistant_early_exit"])
def test_stock_drafting_arguments_after_enable_are_batched_and_identical(stock_argument):
    """Stock's own prompt lookup (up to 4 tokens) and self-speculation (the first layer of a model whose later layers
    pass their input through, so the exit is exact): identical to stock greedy at batch 3 and to stock's own
    speculation at batch 1, and speculating."""
    if stock_argument == "prompt_lookup_num_tokens":
        model, setting = cached_model("llama"), {stock_argument: 4}
    else:
        model, setting = identity_tail(tiny_model("llama", seed=3, layers=3)), {stock_argument: 1}
    ids, mask = ragged_batch(3, seed=1)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    single = stock_greedy(model, ids[:1], mask[:1], eos_token_id=None, max_new_tokens=16, **setting)
    spec_adapt.enable(model)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None, max_new_tokens=16, **setting)
    finally:
        spec_adapt.disable(model)
    stats = spec_adapt.last_stats()
    assert torch.equal(out, reference) and torch.equal(out[:1], single)
    assert stats.accepted > 0
    if stock_argument == "prompt_lookup_num_tokens":
        assert max(max(r.gammas) for r in stats.trace) <= 4
    else:
        assert stats.accepted == stats.drafted                   # the exit after layer 1 is exact here


def test_the_early_exit_drafter_shares_the_targets_weights():
    model = tiny_model("llama", seed=3, layers=3)
    shallow = early_exit_model(model, 2)
    assert early_exit_model(model, 2) is shallow                        # one per (target, layers): policies learn
    assert len(shallow.model.layers) == 2 and len(model.model.layers) == 3
    assert shallow.config.num_hidden_layers == 2 and model.config.num_hidden_layers == 3
    ours, theirs = dict(shallow.named_parameters()), dict(model.named_parameters())
    assert ours and all(p.data_ptr() == theirs[name].data_ptr() for name, p in ours.items())
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="assistant_early_exit"):
            early_exit_model(model, bad)


def test_num_assistant_tokens_and_the_confidence_threshold_are_read_where_set():
    model = cached_model("llama")
    draft = cached_model("llama", seed=1)
    config = model.generation_config.__class__(num_assistant_tokens=3, assistant_confidence_threshold=0.3)
    drafter, width = _stock_speculation(model, config, draft)
    assert width == 3 and isinstance(drafter, ModelDrafter) and drafter.threshold == 0.3
    defaults = model.generation_config.__class__(num_assistant_tokens=20, assistant_confidence_threshold=0.4)
    assert _stock_speculation(model, defaults, draft) == (draft, None)      # generate's defaults: nothing set
    for bad in (dict(num_assistant_tokens=0), dict(assistant_confidence_threshold=1.5),
                dict(prompt_lookup_num_tokens=2, assistant_early_exit=1)):
        with pytest.raises(ValueError):
            _stock_speculation(model, model.generation_config.__class__(**bad), None)
    both, _ = _stock_speculation(model, model.generation_config.__class__(prompt_lookup_num_tokens=2), draft)
    assert isinstance(both, MultiSourceDrafter) and both.max_free == 2 and "lookup" in both.names   # stock refuses
    with pytest.raises(ValueError, match="not also pass"):              # another Drafter with lookup: refused
        _stock_speculation(model, model.generation_config.__class__(prompt_lookup_num_tokens=2),
                           PromptLookupDrafter())


@pytest.mark.parametrize("family, kinds", [("Lfm3", ["conv", "conv"]), ("Lfm2", ["conv", "full_attention"])])
def test_a_cache_is_known_empty_or_filled_without_attention_layers(family, kinds):
    """A call refuses a filled cache before anything runs; a cache of convolution layers alone (LFM3's, whose
    forward takes such a config where LFM2's does not) answers no `get_seq_length`, so its layers' states say
    whether it holds anything."""
    import transformers
    from transformers import DynamicCache

    if not hasattr(transformers, f"{family}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    config = getattr(transformers, f"{family}Config")(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, layer_types=kinds, pad_token_id=0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    cache = DynamicCache(config=config)
    assert not compat.cache_holds_tokens(cache)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5]]), position_ids=torch.arange(3)[None], use_cache=True,
              **compat.with_cache(model, cache))
    assert compat.cache_holds_tokens(cache)
    with pytest.raises(ValueError, match="empty cache"):
        spec_adapt.api._check_cache(cache)
