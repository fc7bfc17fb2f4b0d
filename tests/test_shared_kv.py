"""Gemma 4 assistants (`SharedKVDrafter`): drafters that attend to the target's own keys and values, batched, on tiny
random Gemma 4 targets (text and unified) with tiny assistants."""

from __future__ import annotations

import functools

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength, SharedKVDrafter, compat

from conftest import BOS, EOS, PAD, VOCAB
from test_sampling import VOCAB_SMALL, follows_target

NEW = 12
WINDOW = 4


def _text_config(config_class, **overrides):
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, global_head_dim=8, num_kv_shared_layers=2,
                  layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, max_position_embeddings=256,
                  attn_implementation="eager", vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS,
                  pad_token_id=PAD)
    return config_class(**{**fields, **overrides})


@functools.lru_cache(maxsize=None)
def pair(unified: bool = False, vocab: int = VOCAB, seed: int = 0, agree: bool = False):
    """A tiny Gemma 4 target (sliding and full layers, the last two sharing their KV; window 4, so prompts outgrow
    it) and a tiny assistant of two layers that read the target's shared keys. `agree`: both made to predict the next
    token from the current token alone, the same way (see `_agreeing`), so every draft is accepted."""
    from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig,
                              Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM,
                              Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig)

    text, target_class, config_class, assistant_class = (
        (Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM, Gemma4UnifiedAssistantConfig,
         Gemma4UnifiedAssistantForCausalLM) if unified
        else (Gemma4TextConfig, Gemma4ForCausalLM, Gemma4AssistantConfig, Gemma4AssistantForCausalLM))
    torch.manual_seed(seed)
    target = target_class(_text_config(text, vocab_size=vocab, vocab_size_per_layer_input=vocab)).eval()
    small = _text_config(text, hidden_size=32 if agree else 16, intermediate_size=32, num_hidden_layers=2,
                         layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2,
                         hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, vocab_size=vocab)
    assistant = assistant_class(config_class(text_config=small, backbone_hidden_size=32)).eval()
    assistant.generation_config.num_assistant_tokens = 3     # what stock drafts a step (checkpoints ship it)
    with torch.no_grad():          # clear-cut greedy choices (conftest.tiny_model)
        target.get_output_embeddings().weight.mul_(8.0)
        assistant.lm_head.weight.mul_(8.0)
        if agree:
            _agreeing(target, assistant)
    return target, assistant


def _agreeing(target, assistant):
    """Attention, MLP and per-layer-input outputs zeroed in both models, so each maps a token's embedding straight to logits; the
    assistant reads the embedding half of its input (pre_projection [I, 0]) and projects with the target's final
    norm and head. Then the assistant's next token after t is the target's."""
    for model in (target.model, assistant.model):
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            if getattr(layer, "per_layer_projection", None) is not None:
                layer.per_layer_projection.weight.zero_()
    width = assistant.pre_projection.weight.shape[0]
    assistant.pre_projection.weight.zero_()
    assistant.pre_projection.weight[:, :width].copy_(torch.eye(width))
    assistant.model.norm.weight.copy_(target.model.norm.weight)
    assistant.lm_head.weight.copy_(target.get_output_embeddings().weight)


