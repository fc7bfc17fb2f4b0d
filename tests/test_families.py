"""Greedy identity beyond Llama-style decoders: tiny models of other cache and position families, built from their
transformers configs as transformers' own model testers build them, at batch 1 and batched (ragged), with scripted
drafts that are right for some rows and wrong for others (so the rows accept different numbers of tokens)."""

from __future__ import annotations

import functools

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength, FixedTree, PromptLookupDrafter
from spec_adapt import ledger as ledger_module
from spec_adapt.ledger import KVLedger, positions_from_cache

from conftest import BOS, EOS, PAD, VOCAB, Oracle, drive_engine, ragged_batch, stock_greedy, tiny_model

SMALL = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def bart_decoder():
    from transformers import BartConfig, BartForCausalLM

    config = BartConfig(d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=2,
                        encoder_attention_heads=4, encoder_ffn_dim=64, max_position_embeddings=128,
                        is_decoder=True, is_encoder_decoder=False, decoder_start_token_id=BOS, **SMALL)
    return BartForCausalLM(config)


def whisper_decoder():
    from transformers import WhisperConfig, WhisperForCausalLM

    config = WhisperConfig(d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                           encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, max_target_positions=128,
                           max_source_positions=32, num_mel_bins=8, is_encoder_decoder=False,
                           decoder_start_token_id=BOS, suppress_tokens=None, begin_suppress_tokens=None, **SMALL)
    return WhisperForCausalLM(config)


def mistral_sliding():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=WINDOW,
                           attn_implementation="sdpa", **SMALL)
    return MistralForCausalLM(config)


def gemma2_alternating():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=WINDOW,
                          attn_implementation="eager", **SMALL)
    return Gemma2ForCausalLM(config)


def gemma3n_shared():
    """Gemma 3n's text model: a sliding and a full layer, then two layers that share their keys and values (cache
    type "dummy": they read what the last layer of their own type returns in the same forward)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size_per_layer_input=VOCAB,
                               hidden_size_per_layer_input=8, sliding_window=WINDOW, num_kv_shared_layers=2,
                               layer_types=["sliding_attention", "full_attention"] * 2, laurel_rank=4,
                               activation_sparsity_pattern=[0.0] * 4, max_position_embeddings=256,
                               attn_implementation="eager", **SMALL)
    return Gemma3nForCausalLM(config)


def llama4_chunked():
    """Llama 4's text model: three chunked-attention layers (a token sees the earlier tokens of its own chunk of 8
    positions) and a full one, with mixture-of-experts MLPs."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                              attention_chunk_size=WINDOW, max_position_embeddings=256, attn_implementation="sdpa",
                              **SMALL)
    return Llama4ForCausalLM(config)


def lfm2_hybrid(seed: int = 0, layers: int = 3):
    """LFM2: short convolutions (kernel 3) around a full-attention layer."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    kinds = ["conv", "full_attention", "conv"][:layers]
    config = Lfm2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, layer_types=kinds, max_position_embeddings=256, **SMALL)
    return Lfm2ForCausalLM(config)


def lfm3_convolutions(seed: int = 0, layers: int = 3):
    """LFM3 with convolution layers only: no attention layer, so its cache has no layer that counts tokens (the
    cache `generate` hands the call answers no `get_seq_length`)."""
    import transformers

    if not hasattr(transformers, "Lfm3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no LFM3")
    torch.manual_seed(seed)
    config = transformers.Lfm3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, layer_types=["conv"] * layers,
                                     max_position_embeddings=256, **SMALL)
    return transformers.Lfm3ForCausalLM(config)


def inkling_hybrid(seed: int = 0, layers: int = 3):
    """Inkling: each layer is attention with four short convolutions (kernel 4) around it, on its keys, its values,
    its output and its MLP's output ("hybrid" layers); layers 0 and 2 attend in a sliding window ("hybrid_sliding")."""
    from transformers import InklingForCausalLM, InklingTextConfig

    torch.manual_seed(seed)
    config = InklingTextConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                               swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=WINDOW,
                               local_layer_ids=[0, 2], mlp_layer_types=["dense"] * layers, rel_extent=16, d_rel=4,
                               logits_mup_width_multiplier=1.0, max_position_embeddings=256, **SMALL)
    return InklingForCausalLM(config)


