"""Greedy identity for targets that take more than token ids: vision-language models (LLaVA, Qwen2-VL with M-RoPE,
Gemma 3 with sliding windows and bidirectional image attention, Idefics3) and encoder-decoder models (T5, BART,
Whisper), tiny models built from their transformers configs (tests/multimodal_models.py). Each runs at batch 1 and
batched (left-padded prompts with an image each, or ragged encoder inputs) against stock greedy at the same batch,
with scripted drafts that are right for some rows and wrong for others, prompt lookup under the default policy, and
a text-only draft model."""

from __future__ import annotations

import types

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength, FixedTree, PromptLookupDrafter
from spec_adapt.ledger import positions_from_cache

import multimodal_models as mm
from conftest import PAD, Oracle, cached_model

ALL = mm.DECODER_ONLY + mm.ENCODER_DECODER
MAX_NEW = 16


def run(name, batch, drafter, policy, seed=0, **kw):
    """(stock greedy, spec_adapt greedy, SpecStats) of family `name` on a batch of `batch` rows."""
    model, inputs = mm.model(name), mm.batch_inputs(name, batch, seed)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=None)
    reference = model.generate(**inputs, **common)
    stats = spec_adapt.SpecStats()
    if isinstance(drafter, types.FunctionType):        # made from the reference (scripted drafts)
        drafter = drafter(_as_generated(model, reference), _decoder_mask(name, inputs, reference))
    out = model.generate(**inputs, **common, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=policy, spec_stats=stats, **kw)
    return reference, out, stats


def _as_generated(model, reference):
    """The reference as the loop generates it: Whisper's generate returns its tokens without the decoder's start."""
    if reference.shape[1] > MAX_NEW:
        return reference
    start = torch.full((reference.shape[0], 1), model.generation_config.decoder_start_token_id)
    return torch.cat([start, reference], dim=1)


def _decoder_mask(name, inputs, reference):
    """The mask of the tokens the loop generates from: the prompt's (decoder-only) or the decoder's start tokens."""
    if name in mm.DECODER_ONLY:
        return inputs["attention_mask"]
    return torch.ones(reference.shape[0], 1, dtype=torch.long)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("batch", [1, 3])
def test_scripted_drafts_rows_accepting_differently(name, batch):
    # An encoder-decoder target's rows commit in lockstep (as many as the row that accepted fewest): no row is wrong.
    modes = [3] if batch == 1 else ["right", 2, "wrong"] if name in mm.DECODER_ONLY else ["right", 2, 1]
    reference, out, stats = run(name, batch, lambda ref, mask: Oracle(ref, mask, modes, eos=()).drafter(), FixedLength(4))
    assert torch.equal(out, reference)
    assert stats.accepted > 0


@pytest.mark.parametrize("name", ALL)
def test_prompt_lookup_under_the_default_policy(name):
    reference, out, _ = run(name, 3, PromptLookupDrafter(2, 1), None)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("name", ALL)
def test_a_text_only_draft_model(name):
    """A causal LM of the target's vocabulary drafts from the token ids alone: image placeholders are tokens to it,
    and of an encoder-decoder target it sees the decoder's tokens."""
    reference, out, stats = run(name, 3, cached_model("llama"), FixedLength(3))
    assert torch.equal(out, reference)
    assert stats.drafted > 0


@pytest.mark.parametrize("name", mm.DECODER_ONLY)
def test_token_trees_on_vision_language_targets(name):
    reference, out, stats = run(name, 3, lambda ref, mask: Oracle(ref, mask, ["right", 1, "wrong"], eos=()).drafter(),
                                FixedTree(6, 3))
    assert torch.equal(out, reference)
    assert stats.accepted > 0


def test_positions_continue_from_the_last_prompt_position_in_every_channel():
    """Qwen2-VL's M-RoPE: a prompt with an image has positions that are not a range, and generated tokens continue
    from its last position in all three channels. A draft accepted four tokens at a time must see the same."""
    reference, out, stats = run("qwen2_vl", 3, lambda ref, mask: Oracle(ref, mask, ["right"], eos=()).drafter(),
                                FixedLength(4), seed=5)
    assert torch.equal(out, reference)
    assert stats.accepted >= 3 * 8


@pytest.mark.parametrize("name", mm.ENCODER_DECODER)
def test_encoder_decoder_targets_run_in_lockstep_and_refuse_the_engine(name):
    model = mm.model(name)
    assert "encoder-decoder" in positions_from_cache(model)
    with pytest.raises(ValueError, match="encoder-decoder"):
        spec_adapt.Engine(model, drafter=PromptLookupDrafter(2, 1))


def test_the_encoder_runs_once_per_call():
    model = mm.model("t5")
    calls = []
    hook = model.get_encoder().register_forward_hook(lambda *args: calls.append(1))
    try:
        reference, out, stats = run("t5", 3, lambda ref, mask: Oracle(ref, mask, ["right", 1, 2], eos=()).drafter(),
                                    FixedLength(3))
    finally:
        hook.remove()
    assert torch.equal(out, reference)
    assert len(calls) == 2 and stats.steps > 2      # stock's reference call and ours: one encoder forward each


