"""The cache `generate(..., return_dict_in_generate=True)` returns after speculation is stock's: the same class, the
same layers (KV-sharing layers, sliding windows, indexer keys), the same shapes, each row's committed tokens in stock's
columns and nothing of the drafts, so a later `generate` that continues from it writes stock's tokens."""

from __future__ import annotations

import copy

import pytest
import torch

import spec_adapt
from spec_adapt import compat

from conftest import BOS, EOS, PAD, VOCAB, ragged_batch, tiny_model
from test_families import family, glm_dsa

SMALL = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def gemma4(unified: bool = False):
    """Gemma 4's text model (or the unified one's): sliding and full layers, the last two sharing their KV."""
    from transformers import (Gemma4ForCausalLM, Gemma4TextConfig, Gemma4UnifiedForCausalLM,
                              Gemma4UnifiedTextConfig)

    config_class, model_class = ((Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM) if unified
                                 else (Gemma4TextConfig, Gemma4ForCausalLM))
    torch.manual_seed(0)
    config = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, global_head_dim=8, num_kv_shared_layers=2,
                          layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                          hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                          max_position_embeddings=256, attn_implementation="eager", **SMALL)
    return model_class(config)


def axk2():
    """A.X-K2: MLA keys with a sparse-attention indexer, as transformers' tester builds it (smaller). Eight indexer
    heads, as for GLM-MoE-DSA (test_families.glm_dsa): a near-tie at the k-th score is rare."""
    from transformers import AXK2Config, AXK2ForCausalLM

    torch.manual_seed(0)
    config = AXK2Config(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                        kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        index_n_heads=8, index_head_dim=16, index_topk=6, gated_norm_rank=4,
                        mlp_layer_types=["dense", "sparse"], max_position_embeddings=256, **SMALL)
    return AXK2ForCausalLM(config)


# Shaped as transformers' own model testers build these families (CausalLMModelTester: two attention heads, two KV
# heads, head dims unlike the tiny builders above), the shapes its generation tests check a returned cache against.
# Stock's cache for them keeps a DummyLayer per KV-sharing layer (as many layers as num_hidden_layers) and, for the
# MLA families, the compressed latents (keys [B, 1, T, kv_lora_rank], values [B, 1, T, qk_rope_head_dim]), not the
# per-head keys; the returned cache must be that, whatever a check written for another layout expects.
def gemma3n_tester_shaped():
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(0)
    config = Gemma3nTextConfig(hidden_size=16, intermediate_size=21, num_hidden_layers=4, num_kv_shared_layers=2,
                               layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=8,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=8, altup_num_inputs=2,
                               hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                               max_position_embeddings=512, attn_implementation="eager", **SMALL)
    return Gemma3nForCausalLM(config)


def gemma4_tester_shaped(unified: bool = False):
    """Full layers with twice the sliding layers' head dim (per_layer_config), MoE blocks, the last two layers
    sharing KV."""
    from transformers import (Gemma4ForCausalLM, Gemma4TextConfig, Gemma4UnifiedForCausalLM,
                              Gemma4UnifiedTextConfig)

    config_class, model_class = ((Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM) if unified
                                 else (Gemma4TextConfig, Gemma4ForCausalLM))
    torch.manual_seed(0)
    config = config_class(hidden_size=32, intermediate_size=37, num_hidden_layers=4, num_kv_shared_layers=2,
                          layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                          per_layer_config={1: {"head_dim": 32}, 3: {"head_dim": 32}}, enable_moe_block=True,
                          num_experts=4, moe_intermediate_size=16, top_k_experts=2, hidden_size_per_layer_input=16,
                          vocab_size_per_layer_input=VOCAB, max_position_embeddings=512, attn_implementation="eager",
                          **SMALL)
    return model_class(config)