def ragged():
    """Three left-padded prompts of lengths 9, 6 and 3 (the first two outgrow the window)."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 0, 9, 12, 3]])
    mask = (torch.arange(9)[None, :] >= torch.tensor([[0], [3], [6]])).long()
    return ids, mask


def stock_rows(model, ids, mask, **kw):
    """Stock greedy generate, each row alone (no padding)."""
    return [model.generate(ids[b : b + 1, int((mask[b] == 0).sum()):], max_new_tokens=NEW, do_sample=False,
                           pad_token_id=PAD, **kw)[0] for b in range(len(ids))]


def early_stop(model, ids, mask) -> int:
    """A token to stop rows at (EOS) which some row generates after a few tokens and another row later or never."""
    plain = stock_rows(model, ids, mask, eos_token_id=None)
    generated = [row[int(m.sum()):].tolist() for row, m in zip(plain, mask)]      # stock's rows: prompt, then new
    first = {t: [row.index(t) if t in row else NEW for row in generated] for t in set(sum(generated, []))}
    return next(t for t, at in sorted(first.items()) if min(at) >= 2 and max(at) >= min(at) + 3)


def assert_rows_equal(out, mask, references):
    for b, reference in enumerate(references):
        row = out[b, int((mask[b] == 0).sum()):]
        assert row.tolist()[: len(reference)] == reference.tolist(), f"row {b}"


@pytest.mark.parametrize("unified", [False, True])
def test_stock_serves_the_tiny_pair_at_batch_1(unified):
    """The tiny pair is one stock serves: its assisted greedy output is its plain greedy output."""
    target, assistant = pair(unified)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    plain = target.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    assisted = target.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, assistant_model=assistant)
    assert assisted.tolist() == plain.tolist()


@pytest.mark.parametrize("unified", [False, True])
def test_greedy_at_batch_3_matches_stock_per_row_after_enable(unified):
    target, assistant = pair(unified)
    ids, mask = ragged()
    references = stock_rows(target, ids, mask)
    spec_adapt.enable(target)
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                              assistant_model=assistant, assistant_policy=FixedLength(3))
    finally:
        spec_adapt.disable(target)
    stats = spec_adapt.last_stats()
    assert_rows_equal(out, mask, references)
    assert stats.fallback is None and stats.drafted > 0


def test_rows_that_stop_at_eos_leave_the_batch_and_the_rest_stay_identical():
    """An EOS that one row reaches early and another later: rows leave the batch mid-call (the drafter follows them,
    `select_rows`), drafts may run past a row's EOS, and every row's tokens are still stock's."""
    target, assistant = pair()
    ids, mask = ragged()
    eos = early_stop(target, ids, mask)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          eos_token_id=eos, custom_generate=spec_adapt.generate, drafter=SharedKVDrafter(assistant),
                          assistant_policy=FixedLength(3), strict=True)
    stats = spec_adapt.last_stats()
    assert_rows_equal(out, mask, stock_rows(target, ids, mask, eos_token_id=eos))
    assert stats.fallback is None and stats.drafted > 0
    assert min(len(r.rows) for r in stats.trace) < len(ids)           # rows left mid-call


def test_an_assistant_in_another_dtype_drafts_beside_a_float32_target():
    """A bfloat16 assistant beside a float32 target (stock's concatenation fails on the mixed dtypes): its inputs and
    the target's keys are cast to its dtype, its hidden state back; the output stays the target's."""
    import copy

    target, assistant = pair(agree=True)
    half = copy.deepcopy(assistant).to(torch.bfloat16)
    ids, mask = ragged()
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          custom_generate=spec_adapt.generate, drafter=SharedKVDrafter(half),
                          assistant_policy=FixedLength(3), strict=True)
    stats = spec_adapt.last_stats()
    assert_rows_equal(out, mask, stock_rows(target, ids, mask))
    assert stats.fallback is None and stats.drafted > 0 and stats.accepted > 0


IMAGE, BOI, EOI = 90, 91, 92