def test_inputs_embeds_is_refused_by_name():
    model = mm.model("llava")
    inputs = mm.batch_inputs("llava", 1)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with pytest.raises(ValueError, match="inputs_embeds"):
        model.generate(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], max_new_tokens=4,
                       custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(2, 1),
                       assistant_policy=FixedLength(2))


@pytest.mark.parametrize("name", ["qwen2_vl", "t5", "whisper"])
def test_rows_that_finish_early_leave_with_their_inputs(name):
    """A row that ends (at an EOS the others have not reached) leaves the batch, and its encoder outputs, encoder
    mask and positions leave with it."""
    model, inputs = mm.model(name), mm.batch_inputs(name, 3, seed=2)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    free = _as_generated(model, model.generate(**inputs, **common, eos_token_id=None))
    start = free.shape[1] - MAX_NEW
    others = set(free[1:, start:].flatten().tolist())
    eos = next(int(t) for t in free[0, start + 2:] if int(t) not in others)     # row 0 ends early, the others never
    reference = model.generate(**inputs, **common, eos_token_id=eos)
    drafter = Oracle(free, _decoder_mask(name, inputs, free), ["right", 2, 1], eos=(eos,)).drafter()
    stats = spec_adapt.SpecStats()
    out = model.generate(**inputs, **common, eos_token_id=eos, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=FixedLength(3), spec_stats=stats)
    assert torch.equal(out, reference)
    assert min(stats.per_row_new_tokens) < MAX_NEW == max(stats.per_row_new_tokens)


@pytest.mark.parametrize("name", ALL)
def test_verified_logits_match_one_token_decoding(name):
    """Stricter than tokens (a tiny model's greedy choice survives small position errors): every generated position's
    logits equal stock's, with rows that accept differently and a row that finishes first."""
    model, inputs = mm.model(name), mm.batch_inputs(name, 3, seed=2)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD, return_dict_in_generate=True,
                  output_logits=True)
    free = _as_generated(model, model.generate(**inputs, **common, eos_token_id=None).sequences)
    start = free.shape[1] - MAX_NEW
    others = set(free[1:, start:].flatten().tolist())
    eos = next(int(t) for t in free[0, start + 2:] if int(t) not in others)
    stock = model.generate(**inputs, **common, eos_token_id=eos)
    modes = ["right", 2, "wrong"] if name in mm.DECODER_ONLY else ["right", 2, 1]
    drafter = Oracle(free, _decoder_mask(name, inputs, free), modes, eos=(eos,)).drafter()
    ours = model.generate(**inputs, **common, eos_token_id=eos, custom_generate=spec_adapt.generate, drafter=drafter,
                          assistant_policy=FixedLength(3))
    assert torch.equal(ours.sequences, stock.sequences)
    finished = (stock.sequences == eos).any(dim=1)
    for position, (mine, theirs) in enumerate(zip(ours.logits, stock.logits)):
        live = ~finished | (position < 3)            # stock keeps computing finished rows; spec_adapt drops them
        assert torch.allclose(mine[live], theirs[live], rtol=1e-4, atol=1e-3), position


def whisper_decoder_draft(layers: int):
    """Distil-Whisper's shape of draft: the target's decoder (its first `layers` layers) as a WhisperForCausalLM,
    attending to the target's encoder outputs."""
    from transformers import WhisperForCausalLM

    target = mm.model("whisper")
    config = target.config.__class__(**{**target.config.to_dict(), "decoder_layers": layers,
                                        "is_encoder_decoder": False})
    draft = WhisperForCausalLM(config).eval()
    state = {f"model.decoder.{k}": v for k, v in target.model.decoder.state_dict().items()}
    state["proj_out.weight"] = target.proj_out.weight
    draft.load_state_dict(state, strict=False)
    return draft


@pytest.mark.parametrize("layers", [2, 1])
def test_a_draft_decoder_shares_the_targets_encoder_outputs(layers):
    """The target's own decoder as the draft accepts every draft only if it attends to the same encoder outputs;
    half of it (one layer of two) drafts well enough to be accepted sometimes."""
    reference, out, stats = run("whisper", 3, whisper_decoder_draft(layers), FixedLength(3), seed=1)
    assert torch.equal(out, reference)
    if layers == 2:
        assert stats.accepted == stats.drafted > 0
    else:
        assert 0 < stats.accepted < stats.drafted


TOP_K = 3
TEMPERATURE = {"llava": 4.0, "t5": 60.0}        # each family's logits spread into a real distribution


