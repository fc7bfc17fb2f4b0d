"""Tiny random-weight vision-language and encoder-decoder models for tests, with ragged generate inputs.

Each model is built from its transformers config classes with tester-sized dimensions (hidden 32, 2 layers, 4 heads,
the conftest vocabulary), seeded, with its output embedding scaled by 8 (clear-cut greedy choices, as
conftest.tiny_model does) and untied from the input embedding, in eval mode. In the encoder-decoders the
cross-attention (and Whisper's convolutional front end) is scaled up: at random init the decoder otherwise ignores the
encoder and every row generates the same tokens. Gemma 3's image projection, zero at init, is drawn at random so that
the image makes a difference. Marian scales its embeddings (as its checkpoints do) with a wider init: without, its
decoder repeats one token whatever the encoder says.

`batch_inputs(name, batch, seed)` returns the keyword arguments of `model(name).generate(**kw)`. Row i of a batch is
the single-row batch of seed `seed + i`, so a batched output row can be compared with the same row run alone.
Decoder-only prompts are left padded, of different lengths, each with one image (Qwen2-VL and Qwen2.5-VL images differ
in size too, and LLaVA-NeXT's in aspect ratio: 14 or 16 image tokens); PaliGemma's whole prompt is its bidirectional
prefix (token_type_ids 0). Encoder-decoder prompts are right padded, as their tokenizers pad (Florence-2's begin with
its image's 5 tokens); Speech2Text's filterbank features are right padded too, with an attention mask, of different
lengths; Whisper takes fixed-length log-mel features.
"""

from __future__ import annotations

import functools

import torch
import transformers as tf

from conftest import BOS, EOS, PAD, VOCAB

IMAGE, BOI, EOI, VISION_START, VISION_END, VIDEO = 95, 94, 93, 92, 91, 90     # special ids inside the vocabulary
TEXT_IDS = (3, 90)                                                            # random text: ids 3..89
MEL_BINS, FRAMES = 8, 32                                                      # Whisper input_features [B, 8, 32]
SPECIAL = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, **SPECIAL)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
ENC_DEC = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, tie_word_embeddings=False, **SPECIAL)


# ----------------------------------------------------------------------------------------------------- builders
def _tiny(seed=0):
    """Decorator: a zero-arg builder of the eval model, seeded, with clear-cut greedy choices."""

    def wrap(build):
        @functools.wraps(build)
        def built():
            torch.manual_seed(seed)
            model = build()
            with torch.no_grad():
                out, inp = model.get_output_embeddings(), model.get_input_embeddings()
                if out.weight is inp.weight:              # T5 always ties; give the head its own weight
                    out.weight = torch.nn.Parameter(inp.weight.detach().clone())
                out.weight.mul_(8.0)
            return model.eval()

        return built

    return wrap