def inkling2(seed: int = 0, layers: int = 3, loop: bool = False):
    """Inkling 2 (transformers >= 5.24): Inkling's hybrid layers with attention residuals across blocks; its Loop
    variant runs its last layer (sliding in the target) twice, each pass with cache layers of its own that the model
    appends to the cache."""
    import transformers

    name = "Inkling2Loop" if loop else "Inkling2"
    if not hasattr(transformers, f"{name}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config_class, model_class = getattr(transformers, f"{name}TextConfig"), getattr(transformers, f"{name}ForCausalLM")
    looping = dict(loop_layer_index_start=layers - 1, loop_layer_index_end=layers, loop_num_passes=2,
                   loop_gate_rank=4) if loop else {}
    torch.manual_seed(seed)
    config = config_class(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=WINDOW, rel_extent=16,
                          d_rel=4, n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
                          unpadded_vocab_size=VOCAB, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"][:layers],
                          max_position_embeddings=256, **looping, **SMALL)
    return model_class(config)


def glm_dsa(seed: int = 0):
    """GLM-MoE-DSA: sparse attention whose indexer keeps keys of its own and picks the top 6 tokens per query, so
    the selection changes as the context grows past 6. Eight indexer heads: a ReLU'd score is exactly 0 only where
    every head's is, so the top 6 are rarely a tie (a tie's pick depends on the forward's width, in stock too)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                             num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                             qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=6, index_head_dim=16,
                             index_n_heads=8, first_k_dense_replace=1, max_position_embeddings=256, **SMALL)
    return GlmMoeDsaForCausalLM(config)


WINDOW = 8
FAMILIES = {"bart": bart_decoder, "whisper": whisper_decoder}
SLIDING = {"mistral": mistral_sliding, "gemma2": gemma2_alternating, "gemma3n": gemma3n_shared,
           "llama4": llama4_chunked}
CONVOLUTIONS = {"lfm2": lfm2_hybrid, "lfm3_conv": lfm3_convolutions, "inkling": inkling_hybrid,
                "inkling2": inkling2, "inkling2_loop": functools.partial(inkling2, loop=True)}
_BUILDERS = {**FAMILIES, **SLIDING, **CONVOLUTIONS, "glm_dsa": glm_dsa}
# Families that number tokens by cache column: Inkling's attention bias reads the distance between cache columns;
# LFM3 of convolutions alone reads no positions at all, so the probe cannot tell it from one (lockstep is exact).
BY_COLUMN = [*FAMILIES, "inkling", "inkling2", "inkling2_loop", "lfm3_conv"]
_MADE: dict = {}


def family(name):
    if name not in _MADE:
        torch.manual_seed(0)
        model = _BUILDERS[name]().eval()
        with torch.no_grad():              # clear-cut greedy choices, as in conftest.tiny_model
            model.get_output_embeddings().weight.mul_(8.0)
            for module_name, module in model.named_modules():     # positions that decide tokens: a shift shows
                if module_name.endswith("embed_positions"):
                    module.weight.mul_(30.0)
                if module_name.endswith(("rel_logits_proj", "relative_position_bias")):   # Inkling's bias by
                    module.proj.mul_(30.0)                                              # cache-column distance
                if module_name.endswith(("conv.conv", "conv.in_proj", "sconv.conv1d")):   # a convolution's inputs
                    module.weight.mul_(8.0)                         # count: a wrong previous input moves the logits
        _MADE[name] = model
    return _MADE[name]


def spec(model, ids, mask, drafter, policy, max_new_tokens=16, **kw):
    stats = spec_adapt.SpecStats()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                         max_new_tokens=max_new_tokens, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=policy, spec_stats=stats, **kw)
    return out, stats


@pytest.mark.parametrize("name", BY_COLUMN)
def test_cache_column_positions_are_detected(name):
    assert positions_from_cache(family(name)) is not None


@pytest.mark.parametrize("name", BY_COLUMN)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("modes", [["right", 2, 1], [1, "right", 3], ["right", "wrong", 2]])
def test_rows_that_accept_differently_keep_their_positions(name, batch, modes):
    model = family(name)
    ids, mask = ragged_batch(batch, seed=11)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    out, stats = spec(model, ids, mask, Oracle(reference, mask, modes).drafter(), FixedLength(3))
    assert torch.equal(out, reference)
    assert stats.accepted > 0 or "wrong" in modes[:batch]


@pytest.mark.parametrize("name", BY_COLUMN)
def test_prompt_lookup_and_the_default_policy_batched(name):
    model = family(name)
    ids, mask = ragged_batch(3, seed=12)
    ids[:, -4:] = ids[:, -8:-4].clone()          # repeats for prompt lookup to find
    ids[mask == 0] = PAD
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    for policy in (FixedLength(4), None):
        out, _ = spec(model, ids, mask, PromptLookupDrafter(2, 1), policy)
        assert torch.equal(out, reference)


@pytest.mark.parametrize("name", BY_COLUMN)
def test_no_drafter_matches_stock_on_left_padded_rows(name):
    model = family(name)
    ids, mask = ragged_batch(3, seed=13)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=16)
    out, _ = spec(model, ids, mask, None, FixedLength(0))
    assert torch.equal(out, reference)


def test_trees_and_the_engine_refuse_cache_column_positions():
    model = family("bart")
    ids, mask = ragged_batch(2, seed=14)
    with pytest.raises(ValueError, match="cache column"):
        spec(model, ids, mask, PromptLookupDrafter(2, 1), FixedTree(4, 2))
    with pytest.raises(ValueError, match="cache column"):
        spec_adapt.Engine(model, drafter=PromptLookupDrafter(2, 1))


def long_ragged(batch, seed):
    """Prompts of 12-20 tokens: with 40 new tokens a window of 8 slides well inside the call."""
    return ragged_batch(batch, seed=seed, max_len=20)


@pytest.mark.parametrize("name", list(SLIDING))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", [FixedLength(3), FixedTree(6, 3)], ids=["chain", "tree"])
def test_sliding_windows_scripted(name, batch, policy):
    model = family(name)
    ids, mask = long_ragged(batch, seed=21)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    out, stats = spec(model, ids, mask, Oracle(reference, mask, ["right", 2, "wrong"]).drafter(), policy,
                      max_new_tokens=40)
    assert torch.equal(out, reference)
    assert stats.accepted > 0


@pytest.mark.parametrize("name", list(SLIDING))
def test_sliding_windows_with_a_draft_model_and_prompt_lookup(name):
    model = family(name)
    ids, mask = long_ragged(3, seed=22)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    for drafter in (model, PromptLookupDrafter(2, 1)):
        out, stats = spec(model, ids, mask, drafter, FixedLength(4), max_new_tokens=40)
        assert torch.equal(out, reference)
    assert stats.drafted > 0


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "mistral", "gemma2"])
def test_models_that_read_position_ids_run_freely(name):
    from conftest import cached_model

    model = family(name) if name in SLIDING else cached_model(name)
    assert positions_from_cache(model) is None


def _small_vocab(builder, **config):
    """A family's model with a 16-token vocabulary and mild logits: every token has real probability."""
    import test_sampling

    global VOCAB
    torch.manual_seed(5)
    saved, VOCAB = VOCAB, test_sampling.VOCAB_SMALL
    SMALL["vocab_size"] = VOCAB
    try:
        model = builder(**config).eval()
    finally:
        VOCAB, SMALL["vocab_size"] = saved, saved
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.3)
    return model