@functools.lru_cache(maxsize=None)
def multimodal_target():
    """Gemma 4 checkpoints load as `Gemma4ForConditionalGeneration` (vision tower beside the text model). Its tiny
    vision tower pools 4x4 patches of 48 values by 2, so an image is 4 soft tokens (with no pooling, transformers 5.24's
    pooler keeps none of them)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                                position_embedding_size=64)
    torch.manual_seed(0)
    target = Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=_text_config(Gemma4TextConfig), vision_config=vision, audio_config=None, image_token_id=IMAGE,
        boi_token_id=BOI, eoi_token_id=EOI)).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)
    return target


def image_rows(count: int = 3):
    """Per row: (prompt ids with an image block between texts of different lengths, pixel values [1, 16, 48], patch
    positions [1, 16, 2])."""
    rows = []
    for seed in range(count):
        gen = torch.Generator().manual_seed(seed)
        text = torch.randint(3, 80, (2 + 2 * seed,), generator=gen).tolist()
        ids = [BOS] + text + [BOI] + [IMAGE] * 4 + [EOI] + torch.randint(3, 80, (3,), generator=gen).tolist()
        positions = torch.tensor([[[x, y] for y in range(4) for x in range(4)]])
        rows.append((ids, torch.randn(1, 16, 48, generator=gen), positions))
    return rows


def test_a_multimodal_gemma4_target_with_text_prompts():
    """The assistant reads a multimodal target's text model's keys and last hidden state the same way, batched."""
    _, assistant = pair()
    target = multimodal_target()
    ids, mask = ragged()
    references = stock_rows(target, ids, mask)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          custom_generate=spec_adapt.generate, drafter=assistant, assistant_policy=FixedLength(3),
                          strict=True)
    stats = spec_adapt.last_stats()
    assert_rows_equal(out, mask, references)
    assert stats.fallback is None and stats.drafted > 0


def test_image_prompts_with_an_assistant_match_stock_and_draft_what_stock_drafts():
    """Prompts with images, batched and ragged, through stock's `assistant_model=` after `enable`: each row's output
    is stock's (stock serves the pair at batch 1 with images), and each row's drafts are what stock's generator drafts
    after the row's tokens, its images included, so the assistant reads the keys of the image positions right."""
    _, assistant = pair()
    target = multimodal_target()
    rows = image_rows()
    references = []
    for ids, pixels, positions in rows:
        prompt = torch.tensor([ids])
        plain = target.generate(prompt, pixel_values=pixels, image_position_ids=positions, max_new_tokens=NEW,
                                do_sample=False, pad_token_id=PAD)
        assisted = target.generate(prompt, pixel_values=pixels, image_position_ids=positions, max_new_tokens=NEW,
                                   do_sample=False, pad_token_id=PAD, assistant_model=assistant)
        assert assisted.tolist() == plain.tolist()
        references.append(plain[0, len(ids):])
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r, _, _ in rows])
    mask = (torch.arange(width)[None, :] >= torch.tensor([[width - len(r)] for r, _, _ in rows])).long()
    pixels, positions = torch.cat([r[1] for r in rows]), torch.cat([r[2] for r in rows])
    recorded = Recorded(assistant)
    spec_adapt.enable(target)
    try:
        out = target.generate(ids, attention_mask=mask, pixel_values=pixels, image_position_ids=positions,
                              max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, assistant_model=recorded,
                              assistant_policy=FixedLength(3), strict=True)
    finally:
        spec_adapt.disable(target)
    stats = spec_adapt.last_stats()
    assert stats.fallback is None and stats.drafted > 0
    for b, reference in enumerate(references):
        assert out[b, width:].tolist() == reference.tolist(), f"row {b}"
    checked = 0
    for tokens, lengths, user_rows, proposal in recorded.seen:
        for b, user_row in enumerate(user_rows.tolist()):
            n = int(proposal.lengths[b])
            if n:
                row = tokens[b, width - len(rows[user_row][0]) : int(lengths[b])]
                inputs = {"pixel_values": rows[user_row][1], "image_position_ids": rows[user_row][2]}
                assert proposal.tokens[b, :n].tolist() == stock_drafts(target, assistant, row, n, **inputs)
                checked += 1
    assert checked > 10


def test_an_agreeing_assistant_has_its_drafts_accepted():
    target, assistant = pair(agree=True)
    ids, mask = ragged()
    references = stock_rows(target, ids, mask)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          custom_generate=spec_adapt.generate, drafter=SharedKVDrafter(assistant),
                          assistant_policy=FixedLength(3), strict=True)
    stats = spec_adapt.last_stats()
    assert_rows_equal(out, mask, references)
    assert stats.drafted > 0 and stats.accepted == stats.drafted


class Recorded(SharedKVDrafter):
    """Keeps each proposal with the committed tokens it was drafted after."""

    def __init__(self, assistant):
        super().__init__(assistant)
        self.seen = []

    def propose(self, request):
        proposal = super().propose(request)
        self.seen.append((request.tokens.clone(), request.lengths.clone(), request.rows.clone(), proposal))
        return proposal


