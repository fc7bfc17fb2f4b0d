"""Vision-language families whose generate path differs from LLaVA's, each built like transformers' own model tester
(tiny random weights), run through `enable` with stock's own arguments against stock greedy, at batch 1 and at batch 3
with left-padded ragged prompts:

- Kosmos-2: its `generate` hands generation to its text model with the image encodings, whose forward numbers tokens
  from the cache length itself (stock passes it no position ids);
- PaliGemma 2: Gemma 2's sliding-window layers behind a forward that builds its own masks from one attention mask;
- IDEFICS: every forward cross-attends to the images, which stock carries from the first forward's outputs, with an
  image attention mask per token;
- DeepSeek-VL hybrid and LFM2-VL: the draft model (the target itself) reads rows of different lengths, with image
  tokens at the prompt's start or end;
- Inkling: hybrid layers (attention with short convolutions, some sliding) whose attention bias reads the distance
  between cache columns, so its rows run in lockstep, behind a vision tower whose patches become one token each;
- Voxtral realtime: refused by name (its streaming audio encoder steps with every generated token)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers as tf

import spec_adapt
from spec_adapt import FixedLength

MAX_NEW = 12


def _seeded(build):
    @functools.lru_cache(maxsize=None)
    @functools.wraps(build)
    def built():
        torch.manual_seed(0)
        model = build()
        with torch.no_grad():                   # clear-cut greedy choices, as tests/multimodal_models.py does
            model.get_output_embeddings().weight.mul_(8.0)
        return model.eval()

    return built


@_seeded
def kosmos2():
    text = dict(vocab_size=99, embed_dim=32, layers=2, attention_heads=4, ffn_dim=37, max_position_embeddings=512,
                tie_word_embeddings=False)
    vision = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=37)
    return tf.Kosmos2ForConditionalGeneration(tf.Kosmos2Config(text_config=text, vision_config=vision,
                                                               latent_query_num=3))


@_seeded
def paligemma2():
    text = dict(model_type="gemma2", vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=8, intermediate_size=37, max_position_embeddings=512, pad_token_id=1,
                tie_word_embeddings=False)
    vision = dict(image_size=20, patch_size=5, num_channels=3, hidden_size=32, projection_dim=32,
                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    return tf.PaliGemmaForConditionalGeneration(tf.PaliGemmaConfig(text_config=text, vision_config=vision,
                                                                   image_token_index=0, projection_dim=32))


@_seeded
def idefics():
    from transformers.models.idefics.configuration_idefics import IdeficsPerceiverConfig, IdeficsVisionConfig

    vision = IdeficsVisionConfig(embed_dim=32, patch_size=2, image_size=8, num_attention_heads=4, num_hidden_layers=2,
                                 intermediate_size=37).to_dict()
    perceiver = IdeficsPerceiverConfig(resampler_depth=2, resampler_head_dim=8, resampler_n_heads=2,
                                       resampler_n_latents=16)
    return tf.IdeficsForVisionText2Text(tf.IdeficsConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=512, alpha_initializer="ones", vision_config=vision, perceiver_config=perceiver,
        tie_word_embeddings=False))


@_seeded
def deepseek_vl_hybrid():
    text = dict(num_hidden_layers=2, vocab_size=99, hidden_size=16, intermediate_size=37, max_position_embeddings=512,
                num_attention_heads=4, pad_token_id=1, tie_word_embeddings=False)
    vision = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=37, image_size=32, patch_size=8,
                  vision_use_head=False, num_attention_heads=4)
    high_res = dict(num_hidden_layers=2, global_attn_indexes=[0], hidden_size=16, intermediate_size=37, mlp_dim=24,
                    output_channels=4, image_size=128, patch_size=32, num_attention_heads=4)
    return tf.DeepseekVLHybridForConditionalGeneration(tf.DeepseekVLHybridConfig(
        text_config=text, vision_config=vision, high_res_vision_config=high_res, image_token_id=98))


@_seeded
def lfm2_vl():
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2, num_patches=16,
                  patch_size=4)
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=100, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False, conv_bias=False, conv_L_cache=3, block_multiple_of=2, full_attn_idxs=[0])
    return tf.Lfm2VlForConditionalGeneration(tf.Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=4,
                                                             downsample_factor=4, projector_hidden_size=32))


@_seeded
def inkling():
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8, local_layer_ids=[0, 2],
                mlp_layer_types=["dense"] * 3, rel_extent=16, d_rel=4, logits_mup_width_multiplier=1.0,
                max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    vision = dict(patch_size=2, temporal_patch_size=2, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    model = tf.InklingForConditionalGeneration(tf.InklingConfig(
        text_config=text, vision_config=vision, audio_config=dict(n_mel_bins=4, mel_vocab_size=8), image_token_id=98,
        audio_token_id=97, image_bos_token_id=96, audio_bos_token_id=95))
    with torch.no_grad():                # the bias by cache-column distance decides tokens: a wrong distance shows
        for name, module in model.named_modules():
            if name.endswith(("rel_logits_proj", "relative_position_bias")):
                module.proj.mul_(30.0)
    return model


# ------------------------------------------------------------------------------------------------------- inputs
def _left_padded(batch, length, vocab, pad, seed, image=None):
    """[B, L] ids left padded with `pad` (row b has 2b padding columns) and their mask; `image(row, start)` places
    the image tokens of row b, whose real tokens start at `start`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab - 2, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(batch):
        ids[b, : 2 * b], mask[b, : 2 * b] = pad, 0
        if image is not None:
            image(ids[b], 2 * b)
    return ids, mask, gen