@pytest.mark.parametrize("name", ["mistral", "bart", "lfm2", "lfm3_conv", "inkling", "inkling2"])
def test_sampling_follows_the_target_distribution(name):
    """The enumerated statistical test: the first generated tokens' marginals against the target's exact ones.
    Mistral with a window of 3 (it slides within the 4 + 3 tokens enumerated) and LFM2 (convolutions), sampled as
    one batch; the families that number tokens by cache column (Bart; Inkling's and Inkling 2's convolutions and
    sliding layers, the window 3; LFM3 of convolutions alone, which reads no positions) run in lockstep, so in batches of 2 whose rows accept different numbers of drafts (in one batch of
    thousands the row that accepts fewest accepts nothing)."""
    import test_sampling as ts

    global WINDOW
    saved, WINDOW = WINDOW, 3
    try:
        model = _small_vocab(_BUILDERS[name])
    finally:
        WINDOW = saved
    marginals = ts.exact_marginals(model, [3, 7, 9, 4])
    guess = int(marginals[1].argmax())
    drafter = spec_adapt.ScriptedDrafter(lambda row, context, gamma: [guess, 5, 6][:gamma])
    rows, calls = (2, 750) if name in BY_COLUMN else (3000, 1)
    if name in BY_COLUMN:
        # In lockstep a step commits a draft only where every row accepts it. Over these flat distributions (the
        # likeliest token has p ~ 0.07-0.09) three rows all accept in about one step of a thousand, which a fixed
        # seed may never show; two rows, each drafting the target's likeliest token after its own context, do in
        # about one step of 150, and 750 calls keep the 1,500 samples the marginals are judged on.
        def mode_after(row, context, gamma):
            with torch.no_grad():
                logits = model(torch.tensor([list(context)]), use_cache=False).logits
            return [int(logits[0, -1].argmax()), 5, 6][:gamma]

        drafter = spec_adapt.ScriptedDrafter(mode_after)
    tokens = []
    torch.manual_seed(0)
    accepted = 0
    for _ in range(calls):
        tokens.append(ts.sample(model, drafter, rows, seed=None))
        accepted += spec_adapt.last_stats().accepted
    tokens = torch.cat(tokens)
    assert accepted > 0
    assert ts.marginals_miss(tokens, marginals) is None