def stock_drafts(target, assistant, tokens: torch.Tensor, count: int, **inputs) -> list[int]:
    """What stock's SinglePositionMultiTokenCandidateGenerator drafts after a row's committed tokens (no padding)
    from a fresh forward of the target over all but the last: the target's state with no rejected columns.
    `inputs`: the row's other model inputs (its images)."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    config = target.generation_config.__class__(max_length=len(tokens) + count + 1)
    shipped = assistant.generation_config.num_assistant_tokens
    assistant.generation_config.num_assistant_tokens = count       # stock drafts the assistant's count a step
    try:
        generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(), config)
    finally:
        assistant.generation_config.num_assistant_tokens = shipped
    with torch.no_grad():
        out = target(tokens[None, :-1], output_hidden_states=True, return_shared_kv_states=True, **inputs)
        drafted, _ = generator.get_candidates(tokens[None], {"attention_mask": torch.ones(1, len(tokens))}, out,
                                              is_first_iteration=False, n_last_matches=0)
    return drafted[0, len(tokens):].tolist()


@pytest.mark.parametrize("gamma", [1, 3])
def test_batched_drafts_are_stock_drafts_of_each_row(gamma):
    """The keys each row's assistant sees (its committed columns of the target's cache: no padding, no rejected
    drafts, the sliding window counted in positions) give the drafts stock's generator gives that row alone, its
    target state recomputed from scratch; also after rows reached EOS and left the batch."""
    target, assistant = pair()
    ids, mask = ragged()
    eos = early_stop(target, ids, mask)
    drafter = Recorded(assistant)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          eos_token_id=eos, custom_generate=spec_adapt.generate, drafter=drafter,
                          assistant_policy=FixedLength(gamma), strict=True)
    assert_rows_equal(out, mask, stock_rows(target, ids, mask, eos_token_id=eos))
    assert min(len(rows) for _, _, rows, _ in drafter.seen) < len(ids)     # rows left mid-call
    checked = 0
    for tokens, lengths, rows, proposal in drafter.seen:
        for b, user_row in enumerate(rows.tolist()):
            n = int(proposal.lengths[b])
            if n:
                row = tokens[b, int((mask[user_row] == 0).sum()) : int(lengths[b])]
                assert proposal.tokens[b, :n].tolist() == stock_drafts(target, assistant, row, n), (user_row, row)
                checked += 1
    assert checked > 10


def test_sampling_follows_the_target_distribution():
    """Lossless sampling: the assistant proposes from its own distribution q, the acceptor applies the rejection
    rule (tests/test_sampling.py's enumerated harness)."""
    target, assistant = pair(vocab=VOCAB_SMALL, seed=5)
    assert follows_target(target, SharedKVDrafter(assistant), 6000, policy=FixedLength(2)) is None


def test_refusals_are_named():
    target, assistant = pair()
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(TypeError, match="Gemma 4 assistant"):
        SharedKVDrafter(target)
    from conftest import tiny_model

    llama = tiny_model("llama")
    with pytest.raises(ValueError, match="Expected class name to start with Gemma4"):
        llama.generate(ids, max_new_tokens=3, custom_generate=spec_adapt.generate, drafter=assistant, strict=True)
    assert compat.kv_store_layers(target) == {"sliding_attention": 0, "full_attention": 1}
    with pytest.raises(ValueError, match="hidden size"):
        wide = type(assistant)(assistant.config.__class__(text_config=assistant.config.text_config,
                                                          backbone_hidden_size=64))
        target.generate(ids, max_new_tokens=3, custom_generate=spec_adapt.generate, drafter=wide)


@pytest.mark.parametrize("unified", [False, True])
def test_prompt_lookup_beside_an_assistant_drafts_from_both(unified, monkeypatch):
    """`assistant_model=<a Gemma 4 assistant>` with `prompt_lookup_num_tokens` drafts from both (the several-source
    drafter, the assistant its model source): on prompts whose answers repeat, prompt lookup's offers are taken,
    and every row's greedy output is stock's own. The router's step costs are fixed (`FixedCost`), not learned from
    the clock, so its choices do not depend on the machine's load."""
    import spec_adapt.drafters.sources as sources_module
    from spec_adapt.drafters.sources import MultiSourceDrafter
    from test_sources import FixedCost

    monkeypatch.setattr(sources_module, "StepCost", lambda prior_draft=0.25: FixedCost())
    spec_adapt.reset_default_policies(target := pair(unified)[0])     # a state made with the fixed costs

    target, assistant = pair(unified)
    ids, mask = ragged()
    references = [target.generate(ids[b : b + 1, int((mask[b] == 0).sum()):], max_new_tokens=24, do_sample=False,
                                  pad_token_id=PAD)[0] for b in range(len(ids))]
    spec_adapt.enable(target)
    try:
        for batch in (ids[:1], ids):
            stats = spec_adapt.SpecStats()
            out = target.generate(batch, attention_mask=mask[: len(batch)], max_new_tokens=24, do_sample=False,
                                  pad_token_id=PAD, assistant_model=assistant, prompt_lookup_num_tokens=4,
                                  spec_stats=stats)
            assert_rows_equal(out, mask, references[: len(batch)])
            assert stats.fallback is None
            assert stats.per_source.get("lookup", {}).get("drafted", 0) > 0, stats.per_source
            assert set(stats.per_source) <= {"model", "lookup", "suffix"}
            if len(batch) == 1:      # the cold first call explores the assistant too
                assert stats.per_source.get("model", {}).get("drafted", 0) > 0, stats.per_source
        drafter = spec_adapt.api.with_sources(target, SharedKVDrafter(assistant), spec_adapt.PromptLookupDrafter())
        assert isinstance(drafter, MultiSourceDrafter) and drafter.wants_hidden and drafter.reads_target
        alone = SharedKVDrafter(assistant)          # without prompt lookup asked for, it drafts alone, as stock's
        assert spec_adapt.api.with_sources(target, alone) is alone
    finally:
        spec_adapt.disable(target)


def test_gemma3n_targets_and_ensemble_weights_are_refused_by_name():
    """Stock accepts a Gemma 3n target by name and fails at its first draft (no shared_kv_states): refused up front.
    The lossy ensemble weight depends on every draft, and these drafts are not stock's: refused, not approximated."""
    from test_families import family

    _, assistant = pair()
    gemma3n = family("gemma3n")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with pytest.raises(ValueError, match="shared_kv_states"):
        gemma3n.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=assistant)      # stock's failure
    with pytest.raises(ValueError, match="does not return the shared_kv_states"):
        gemma3n.generate(ids, max_new_tokens=3, custom_generate=spec_adapt.generate, drafter=assistant, strict=True)
    target, _ = pair()
    with pytest.raises(ValueError, match="assistant_ensemble_weight with SharedKVDrafter"):
        target.generate(ids, max_new_tokens=3, custom_generate=spec_adapt.generate, drafter=assistant,
                        assistant_ensemble_weight=0.5)