def _scale(model, suffixes, factor):
    """Multiply the parameters of the modules whose names end with `suffixes` by `factor`."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(suffixes):
                for p in module.parameters():
                    p.mul_(factor)
    return model


@_tiny(seed=1)                   # seed 0 greedy-loops on one token for row 0
def build_llava():
    config = tf.LlavaConfig(text_config=tf.LlamaConfig(**LLAMA),
                            vision_config=tf.CLIPVisionConfig(image_size=8, patch_size=4, **VISION),
                            image_token_index=IMAGE, image_seq_length=4, vision_feature_layer=-1)
    return tf.LlavaForConditionalGeneration(config)


@_tiny()
def build_qwen2_vl():
    text = dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                              tie_word_embeddings=False)
    return tf.Qwen2VLForConditionalGeneration(config)


@_tiny()
def build_gemma3():
    text = tf.Gemma3TextConfig(**dict(LLAMA, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"]))
    vision = tf.SiglipVisionConfig(image_size=8, patch_size=2, **VISION)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=BOI,
                             eoi_token_index=EOI, image_token_index=IMAGE, tie_word_embeddings=False,
                             attn_implementation="eager")
    model = tf.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():                                 # zero at init: the image would not count
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.02)
    return model


def _idefics_like(family: str):
    """Idefics3 and SmolVLM share a shape: a 16x16 image of 4x4 patches, pixel-shuffled by 2 into 4 tokens."""
    vision = getattr(tf, f"{family}VisionConfig")(image_size=16, patch_size=4, **VISION)
    config = getattr(tf, f"{family}Config")(text_config=tf.LlamaConfig(**LLAMA), vision_config=vision,
                                            image_token_id=IMAGE, scale_factor=2, tie_word_embeddings=False)
    return getattr(tf, f"{family}ForConditionalGeneration")(config)


@_tiny()
def build_idefics3():
    return _idefics_like("Idefics3")


@_tiny()
def build_paligemma():
    text = tf.GemmaConfig(**dict(LLAMA, head_dim=8))
    vision = tf.SiglipVisionConfig(image_size=8, patch_size=4, **VISION)
    config = tf.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE, projection_dim=32,
                                tie_word_embeddings=False)
    # SigLIP's patch embedding scaled up: at init its position embedding swamps the pixels and images look alike
    return _scale(tf.PaliGemmaForConditionalGeneration(config), "patch_embedding", 10.0)


@_tiny()
def build_qwen2_5_vl():
    text = dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=32, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[0])
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                                 vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                                 tie_word_embeddings=False)
    return tf.Qwen2_5_VLForConditionalGeneration(config)


@_tiny()
def build_mistral3():
    vision = tf.PixtralVisionConfig(image_size=16, patch_size=4, head_dim=8, **VISION)
    config = tf.Mistral3Config(text_config=tf.MistralConfig(**LLAMA), vision_config=vision, image_token_index=IMAGE,
                               spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False)
    return tf.Mistral3ForConditionalGeneration(config)


@_tiny(seed=3)                   # seed 0 loops on PAD; 1 and 2 leave row 0 no token of its own
def build_llava_next():
    config = tf.LlavaNextConfig(text_config=tf.LlamaConfig(**LLAMA),
                                vision_config=tf.CLIPVisionConfig(image_size=8, patch_size=4, **VISION),
                                image_token_index=IMAGE, image_grid_pinpoints=[[8, 16], [16, 8]],
                                vision_feature_layer=-1, tie_word_embeddings=False)
    return tf.LlavaNextForConditionalGeneration(config)


@_tiny()
def build_smolvlm():
    return _idefics_like("SmolVLM")


@_tiny()
def build_t5():
    config = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, initializer_factor=2.0, decoder_start_token_id=PAD,
                         tie_word_embeddings=False, **SPECIAL)
    return _scale(tf.T5ForConditionalGeneration(config), "EncDecAttention", 1.5)


@_tiny()
def build_bart():
    config = tf.BartConfig(max_position_embeddings=128, init_std=0.05, decoder_start_token_id=EOS,
                           forced_bos_token_id=None, forced_eos_token_id=None, **ENC_DEC)
    return _scale(tf.BartForConditionalGeneration(config), "encoder_attn", 2.0)


@_tiny()
def build_whisper():
    config = tf.WhisperConfig(num_mel_bins=MEL_BINS, max_source_positions=FRAMES // 2, max_target_positions=128,
                              decoder_start_token_id=BOS, suppress_tokens=None, begin_suppress_tokens=None, **ENC_DEC)
    model = _scale(tf.WhisperForConditionalGeneration(config), ("encoder.conv1", "encoder.conv2"), 30.0)
    return _scale(model, "encoder_attn", 1.5)


@_tiny()
def build_mbart():
    config = tf.MBartConfig(max_position_embeddings=128, init_std=0.05, decoder_start_token_id=EOS,
                            forced_bos_token_id=None, forced_eos_token_id=None, **ENC_DEC)
    return _scale(tf.MBartForConditionalGeneration(config), "encoder_attn", 2.0)


@_tiny(seed=1)                   # seed 0 repeats one token in most rows
def build_marian():
    config = tf.MarianConfig(max_position_embeddings=128, init_std=0.1, scale_embedding=True,
                             decoder_start_token_id=PAD, forced_eos_token_id=None, **ENC_DEC)
    return _scale(tf.MarianMTModel(config), "encoder_attn", 1.5)


@_tiny()
def build_speech_to_text():
    config = tf.Speech2TextConfig(input_feat_per_channel=MEL_BINS, input_channels=1, num_conv_layers=2,
                                  conv_kernel_sizes=(5, 5), conv_channels=32, max_source_positions=FRAMES,
                                  max_target_positions=128, init_std=0.05, decoder_start_token_id=EOS, **ENC_DEC)
    return _scale(tf.Speech2TextForConditionalGeneration(config), "encoder_attn", 2.0)


@_tiny()
def build_florence2():
    text = dict(ENC_DEC, max_position_embeddings=128, init_std=0.05, decoder_start_token_id=EOS,
                forced_bos_token_id=None, forced_eos_token_id=None)
    vision = dict(in_channels=3, depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                  patch_prenorm=[False, True], embed_dim=[8, 16], num_heads=[1, 2], num_groups=[1, 2],
                  window_size=12, projection_dim=32, max_temporal_embeddings=4, max_position_embeddings=8)
    config = tf.Florence2Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                tie_word_embeddings=False)
    return _scale(tf.Florence2ForConditionalGeneration(config), "encoder_attn", 2.0)


BUILDERS = {"llava": build_llava, "qwen2_vl": build_qwen2_vl, "gemma3": build_gemma3, "idefics3": build_idefics3,
            "paligemma": build_paligemma, "qwen2_5_vl": build_qwen2_5_vl, "mistral3": build_mistral3,
            "llava_next": build_llava_next, "smolvlm": build_smolvlm,
            "t5": build_t5, "bart": build_bart, "whisper": build_whisper, "mbart": build_mbart,
            "marian": build_marian, "speech_to_text": build_speech_to_text,
            "florence2": build_florence2}
DECODER_ONLY = ("llava", "qwen2_vl", "gemma3", "idefics3", "paligemma", "qwen2_5_vl", "mistral3", "llava_next",
                "smolvlm")
ENCODER_DECODER = ("t5", "bart", "whisper", "mbart", "marian", "speech_to_text", "florence2")


@functools.lru_cache(maxsize=None)
def model(name: str):
    """The eval model `name`, built once per process (builds are seeded: every build is the same)."""
    return BUILDERS[name]()


# ------------------------------------------------------------------------------------------------------- inputs
def _text(gen, n):
    return torch.randint(*TEXT_IDS, (n,), generator=gen).tolist()


def _prompt(gen, seed, image_block):
    """[BOS] text image-block text, with text lengths that vary with the seed."""
    return [BOS] + _text(gen, 2 + seed % 3) + image_block + _text(gen, 3 + (2 * seed) % 5)


def _pad(rows, left):
    """(input_ids, attention_mask) of rows padded with PAD on the left or the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[b, cols], mask[b, cols] = torch.tensor(row), 1
    return ids, mask