def kosmos2_inputs(batch, seed=0):
    ids, mask, gen = _left_padded(batch, 10, 99, 1, seed)
    positions = torch.zeros_like(ids)
    for b in range(batch):
        positions[b, 2 * b + 1: 2 * b + 4] = 1          # the 3 latent queries after the row's first token
    return dict(input_ids=ids, attention_mask=mask, image_embeds_position_mask=positions,
                pixel_values=torch.randn(batch, 3, 16, 16, generator=gen))


def paligemma2_inputs(batch, seed=0):
    def image(row, start):                               # the whole prompt is PaliGemma's prefix: 16 image tokens
        row[start: start + 16] = 0
    ids, mask, gen = _left_padded(batch, 24, 99, 1, seed, image)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                pixel_values=torch.randn(batch, 3, 20, 20, generator=gen))


def idefics_inputs(batch, seed=0):
    ids, mask, gen = _left_padded(batch, 8, 99, 0, seed)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(batch, 1, 3, 8, 8, generator=gen),
                image_attention_mask=mask[:, :, None].clone())


def deepseek_vl_hybrid_inputs(batch, seed=0):
    def image(row, start):                               # 16 image tokens right after the first token
        row[start + 1: start + 17] = 98
    ids, mask, gen = _left_padded(batch, 24, 99, 1, seed, image)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(batch, 3, 32, 32, generator=gen),
                high_res_pixel_values=torch.randn(batch, 3, 128, 128, generator=gen))


def lfm2_vl_inputs(batch, seed=0):
    def image(row, start):                               # as transformers' tester: the image ends the prompt
        row[-4:] = 4
    ids, mask, gen = _left_padded(batch, 14, 100, 0, seed, image)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(batch, 64, 48, generator=gen),
                spatial_shapes=torch.tensor([[8, 8]] * batch),
                pixel_attention_mask=torch.ones(batch, 64, dtype=torch.long))


def inkling_inputs(batch, seed=0):
    def image(row, start):                               # 3 image tokens after the first token, one per patch
        row[start + 1: start + 4] = 98
    ids, mask, gen = _left_padded(batch, 14, 99, 0, seed, image)
    # Each patch: (time 2, height 2, width 2, channels 3), folded by the tower into one token.
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(3 * batch, 2, 2, 2, 3, generator=gen))


FAMILIES = {"kosmos2": (kosmos2, kosmos2_inputs), "paligemma2": (paligemma2, paligemma2_inputs),
            "idefics": (idefics, idefics_inputs), "deepseek_vl_hybrid": (deepseek_vl_hybrid, deepseek_vl_hybrid_inputs),
            "lfm2_vl": (lfm2_vl, lfm2_vl_inputs), "inkling": (inkling, inkling_inputs)}


def enabled_generate(model, inputs, **kw):
    """(stock greedy, spec_adapt's greedy after `enable` with `kw`, its SpecStats); a fallback warning fails."""
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
    reference = model.generate(**inputs, **common)
    spec_adapt.enable(model, assistant_policy=FixedLength(2))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="spec_adapt")
            out = model.generate(**inputs, **common, **kw)
    finally:
        spec_adapt.disable(model)
    return reference, out, spec_adapt.last_stats()


# Kosmos-2 as a draft model: its forward needs the image encodings on every forward, which only its own `generate`
# computes (and hands its text model); the draft then fails and the call goes on plain (stock's output, see below).
DRAFTS = [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason="Kosmos-2 drafts only through its own "
                                                     "generate")) if name == "kosmos2" else name for name in FAMILIES]