# More decoder families, each a tiny model from its transformers config: (config class, model class, settings). The
# sliding-window ones get a window of 8, which slides inside a 20-token prompt and 30 new tokens.
ZOO = {
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=WINDOW)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=WINDOW)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(sliding_window=WINDOW, num_local_experts=4,
                                                         num_experts_per_tok=2, attn_implementation="eager")),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=WINDOW)),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=WINDOW, attn_implementation="eager")),
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(sliding_window=WINDOW, use_sliding_window=True,
                                                             max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
}


def zoo_model(name):
    import transformers

    config_class, model_class, settings = ZOO[name]
    config = getattr(transformers, config_class)(**{
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256, "attn_implementation": "sdpa",
        **settings, **SMALL})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.mark.parametrize("name", list(ZOO))
def test_decoder_zoo_batched_chains_and_trees(name):
    model = zoo_model(name)
    for batch in (1, 3):
        ids, mask = long_ragged(batch, seed=23)
        reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=30)
        for policy in (FixedLength(3), FixedTree(6, 3)):
            drafter = Oracle(reference, mask, ["right", 2, "wrong"]).drafter()
            out, stats = spec(model, ids, mask, drafter, policy, max_new_tokens=30)
            assert torch.equal(out, reference), (batch, policy)
            assert stats.accepted > 0