def mla_tester_shaped(config_name: str, model_name: str):
    """GLM-MoE-DSA or A.X-K2 with the tester's MLA dims: a 32-wide latent beside 64 + 64 wide per-head keys, two
    KV heads. Eight indexer heads picking 6 tokens, as test_families.glm_dsa (a near-tie at the k-th score is rare)."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_name)(
        hidden_size=32, intermediate_size=37, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=16,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=8, index_head_dim=96, index_topk=6,
        mlp_layer_types=["sparse", "dense"], max_position_embeddings=512, **SMALL)
    return getattr(transformers, model_name)(config)


_BUILT: dict = {}
BUILDERS = {"llama": lambda: tiny_model("llama"), "gemma3n": lambda: family("gemma3n"), "gemma4": gemma4,
            "gemma4_unified": lambda: gemma4(unified=True), "glm_moe_dsa": glm_dsa, "axk2": axk2,
            "lfm2": lambda: family("lfm2"), "inkling": lambda: family("inkling"), "inkling2": lambda: family("inkling2"),
            "gemma3n_tester": gemma3n_tester_shaped, "gemma4_tester": gemma4_tester_shaped,
            "gemma4_unified_tester": lambda: gemma4_tester_shaped(unified=True),
            "glm_moe_dsa_tester": lambda: mla_tester_shaped("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
            "axk2_tester": lambda: mla_tester_shaped("AXK2Config", "AXK2ForCausalLM")}
# Built here, not checked by the structure test (the cache cannot be laid out; see the last test).
BUILT_ONLY = {"inkling2_loop": lambda: family("inkling2_loop")}


def built(name):
    if name not in _BUILT:
        model = {**BUILDERS, **BUILT_ONLY}[name]().eval()
        with torch.no_grad():          # clear-cut greedy choices (conftest.tiny_model)
            model.get_output_embeddings().weight.mul_(8.0)
        _BUILT[name] = model
    return _BUILT[name]


def run(model, ids, mask, max_new_tokens, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=PAD, eos_token_id=kw.pop("eos_token_id", None), return_dict_in_generate=True,
                          **kw)


def layer_state(layer) -> dict:
    """What a continuing forward reads of a cache layer: its class, tensor shapes and lengths."""
    state = {"class": type(layer).__name__}
    for name in ("keys", "values", "indexer_keys"):
        tensor = getattr(layer, name, None)
        state[name] = tuple(tensor.shape) if torch.is_tensor(tensor) else tensor
    for name in ("cumulative_length", "sliding_window"):
        if hasattr(layer, name):
            state[name] = getattr(layer, name)
    for i, conv in getattr(layer, "conv_states", {}).items():       # a layer may hold several (Inkling's four)
        if conv is not None:
            state["conv", i] = (tuple(conv.shape), layer.has_previous_state[i])
    return state


def attributes(value, depth: int = 0):
    """Everything a check can read of a cache or a layer without its entries: each attribute, nested objects' own,
    a tensor as its shape, dtype and device."""
    if torch.is_tensor(value):
        return "tensor", tuple(value.shape), value.dtype, str(value.device)
    if isinstance(value, dict):
        return {key: attributes(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [attributes(item, depth + 1) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth < 3 and hasattr(value, "__dict__"):
        return type(value).__name__, attributes(vars(value), depth + 1)
    return type(value).__name__


def check_same_structure(stock, mine, mask) -> None:
    """As transformers' `_check_past_key_values_for_generate` reads a cache (and anything else a check could read
    of it: every attribute of the cache and its layers), plus the entries themselves: every row's real tokens hold
    stock's keys and values (left padding is masked: any content serves)."""
    assert mine is not None, "no cache returned"
    assert type(mine) is type(stock)
    assert len(mine.layers) == len(stock.layers)
    assert mine.get_seq_length() == stock.get_seq_length()
    assert attributes(mine) == attributes(stock)
    for a, b in zip(stock.layers, mine.layers):
        assert layer_state(b) == layer_state(a)
        for i, conv in getattr(a, "conv_states", {}).items():          # a convolution's last inputs
            if conv is not None:
                assert torch.allclose(conv, b.conv_states[i], atol=1e-4), ("conv", i)
        if not torch.is_tensor(getattr(a, "keys", None)):
            continue
        held = stock.get_seq_length()
        real = torch.cat([mask, mask.new_ones(mask.shape[0], held)], dim=1)[:, :held].bool()
        real = real[:, held - a.keys.shape[2]:]           # a sliding layer holds the window's last columns
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name)
            assert torch.allclose(x.transpose(1, 2)[real], y.transpose(1, 2)[real], atol=1e-4), name
        if getattr(a, "indexer_keys", None) is not None:
            assert torch.allclose(a.indexer_keys[real], b.indexer_keys[real], atol=1e-4)