@pytest.mark.parametrize("name", DRAFTS)
@pytest.mark.parametrize("batch", [1, 3])
def test_the_target_as_its_own_draft_accepts_every_draft(name, batch):
    """`assistant_model=model`, as transformers' assisted-decoding tests pass it: stock's greedy output, and every
    draft accepted (the draft reads the images as the target does, at its rows' own positions)."""
    build, inputs = FAMILIES[name]
    model = build()
    reference, out, stats = enabled_generate(model, inputs(batch), assistant_model=model)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.accepted == stats.drafted > 0


@pytest.mark.parametrize("batch", [1, 3])
def test_kosmos2_as_its_own_draft_falls_back_to_stocks_output(batch):
    model, inputs = kosmos2(), kosmos2_inputs(batch)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
    reference = model.generate(**inputs, **common)
    spec_adapt.enable(model)
    try:
        with pytest.warns(RuntimeWarning, match="pixel_values.*image_embeds.*continued without speculation"):
            out = model.generate(**inputs, **common, assistant_model=model)
    finally:
        spec_adapt.disable(model)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_lookup(name, batch):
    build, inputs = FAMILIES[name]
    reference, out, stats = enabled_generate(build(), inputs(batch), prompt_lookup_num_tokens=2)
    assert torch.equal(out, reference)
    assert stats.fallback is None


@pytest.mark.parametrize("name", FAMILIES)
def test_rows_that_accept_different_numbers_of_drafts(name):
    """Scripted drafts from stock's own output, with one wrong token at a place that moves with the row and the
    length: in one step the rows accept different numbers of drafts (a lockstep family's rows commit together). The
    logits too: a tiny model's greedy choice survives a wrong position or column distance for a while."""
    build, inputs = FAMILIES[name]
    model, kw = build(), inputs(3)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, return_dict_in_generate=True,
                  output_logits=True)
    stock = model.generate(**kw, **common)
    reference = stock.sequences
    generated, prompt = reference[:, -MAX_NEW:].tolist(), kw["attention_mask"].sum(dim=1).tolist()

    def script(row, context, gamma):
        done = len(context) - prompt[row]
        right = generated[row][done: done + gamma]
        wrong = (row + done) % 4                         # the draft at this index is wrong (none at index 3)
        return [t if i != wrong else (t + 1) % 90 + 5 for i, t in enumerate(right)]

    out = model.generate(**kw, **common, custom_generate=spec_adapt.generate,
                         drafter=spec_adapt.ScriptedDrafter(script), assistant_policy=FixedLength(3))
    stats = spec_adapt.last_stats()
    assert torch.equal(out.sequences, reference)
    for mine, theirs in zip(out.logits, stock.logits, strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-4)
    assert stats.fallback is None and 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("batch", [1, 3])
def test_kosmos2_numbers_tokens_from_the_cache_as_stock_does(batch):
    """Kosmos-2's text model numbers tokens itself (padding id + 1 + the cache length): no step passes it the
    ledger's positions, plain steps included (a policy that never drafts). Logits, not only tokens: a tiny model's
    greedy choice survives a shift of every position for a while."""
    model, inputs = kosmos2(), kosmos2_inputs(batch)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, return_dict_in_generate=True,
                  output_logits=True)
    stock = model.generate(**inputs, **common)
    ours = model.generate(**inputs, **common, custom_generate=spec_adapt.generate,
                          drafter=spec_adapt.PromptLookupDrafter(), assistant_policy=FixedLength(0))
    assert torch.equal(ours.sequences, stock.sequences)
    for mine, theirs in zip(ours.logits, stock.logits):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-4)


def test_paligemma2_is_refused_where_its_window_would_bind():
    """PaliGemma builds every layer's mask from the one it is given: served while the sliding window cannot bind,
    refused up front (naming the window and the fix) where the call could reach past it."""
    model, inputs = paligemma2(), paligemma2_inputs(1)
    window = model.config.text_config.sliding_window
    spec_adapt.enable(model)
    try:
        with pytest.raises(ValueError, match=f"PaliGemma.*window {window}.*up to {window} tokens"):
            model.generate(**inputs, max_length=window + 1, do_sample=False, prompt_lookup_num_tokens=2)
    finally:
        spec_adapt.disable(model)


def test_voxtral_realtime_is_refused_by_name():
    encoder = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=8, num_mel_bins=8, max_position_embeddings=256)
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = tf.VoxtralRealtimeForConditionalGeneration(tf.VoxtralRealtimeConfig(audio_config=encoder,
                                                                                text_config=text)).eval()
    ids = torch.randint(5, 90, (1, 8))
    spec_adapt.enable(model)
    try:
        with pytest.raises(ValueError, match="VoxtralRealtime.*streaming"):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           input_features=torch.randn(1, 8, 8 * 8 + 64), max_new_tokens=4, do_sample=False,
                           prompt_lookup_num_tokens=2)
    finally:
        spec_adapt.disable(model)