@pytest.mark.parametrize("name", list(ZOO))
def test_decoder_zoo_verified_logits_match_one_token_decoding(name):
    """Stricter than tokens (a tiny model's greedy choice survives a wrong mask or position for a while): every
    generated position's logits equal stock's, at batch 3 with rows that accept differently."""
    model = zoo_model(name)
    ids, mask = long_ragged(3, seed=23)
    stock = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=30, return_dict_in_generate=True,
                         output_logits=True)
    drafter = Oracle(stock.sequences, mask, ["right", 2, "wrong"]).drafter()
    ours, stats = spec(model, ids, mask, drafter, FixedLength(3), max_new_tokens=30, return_dict_in_generate=True,
                       output_logits=True)
    assert torch.equal(ours.sequences, stock.sequences) and 0 < stats.accepted < stats.drafted
    for position, (mine, theirs) in enumerate(zip(ours.logits, stock.logits, strict=True)):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-4), position


def test_git_whose_forward_widens_a_2d_mask_commits_its_rows_together():
    """GIT widens a 2-D attention mask by its image tokens' columns whenever its cache holds anything, image or not,
    so a mask with holes (rejected drafts) would be read shifted and the holes attended: its rows commit together
    (no holes), and every generated position's logits equal stock's at batch 3 with drafts rows accept differently."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GitConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256, pad_token_id=PAD,
                                    bos_token_id=BOS, eos_token_id=EOS,
                                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=4, image_size=8, patch_size=4))
    model = transformers.GitForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    assert "widens" in positions_from_cache(model)
    ids, mask = long_ragged(3, seed=23)
    stock = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=30, return_dict_in_generate=True,
                         output_logits=True)
    drafter = Oracle(stock.sequences, mask, ["right", 2, "right"]).drafter()   # row 1 rejects its third draft
    ours, stats = spec(model, ids, mask, drafter, FixedLength(3), max_new_tokens=30, return_dict_in_generate=True,
                       output_logits=True)
    assert torch.equal(ours.sequences, stock.sequences) and 0 < stats.accepted < stats.drafted
    for position, (mine, theirs) in enumerate(zip(ours.logits, stock.logits, strict=True)):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-4), position


@pytest.mark.parametrize("name", list(CONVOLUTIONS))
@pytest.mark.parametrize("batch", [1, 3])
def test_a_hybrid_convolution_model_is_identical_to_stock(name, batch):
    """LFM2 (short convolutions between attention layers) and Inkling (four in every layer, sliding windows in some).
    A convolution reads the row's previous inputs in order, so a rejected draft or a hole must never reach it: the
    ledger keeps every input column and hands each convolution its rows' last valid ones. Scripted drafts right for
    some rows and wrong for others, prompt lookup, a draft model and the default policy, against stock greedy at the
    same batch."""
    model = family(name)
    ids, mask = long_ragged(batch, seed=24)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=30)
    draft = CONVOLUTIONS[name](seed=1, layers=2).eval()
    for drafter, policy in [(Oracle(reference, mask, ["right", 2, "wrong"]).drafter(), FixedLength(3)),
                            (PromptLookupDrafter(2, 1), spec_adapt.Adaptive()), (draft, FixedLength(2)),
                            (model, FixedLength(4))]:
        out, stats = spec(model, ids, mask, drafter, policy, max_new_tokens=30)
        assert torch.equal(out, reference), (batch, drafter)
    assert stats.accepted > 0


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("seed", [25, 26])
def test_indexed_sparse_attention_is_identical_to_stock(batch, seed):
    """DSA's indexer keys sit beside the KV cache: rollback, trimming and compaction move them with the keys."""
    model = family("glm_dsa")
    ids, mask = long_ragged(batch, seed=seed)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=30)
    for drafter, policy in [(Oracle(reference, mask, ["right", 2, "wrong"]).drafter(), FixedLength(3)),
                            (PromptLookupDrafter(2, 1), spec_adapt.Adaptive()), (model, FixedLength(4))]:
        out, stats = spec(model, ids, mask, drafter, policy, max_new_tokens=30)
        assert torch.equal(out, reference), (batch, drafter)
        assert stats.accepted > 0