def continuation(model, out, mask, new_tokens=6):
    """Greedy tokens of a plain stock `generate` that continues from the returned sequences and cache."""
    sequences = out.sequences
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - mask.shape[1])], dim=1)
    cache = copy.deepcopy(compat.output_cache(out))       # generate extends the cache it is given
    follow = model.generate(input_ids=sequences, attention_mask=full_mask, do_sample=False, pad_token_id=PAD,
                            eos_token_id=None, max_new_tokens=new_tokens, **compat.with_cache(model, cache))
    return follow[:, sequences.shape[1]:]


@pytest.fixture
def enabled():
    models = []

    def enable(model):
        models.append(spec_adapt.enable(model))
        return model

    yield enable
    for model in models:
        spec_adapt.disable(model)


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("drafting, batch", [("assistant", 1), ("assistant", 3), ("lookup", 3)])
def test_returned_cache_is_stocks_and_continues_as_stock(name, batch, drafting, enabled):
    model = built(name)
    ids, mask = ragged_batch(batch, seed=31, max_len=10)
    ids[:, -3:] = ids[:, -6:-3].clone()           # a repeat for prompt lookup to find
    ids[mask == 0] = PAD
    stock = run(model, ids, mask, 12)
    stock_cache = compat.output_cache(stock)
    stock_next = continuation(model, stock, mask)
    draft = dict(assistant_model=model) if drafting == "assistant" else dict(prompt_lookup_num_tokens=2)
    mine = run(enabled(model), ids, mask, 12, **draft)
    assert torch.equal(mine.sequences, stock.sequences)
    assert spec_adapt.last_stats().steps > 0
    check_same_structure(stock_cache, compat.output_cache(mine), mask)
    spec_adapt.disable(model)
    assert torch.equal(continuation(model, mine, mask), stock_next)


def test_rows_that_end_early_continue_as_stock(enabled):
    """A row that reached EOS before the others: stock went on feeding it padding, and so must its cache."""
    model = built("llama")
    ids, mask = ragged_batch(3, seed=32, max_len=10)
    probe = run(model, ids, mask, 12)
    eos = int(probe.sequences[1, ids.shape[1] + 4])       # row 1's fifth new token ends it
    stock = run(model, ids, mask, 12, eos_token_id=eos)
    assert (stock.sequences[:, -1] == PAD).any()
    mine = run(enabled(model), ids, mask, 12, eos_token_id=eos, assistant_model=model)
    assert torch.equal(mine.sequences, stock.sequences)
    check_same_structure(compat.output_cache(stock), compat.output_cache(mine), mask)
    spec_adapt.disable(model)
    assert torch.equal(continuation(model, mine, mask), continuation(model, stock, mask))


def test_no_cache_without_use_cache(enabled):
    model = built("llama")
    ids, mask = ragged_batch(2, seed=33)
    mine = run(enabled(model), ids, mask, 6, assistant_model=model, use_cache=False)
    assert compat.output_cache(mine) is None


def test_a_model_that_adds_cache_layers_of_its_own_gets_no_cache(enabled):
    """Inkling 2 Loop appends cache layers for its later passes through the loop layers, which the layout does not
    know how to rebuild: no cache rather than one that continues wrongly. The sequences are stock's."""
    model = built("inkling2_loop")
    ids, mask = ragged_batch(3, seed=34)
    stock = run(model, ids, mask, 8)
    assert compat.output_cache(stock) is not None
    mine = run(enabled(model), ids, mask, 8, assistant_model=model)
    assert torch.equal(mine.sequences, stock.sequences)
    assert spec_adapt.last_stats().drafted > 0 and compat.output_cache(mine) is None