def test_the_serving_engine_drafts_for_requests_that_join_a_running_batch():
    """The engine's prefill of joining requests hands their hidden states to the drafter (the running rows get
    none): every request drafts, whenever it came, and returns stock's tokens."""
    from conftest import drive_engine
    from spec_adapt import Engine

    target, assistant = pair()
    ids, mask = ragged()
    prompts = [ids[b][mask[b].bool()] for b in range(len(ids))]
    budgets, arrivals = [NEW, NEW - 2, NEW - 4], [0, 2, 3]
    engine = Engine(target, drafter=SharedKVDrafter(assistant), assistant_policy=FixedLength(2), max_batch=3,
                    pad_token_id=PAD, eos_token_id=None)
    handles = drive_engine(engine, prompts, budgets, arrivals)
    assert engine.fallback is None
    for prompt, budget, handle in zip(prompts, budgets, handles):
        stock = target.generate(prompt[None], max_new_tokens=budget, do_sample=False, pad_token_id=PAD)[0]
        assert handle.result() == stock[len(prompt):].tolist()
    assert max(r.batch_size for r in engine.stats.trace) == 3        # the later requests joined running rows
    first = {}                           # each request's drafts in its first step: from its prefill's hidden state
    for record in engine.stats.trace:
        for slot, count in zip(record.rows, record.drafted):
            first.setdefault(int(slot), int(count))
    assert sorted(first) == [0, 1, 2] and all(first.values()), first


def test_a_restarted_assistant_drafts_again_on_the_running_rows():
    """After a failure the engine restarts the drafter on its running rows, whose hidden states it has none of: each
    row drafts again once its next step has handed one (no second failure), and the tokens stay stock's."""
    from spec_adapt import Engine

    target, assistant = pair()
    ids, mask = ragged()
    prompts = [ids[b][mask[b].bool()] for b in range(len(ids))]
    drafter = SharedKVDrafter(assistant)
    engine = Engine(target, drafter=drafter, assistant_policy=FixedLength(2), max_batch=3, pad_token_id=PAD,
                    eos_token_id=None)
    engine.loop.restarts.start = engine.loop.restarts.gap = 2      # restart soon
    handles = [engine.submit(p, max_new_tokens=40) for p in prompts]
    for _ in range(2):
        engine.step()
    with pytest.warns(RuntimeWarning, match="draft lost"):
        engine.loop._guard("test", lambda: (_ for _ in ()).throw(RuntimeError("draft lost")))
    engine.run_until_idle()
    for prompt, handle in zip(prompts, handles):
        stock = target.generate(prompt[None], max_new_tokens=40, do_sample=False, pad_token_id=PAD,
                                eos_token_id=None)[0]
        assert handle.result() == stock[len(prompt):].tolist()
    assert engine.loop.drafter is drafter and engine.stats.restarts == 1
    assert sum(sum(r.drafted) for r in engine.stats.trace[-5:]) > 0


def test_the_example_runs_and_matches_stock(capsys):
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "gemma4_assistant.py"), run_name="__main__")
    assert "identical to stock greedy, row by row: True" in capsys.readouterr().out