@pytest.mark.parametrize("name", ["lfm2", "lfm3_conv", "inkling", "inkling2", "inkling2_loop", "glm_dsa"])
def test_verified_logits_match_one_token_decoding(name):
    """Stricter than tokens (a tiny model's greedy choice survives a small error): every generated position's logits
    equal stock's at batch 3, with rows that accept differently, so rejected drafts sit in the cache."""
    model = family(name)
    ids, mask = long_ragged(3, seed=25)
    common = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD,
                  eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    stock = model.generate(**common)
    ours = model.generate(**common, custom_generate=spec_adapt.generate, assistant_policy=FixedLength(3),
                          drafter=Oracle(stock.sequences, mask, ["right", 2, "wrong"]).drafter())
    assert torch.equal(ours.sequences, stock.sequences)
    for position, (mine, theirs) in enumerate(zip(ours.logits, stock.logits)):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-4), position


def test_convolution_models_refuse_trees_and_stateful_models_get_stocks_reason():
    import transformers

    ids, mask = ragged_batch(2)
    for name in ("lfm2", "inkling"):
        with pytest.raises(ValueError, match="convolution layers.*token trees"):
            spec(family(name), ids, mask, PromptLookupDrafter(2, 1), FixedTree(4, 2))
    config = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, state_size=4, **SMALL)
    mamba = transformers.MambaForCausalLM(config).eval()
    # Stock's own reason where stock refuses stateful models (transformers <= 5.24); from 5.25 stock rewinds their
    # recurrent state at batch 1, and the refusal says that spec_adapt cannot take it back per row.
    from spec_adapt import compat

    reason = ("cannot take back the recurrent state of MambaForCausalLM per row" if compat.STOCK_REWINDS_RECURRENT_STATES
              else "not supported with stateful models, such as MambaForCausalLM")
    with pytest.raises(ValueError, match=reason):
        spec(mamba, ids, mask, PromptLookupDrafter(2, 1), FixedLength(2))


def test_a_byte_latent_model_is_refused_by_name():
    """BLT's forward cannot take several new bytes over a filled cache (its patches would not line up): refused
    where it enters, with or without a drafter, rather than failing inside the model. (Config: transformers' own
    BLT tester's sizes.)"""
    from transformers import BltConfig, BltForCausalLM

    part = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=32, max_position_embeddings=32, rope_parameters={"rope_type": "default"})
    config = BltConfig(vocab_size=32, max_position_embeddings=32, patch_in_forward=False, patch_size=4, cross_attn_k=2,
                       encoder_hash_byte_group_size=[2, 3], encoder_hash_byte_group_vocab=64,
                       patcher_config=part, encoder_config=part, tie_word_embeddings=False,
                       decoder_config={**part, "vocab_size": 32, "hidden_size_global": 32},
                       global_config={**part, "hidden_size": 32}, pad_token_id=PAD, eos_token_id=EOS)
    config.num_attention_heads, config.num_hidden_layers, config.hidden_size = 2, 1, 16     # as the tester sets them
    model = BltForCausalLM(config).eval()
    ids = torch.randint(3, 30, (1, 7))
    for drafter in (PromptLookupDrafter(2, 1), None):
        with pytest.raises(ValueError, match="cannot run BltForCausalLM: .*byte patches"):
            spec(model, ids, torch.ones_like(ids), drafter, FixedLength(2))


@pytest.mark.parametrize("name", ["cpmant", "prophetnet"])
def test_models_that_take_no_several_new_tokens_over_a_cache_are_refused_by_name(name):
    """CPM-Ant's forward reads the whole sequence at every step (it numbers, segments and masks the tokens from all
    of input_ids, then keeps the columns past the cache), and ProphetNet's decoder takes one token at a time over a
    cache (it asserts so, in stock's assisted generation too): refused where they enter, rather than failing inside
    the model mid-call."""
    import transformers

    if name == "cpmant":
        config = transformers.CpmAntConfig(vocab_size=99, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                                           num_hidden_layers=2, prompt_length=4, prompt_types=2, segment_types=4)
        model, match = transformers.CpmAntForCausalLM(config), "cannot run CpmAntForCausalLM: .*whole sequence"
    else:
        config = transformers.ProphetNetConfig(vocab_size=99, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                               num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                                               num_decoder_attention_heads=4, max_position_embeddings=64, ngram=2,
                                               is_decoder=True, add_cross_attention=False)
        model, match = transformers.ProphetNetForCausalLM(config), "cannot run ProphetNetForCausalLM: .*one token"
    ids = torch.randint(5, 90, (2, 7))
    for drafter in (PromptLookupDrafter(2, 1), None):
        with pytest.raises(ValueError, match=match):
            spec(model.eval(), ids, torch.ones_like(ids), drafter, FixedLength(2))