def _next_probs(model, name, inputs, prefixes):
    """[N, V] processed (temperature, top-k) next-token probabilities after each generated prefix [N, n], without a
    cache: the one-token-at-a-time reference the sampled marginals are judged against."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    rows = len(prefixes)
    repeat = {k: v.repeat(rows, *[1] * (v.dim() - 1)) for k, v in inputs.items()}
    if name in mm.ENCODER_DECODER:
        start = torch.full((rows, 1), model.generation_config.decoder_start_token_id)
        logits = model(**repeat, decoder_input_ids=torch.cat([start, prefixes], dim=1)).logits[:, -1]
    else:
        ids = torch.cat([repeat.pop("input_ids"), prefixes], dim=1)
        mask = torch.cat([repeat.pop("attention_mask"), torch.ones_like(prefixes)], dim=1)
        logits = model(input_ids=ids, attention_mask=mask, **repeat).logits[:, -1]
    for warper in (TemperatureLogitsWarper(TEMPERATURE[name]), TopKLogitsWarper(TOP_K)):
        logits = warper(None, logits)
    return logits.softmax(dim=-1)


def _exact_marginals(model, name, inputs, depth=2):
    prefixes, joint, marginals = torch.zeros(1, 0, dtype=torch.long), torch.ones(1), []
    with torch.no_grad():
        for _ in range(depth):
            step = joint[:, None] * _next_probs(model, name, inputs, prefixes)          # [N, V]
            marginals.append(step.sum(0))
            support = step.nonzero()                                                   # (prefix, token) pairs
            joint = step[support[:, 0], support[:, 1]]
            prefixes = torch.cat([prefixes[support[:, 0]], support[:, 1:]], dim=1)
    return marginals


@pytest.mark.parametrize("name", ["llava", "t5"])
def test_sampling_follows_the_target_distribution(name):
    """The enumerated statistical test: the first two sampled tokens' marginals against the target's exact ones,
    with a point-mass draft of the likeliest second token. LLaVA samples one batch of 2000 copies of the row; T5
    (lockstep: a row accepts only what every row of its batch accepts) 700 batches of 3."""
    model, inputs = mm.model(name), mm.batch_inputs(name, 1, seed=3)
    marginals = _exact_marginals(model, name, inputs)
    guess = int(marginals[1].argmax())                  # drafted for the second token (the first is the prefill's)
    drafter = spec_adapt.ScriptedDrafter(lambda row, context, gamma: [guess, 5][:gamma])
    rows, calls = (2000, 1) if name in mm.DECODER_ONLY else (3, 700)
    batch = {k: v.repeat(rows, *[1] * (v.dim() - 1)) for k, v in inputs.items()}
    torch.manual_seed(0)
    tokens, accepted = [], 0
    for _ in range(calls):
        out = model.generate(**batch, do_sample=True, temperature=TEMPERATURE[name], top_k=TOP_K, top_p=None,
                             max_new_tokens=3, eos_token_id=None, pad_token_id=PAD,
                             custom_generate=spec_adapt.generate, drafter=drafter, assistant_policy=FixedLength(2))
        tokens.append(out[:, -3:-1])
        accepted += spec_adapt.last_stats().accepted
    tokens = torch.cat(tokens)
    assert accepted > 0
    for position, exact in enumerate(marginals):
        assert float(exact.max()) < 0.9                   # a real distribution, not a near-certain token
        empirical = torch.bincount(tokens[:, position], minlength=len(exact)).float() / len(tokens)
        tolerance = 5 * (exact * (1 - exact) / len(tokens)).sqrt() + 2e-3
        assert bool(((empirical - exact).abs() < tolerance).all()), (position, empirical, exact)


def test_an_encoder_decoder_draft_model_is_refused_with_the_alternatives():
    with pytest.raises(ValueError, match="encoder-decoder model.*WhisperForCausalLM"):
        run("t5", 1, mm.model("bart"), FixedLength(2))


@pytest.mark.parametrize("name", ["llava", "t5"])
def test_a_verifier_that_stops_mid_forward_is_refused_at_entry(name):
    with pytest.raises(ValueError, match="FullVerifier"):
        run(name, 2, PromptLookupDrafter(2, 1), FixedLength(2), verifier=spec_adapt.EarlyExitVerifier(top_k=2))


def test_a_multimodal_draft_reads_the_images_with_its_prompt():
    """The target itself as its own draft accepts every draft when it sees the images too (`prompt_inputs`, which
    `enable` fills from the call); without them it drafts from the tokens alone and misses."""
    from spec_adapt.drafters import ModelDrafter

    model, inputs = mm.model("llava"), mm.batch_inputs("llava", 3, seed=4)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=None)
    reference = model.generate(**inputs, **common)
    seeing = ModelDrafter(model, prompt_inputs={"pixel_values": inputs["pixel_values"]})
    for drafter, all_accepted in ((seeing, True), (model, False)):
        stats = spec_adapt.SpecStats()
        out = model.generate(**inputs, **common, custom_generate=spec_adapt.generate, drafter=drafter,
                             assistant_policy=FixedLength(3), spec_stats=stats)
        assert torch.equal(out, reference)
        assert (stats.accepted == stats.drafted > 0) == all_accepted
    spec_adapt.enable(model)
    try:
        out = model.generate(**inputs, **common, assistant_model=model)
        assert torch.equal(out, reference) and spec_adapt.last_stats().accepted == spec_adapt.last_stats().drafted
    finally:
        spec_adapt.disable(model)