def _llava_row(gen, seed):
    return _prompt(gen, seed, [IMAGE] * 4), {"pixel_values": torch.randn(1, 3, 8, 8, generator=gen)}


def _gemma3_row(gen, seed):
    return _prompt(gen, seed, [BOI] + [IMAGE] * 4 + [EOI]), {"pixel_values": torch.randn(1, 3, 8, 8, generator=gen)}


def _idefics3_row(gen, seed):
    extra = {"pixel_values": torch.randn(1, 1, 3, 16, 16, generator=gen),
             "pixel_attention_mask": torch.ones(1, 1, 16, 16, dtype=torch.bool)}
    return _prompt(gen, seed, [EOI] + [IMAGE] * 4 + [EOI]), extra


def _qwen2_vl_row(gen, seed):
    grid = [(1, 4, 4), (1, 4, 6), (1, 6, 4)][seed % 3]             # 4, 6 or 6 image tokens after the 2x2 merge
    patches = grid[0] * grid[1] * grid[2]
    extra = {"pixel_values": torch.randn(patches, 3 * 2 * 4 * 4, generator=gen),
             "image_grid_thw": torch.tensor([grid])}
    return _prompt(gen, seed, [VISION_START] + [IMAGE] * (patches // 4) + [VISION_END]), extra


def _mistral3_row(gen, seed):
    extra = {"pixel_values": torch.randn(1, 3, 16, 16, generator=gen), "image_sizes": torch.tensor([[16, 16]])}
    return _prompt(gen, seed, [IMAGE] * 4), extra


def _llava_next_row(gen, seed):
    size = [(8, 16), (16, 8)][seed % 2]                       # 14 or 16 image tokens
    extra = {"pixel_values": torch.randn(1, 3, 3, 8, 8, generator=gen), "image_sizes": torch.tensor([size])}
    return _prompt(gen, seed, [IMAGE] * (14 if seed % 2 == 0 else 16)), extra


VLM_ROWS = {"llava": _llava_row, "qwen2_vl": _qwen2_vl_row, "gemma3": _gemma3_row, "idefics3": _idefics3_row,
            "paligemma": _llava_row, "qwen2_5_vl": _qwen2_vl_row, "mistral3": _mistral3_row,
            "llava_next": _llava_next_row, "smolvlm": _idefics3_row}


def _vlm_inputs(name, seeds):
    rows, extras = zip(*(VLM_ROWS[name](torch.Generator().manual_seed(s), s) for s in seeds))
    input_ids, attention_mask = _pad(rows, left=True)
    kw = {"input_ids": input_ids, "attention_mask": attention_mask}
    kw.update({key: torch.cat([e[key] for e in extras]) for key in extras[0]})
    if name in ("qwen2_vl", "qwen2_5_vl"):
        kw["mm_token_type_ids"] = (input_ids == IMAGE).int()
    if name == "gemma3":
        kw["token_type_ids"] = (input_ids == IMAGE).long()
    if name == "paligemma":
        kw["token_type_ids"] = torch.zeros_like(input_ids)         # the whole prompt is the bidirectional prefix
    return kw


def _encoder_inputs(name, seeds):
    if name == "whisper":
        features = [torch.randn(1, MEL_BINS, FRAMES, generator=torch.Generator().manual_seed(s)) for s in seeds]
        return {"input_features": torch.cat(features)}
    if name == "speech_to_text":
        features = [torch.randn(16 + 4 * (s % 4), MEL_BINS, generator=torch.Generator().manual_seed(s))
                    for s in seeds]                                   # 16 to 28 frames [T, 8]
        width = max(len(f) for f in features)
        padded, mask = torch.zeros(len(seeds), width, MEL_BINS), torch.zeros(len(seeds), width, dtype=torch.long)
        for b, f in enumerate(features):
            padded[b, :len(f)], mask[b, :len(f)] = f, 1
        return {"input_features": padded, "attention_mask": mask}
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    image = [IMAGE] * 5 if name == "florence2" else []              # Florence-2: 5 image tokens, then the text
    rows = [image + _text(gen, 5 + (3 * s) % 6) + [EOS] for gen, s in zip(gens, seeds)]
    input_ids, attention_mask = _pad(rows, left=False)
    kw = {"input_ids": input_ids, "attention_mask": attention_mask}
    if name == "florence2":
        kw["pixel_values"] = torch.cat([torch.randn(1, 3, 16, 16, generator=gen) for gen in gens])
    return kw


def batch_inputs(name: str, batch: int, seed: int = 0) -> dict:
    """Keyword arguments for `model(name).generate(**kw)`: `batch` rows, row i made from seed `seed + i`."""
    seeds = range(seed, seed + batch)
    return _vlm_inputs(name, seeds) if name in DECODER_ONLY else _encoder_inputs(name, seeds)