def test_a_moe_model_configured_to_return_router_logits_runs_batched():
    """Mixtral with output_router_logits=True: its forward computes an auxiliary loss from the router logits, which
    fails on a padded batch (stock's batched generate fails so). Generation needs neither: each row of the batch
    equals stock greedy on that row alone."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                        output_router_logits=True, **SMALL)
    model = transformers.MixtralForCausalLM(config).eval()
    ids, mask = ragged_batch(3, seed=3)
    alone = []
    for b in range(3):
        pad = int((mask[b] == 0).sum())
        alone.append(stock_greedy(model, ids[b:b + 1, pad:], mask[b:b + 1, pad:], eos_token_id=None,
                                  max_new_tokens=12)[0, -12:])
    reference = torch.cat([ids, torch.stack(alone)], dim=1)
    out, stats = spec(model, ids, mask, Oracle(reference, mask, ["right", 1, "wrong"]).drafter(), FixedLength(3),
                      max_new_tokens=12)
    assert torch.equal(out[:, -12:], torch.stack(alone))
    assert stats.accepted > 0


def _window_spans(ledger) -> int:
    """The columns the rows still need through a sliding layer: from the first column whose token some row's next
    position can see (within WINDOW) to the end."""
    seen = (ledger.slots >= 0) & (ledger.slots > (ledger.n_cached - WINDOW)[:, None])
    first = [int(row.nonzero()[0]) if row.any() else ledger.physical_length for row in seen]
    return ledger.physical_length - min(first)


@pytest.mark.parametrize("name", list(SLIDING))
@pytest.mark.parametrize("batch", [1, 3])
def test_a_sliding_layer_holds_its_window_and_the_step_not_the_call(name, batch, monkeypatch):
    """Memory: before each verification a sliding layer holds at most window - 1 entries per row (batch 1), or the
    columns the rows' windows span (holes of ragged acceptance included), however long the call; full layers hold
    every column. Identical to stock all the same."""
    from spec_adapt.ledger import KVLedger

    model = family(name)
    ids, mask = long_ragged(batch, seed=23)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    seen, run = [], KVLedger._run

    def recording(ledger, tokens, slots, keep, new=None, **kwargs):
        if ledger.rewind is not None and ledger._layers():       # after the prompt's forward
            lengths = {kind: layer.keys.shape[2] for kind, layer in ledger._typed_layers()}
            seen.append((lengths, ledger.physical_length, _window_spans(ledger)))
        return run(ledger, tokens, slots, keep, new=new, **kwargs)

    monkeypatch.setattr(KVLedger, "_run", recording)
    out, stats = spec(model, ids, mask, Oracle(reference, mask, ["right", 2, "wrong"]).drafter(), FixedLength(3),
                      max_new_tokens=40)
    assert torch.equal(out, reference) and stats.accepted > 0
    assert len(seen) >= 8
    windowed = [kind for kind in seen[-1][0] if kind != "full_attention"]
    for lengths, physical, spans in seen:
        assert lengths.get("full_attention", physical) == physical
        for kind in windowed:      # a chunk needs no more than a window: its start is less than a window back
            assert lengths[kind] <= (WINDOW - 1 if batch == 1 else spans), (lengths, physical, spans)
    assert all(seen[-1][0][kind] < seen[-1][1] - 20 for kind in windowed)    # the call outgrew the window many times


@pytest.mark.parametrize("name", [*SLIDING, "lfm2"])
def test_the_engine_with_requests_joining_a_running_batch(name):
    """Rows join after the running rows' sliding layers dropped their old columns, and their convolution inputs join
    the ledger's: every request is stock's alone. (Not DSA: a float rounding that differs with the batch's shape can
    flip its indexer's top-k, so stock's own batched output differs from each request alone.)"""
    from spec_adapt.serving.engine import Engine

    model = family(name)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (14, 9, 18, 11)]
    budgets, arrivals = [30, 24, 30, 20], [0, 6, 6, 14]
    engine = Engine(model, drafter=PromptLookupDrafter(2, 1), assistant_policy=FixedLength(3), max_batch=4,
                    eos_token_id=None, pad_token_id=PAD)
    for prompt, budget, handle in zip(prompts, budgets, drive_engine(engine, prompts, budgets, arrivals)):
        ids = torch.tensor([prompt])
        assert handle.result() == stock_greedy(model, ids, torch.ones_like(ids), eos_token_id=None,
                                               max_new_tokens=budget)[0, len(prompt):].tolist()
    assert max(r.batch_size for r in engine.stats.trace) > 1


def very_ragged(seed: int = 40):
    """Three prompts of 30, 4 and 17 tokens: most of the batch is padding."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask = torch.full((3, 30), PAD, dtype=torch.long), torch.zeros(3, 30, dtype=torch.long)
    for b, n in enumerate([30, 4, 17]):
        ids[b, 30 - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[b, 30 - n:] = 1
    return ids, mask


@pytest.mark.parametrize("name", ["llama", "gemma2", "llama4", "lfm2", "glm_dsa"])
def test_rows_prefilled_apart_are_identical_to_stock(name, monkeypatch):
    """A ragged batch prefilled a row at a time, each without its padding (what a CPU does when padding costs more
    than the extra forwards), the draft model's first catch-up too: every drafter's output is stock's, with full,
    sliding, chunked, convolution and indexed layers, and the target drafting for itself has every draft accepted (its
    own cache, filled a row at a time, drafts what the target's verifies)."""
    from spec_adapt.drafters.model import ModelDrafter

    apart = []
    monkeypatch.setattr(ledger_module, "PREFILL_APART_TOKENS", 0)
    monkeypatch.setattr(KVLedger, "_prefill_apart", lambda self, *a, _f=KVLedger._prefill_apart: apart.append(1)
                        or _f(self, *a))
    monkeypatch.setattr(ModelDrafter, "_catch_up_apart", lambda self, *a, _f=ModelDrafter._catch_up_apart:
                        apart.append(2) or _f(self, *a))
    model = tiny_model("llama").eval() if name == "llama" else family(name)
    ids, mask = very_ragged()
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=30)
    for drafter, policy in [(Oracle(reference, mask, ["right", 2, "wrong"]).drafter(), FixedLength(3)),
                            (PromptLookupDrafter(2, 1), spec_adapt.Adaptive()), (ModelDrafter(model), FixedLength(4))]:
        out, stats = spec(model, ids, mask, drafter, policy, max_new_tokens=30)
        assert torch.equal(out, reference), drafter
    assert stats.accepted == stats.drafted > 0
    assert set(apart) == {1, 2}


def test_only_padding_worth_a_forward_is_skipped_on_a_cpu():
    model = tiny_model("llama").eval()
    ledger = KVLedger(model)
    ids, mask = very_ragged()                             # 39 padding tokens for 2 extra forwards
    assert not ledger._prefills_apart(mask)
    wide = torch.cat([torch.zeros(3, 20, dtype=torch.long), mask], dim=1)     # 99 for 2
    assert ledger._prefills_apart(wide)
    assert not ledger._prefills_apart(wide[:1])                            # one row: nothing to skip
    assert not ledger._prefills_apart(wide.flip(1))                        # right padding: one forward
