"""Greedy identity for targets that take more than token ids: vision-language models (LLaVA, Qwen2-VL with M-RoPE,
Gemma 3 with sliding windows and bidirectional image attention, Idefics3) and encoder-decoder models (T5, BART,
Whisper), tiny models built from their transformers configs (tests/multimodal_models.py). Each runs at batch 1 and
batched (left-padded prompts with an image each, or ragged encoder inputs) against stock greedy at the same batch,
with scripted drafts that are right for some rows and wrong for others, prompt lookup under the default policy, a
text-only draft model, and draft models that read more than tokens: the images, the target's encoder outputs, or an
encoder of their own (an encoder-decoder draft)."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch

import spec_adapt
from spec_adapt import FixedLength, FixedTree, PromptLookupDrafter
from spec_adapt.drafters import CrossTokenizerDrafter, ModelDrafter
from spec_adapt.ledger import positions_from_cache

import multimodal_models as mm
from conftest import PAD, Oracle, cached_model
from test_sampling import marginals_miss

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
    eos = late_eos(free, start)     # row 0 ends early, the others never
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
    eos = late_eos(free, start)
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
    assert all(float(exact.max()) < 0.9 for exact in marginals)   # real distributions, not near-certain tokens
    assert marginals_miss(tokens, marginals, vocab=len(marginals[0])) is None


@pytest.mark.parametrize("name", ["llava", "t5"])
def test_a_verifier_that_stops_mid_forward_is_refused_at_entry(name):
    with pytest.raises(ValueError, match="FullVerifier"):
        run(name, 2, PromptLookupDrafter(2, 1), FixedLength(2), verifier=spec_adapt.EarlyExitVerifier(top_k=2))


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_a_multimodal_draft_reads_the_images_with_its_prompt(name):
    """The target itself as its own draft accepts every draft when it sees the images too (`prompt_inputs`, which
    `enable` fills from the call), and with Qwen2-VL only if it also places them as generate does (M-RoPE positions
    on the image grid); without them it drafts from the tokens alone and misses."""
    model, inputs = mm.model(name), mm.batch_inputs(name, 3, seed=4)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=None)
    reference = model.generate(**inputs, **common)
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    seeing = ModelDrafter(model, prompt_inputs=images)
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


def test_a_qwen2_vl_draft_reads_its_prompt_at_the_m_rope_positions():
    """A multimodal draft's forwards get the positions generate gives the target: its prompt on the image grid
    (M-RoPE: 4 channels, the text after the image numbered past the grid, not by token count), and each drafted
    token the last prompt position + 1, + 2, ... (a tiny model's argmax barely moves with positions, so the forwards
    are read, not only the acceptance)."""
    import copy

    from spec_adapt import compat

    model, inputs = mm.model("qwen2_vl"), mm.batch_inputs("qwen2_vl", 3, seed=4)
    draft, seen = copy.deepcopy(model), []
    handle = draft.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("position_ids")),
                                             with_kwargs=True)
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    expected = compat.generation_positions(model, inputs["input_ids"], dict(images,
                                           attention_mask=inputs["attention_mask"]))
    try:
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=None,
                             custom_generate=spec_adapt.generate, drafter=ModelDrafter(draft, prompt_inputs=images),
                             assistant_policy=FixedLength(3))
    finally:
        handle.remove()
    assert torch.equal(out, model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD,
                                           eos_token_id=None))
    assert not torch.equal(expected[1:], expected[:1].expand_as(expected[1:]))    # the grid is not the text range
    pad = (inputs["attention_mask"] == 0).sum(dim=1)
    for row, skip in enumerate(pad.tolist()):              # the draft feeds each row's real tokens from column 0
        length = expected.shape[-1] - skip
        assert torch.equal(seen[0][:, row, :length], expected[:, row, skip:]), row
    later = seen[1]                                        # the next forward: each row's next positions
    assert later.shape[0] == 4 and bool((later[..., 0] == expected[..., -1] + 1).all())


# ------------------------------------------------------------------------------ an encoder-decoder draft model
ENC_DEC_DRAFTS = ["t5", "bart", "whisper", "speech_to_text"]


def encoder_inputs(model, inputs) -> dict:
    """What an encoder-decoder draft's encoder reads of a call's inputs: its main input and the attention mask."""
    names = (model.main_input_name, "attention_mask")
    return {name: inputs[name] for name in names if inputs.get(name) is not None}


NOISE = {"t5": 0.01}        # T5's greedy choices are the closest: a little noise already changes many


@functools.lru_cache(maxsize=None)
def other_draft(name):
    """A draft of the target's family and vocabulary, with its own encoder: the target's weights plus noise, right
    often and not always."""
    draft = copy.deepcopy(mm.model(name))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * NOISE.get(name, 0.1) * p.std())
    return draft


@functools.lru_cache(maxsize=None)
def twin_draft(name):
    """The target's function with an encoder of its own: its encoder's outputs negated, and its cross-attention's
    key and value weights negated back (exact). Every draft is right if, and only if, it attends to its own
    encoder's outputs, not the target's."""
    draft = copy.deepcopy(mm.model(name))
    draft.get_encoder().register_forward_hook(lambda module, args, out: out.__class__(
        **{**out, "last_hidden_state": -out.last_hidden_state}))
    with torch.no_grad():
        for module_name, module in draft.named_modules():
            if module_name.endswith(("encoder_attn.k_proj", "encoder_attn.v_proj", "EncDecAttention.k",
                                     "EncDecAttention.v")):
                module.weight.neg_()
    return draft


DRAFTS = {"itself": mm.model, "twin": twin_draft}


def own_encoder_draft(name, draft, batch, seed=0):
    return ModelDrafter(draft, prompt_inputs=encoder_inputs(draft, mm.batch_inputs(name, batch, seed)))


@pytest.mark.parametrize("name", ENC_DEC_DRAFTS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", DRAFTS)
def test_an_encoder_decoder_draft_attends_to_its_own_encoder_outputs(name, batch, kind):
    """The target (or its twin) as the draft, its encoder run on the call's encoder inputs: every draft is accepted
    only if each row attends to its own encoder's outputs of its own row, at the right positions."""
    reference, out, stats = run(name, batch, own_encoder_draft(name, DRAFTS[kind](name), batch), FixedLength(3))
    assert torch.equal(out, reference)
    assert stats.accepted == stats.drafted > 0 and stats.fallback is None


@pytest.mark.parametrize("name", ENC_DEC_DRAFTS)
def test_a_different_encoder_decoder_draft(name):
    reference, out, stats = run(name, 3, own_encoder_draft(name, other_draft(name), 3), FixedLength(3))
    assert torch.equal(out, reference)
    assert 0 < stats.accepted < stats.drafted and stats.fallback is None


class SlotsChecked(ModelDrafter):
    """After every proposal: each row's cached tokens sit at the cache column of their own index, the position a
    decoder that numbers tokens by cache column gives them (stock's), with holes only after them."""

    def propose(self, request):
        proposal = super().propose(request)
        slots = self.ledger.slots
        assert bool(((slots == torch.arange(slots.shape[1])) | (slots < 0)).all()), slots
        assert bool((slots >= 0).all(dim=0)[: int(self.ledger.n_cached.min())].all()), slots
        return proposal


class Ragged(spec_adapt.Policy):
    """Per-row lengths by step (the last line repeats): rows that draft nothing fall behind in the draft's cache."""

    needs_timing = False

    def __init__(self, *lines):
        self.lines = lines

    def choose(self, info):
        return torch.tensor(self.lines[min(info.step, len(self.lines) - 1)][: info.batch_size])


@pytest.mark.parametrize("name", ["bart", "whisper"])
@pytest.mark.parametrize("plan", ["fixed", "ragged", "early exit"])
def test_the_draft_decoder_numbers_its_tokens_as_stock_does(name, plan):
    """Bart's and Whisper's decoders number tokens by cache column. With every row drafting alike, with rows that
    draft nothing for a while (they catch up later next to rows one token behind) and with rows that stop drafting
    early, each draft token must still sit at its own column; the target as its own draft then loses only what
    lockstep acceptance takes (a row accepts as many as the row that drafted fewest)."""
    model = mm.model(name)
    policy = {"fixed": FixedLength(4), "ragged": Ragged([0, 3, 3], [3, 0, 1], [3, 3, 3])}.get(plan, FixedLength(4))
    threshold = {"bart": 0.2, "whisper": 0.1}[name] if plan == "early exit" else None     # rows stop unlike
    drafter = SlotsChecked(model, prompt_inputs=encoder_inputs(model, mm.batch_inputs(name, 3)),
                           confidence_threshold=threshold)
    reference, out, stats = run(name, 3, drafter, policy, strict=True)     # strict: a failed check raises
    assert torch.equal(out, reference) and stats.drafted > 0
    for record in stats.trace:
        assert all(a == min(record.drafted) for a in record.accepted), record


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_enable_hands_an_encoder_decoder_draft_the_calls_encoder_inputs(name):
    model, inputs = mm.model(name), mm.batch_inputs(name, 3, seed=1)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=None)
    reference = model.generate(**inputs, **common)
    spec_adapt.enable(model, assistant_policy=FixedLength(3))
    try:
        out = model.generate(**inputs, **common, assistant_model=model)
        stats = spec_adapt.last_stats()
        assert torch.equal(out, reference) and stats.accepted == stats.drafted > 0 and stats.fallback is None
        main = inputs.pop(model.main_input_name)        # the main input positionally, as generate(inputs) takes it
        out = model.generate(main, **inputs, **common, assistant_model=twin_draft(name))
        stats = spec_adapt.last_stats()
        assert torch.equal(out, reference) and stats.accepted == stats.drafted > 0 and stats.fallback is None
        out = model.generate(main, **inputs, **common, assistant_model=other_draft(name))
        stats = spec_adapt.last_stats()
        assert torch.equal(out, reference) and 0 < stats.accepted < stats.drafted
    finally:
        spec_adapt.disable(model)


def test_the_drafts_encoder_runs_once_per_call_and_only_if_it_drafts():
    draft = other_draft("t5")
    rows = []
    hook = draft.get_encoder().register_forward_hook(
        lambda module, args, kwargs, out: rows.append(len(kwargs["input_ids"])), with_kwargs=True)
    try:
        reference, out, stats = run("t5", 3, own_encoder_draft("t5", draft, 3), FixedLength(3))
        assert torch.equal(out, reference)
        assert rows == [3] and stats.steps > 2 and stats.drafted > 0
        reference, out, stats = run("t5", 3, own_encoder_draft("t5", draft, 3), FixedLength(0))
        assert torch.equal(out, reference) and rows == [3]         # a call kept plain never runs the draft
    finally:
        hook.remove()


class PlainBetween(spec_adapt.Policy):
    """`gamma` drafts a step, except plain steps `plain` (an offloaded draft is away then)."""

    needs_timing = False

    def __init__(self, gamma, plain):
        self.gamma, self.plain = gamma, plain

    def choose(self, info):
        return 0 if info.step in self.plain else self.gamma


def late_eos(free: torch.Tensor, start: int) -> int:
    """A token row 0 of `free` generates after its first two tokens, and neither there nor in the other rows'
    generated tokens: as the EOS, row 0 ends first, and not before its third token."""
    others = set(free[1:, start:].flatten().tolist()) | set(free[0, start:start + 2].tolist())
    return next(int(t) for t in free[0, start + 2:] if int(t) not in others)


def row_zero_ends_first(model, inputs, common) -> tuple[int, torch.Tensor]:
    """An EOS token that row 0 generates (after its first two tokens) and the other rows never do, and stock's
    output with it: row 0 then finishes first."""
    free = _as_generated(model, model.generate(**inputs, **common, eos_token_id=None))
    start = free.shape[1] - MAX_NEW
    eos = late_eos(free, start)
    return eos, model.generate(**inputs, **common, eos_token_id=eos)


@pytest.mark.parametrize("name", ["t5", "whisper"])
@pytest.mark.parametrize("late", [False, True], ids=["drafting", "plain until row 0 ends"])
def test_rows_that_finish_early_take_the_drafts_encoder_outputs_along(name, late):
    """Row 0 ends at an EOS the others never reach: the draft's rows that stay keep their own encoder outputs (the
    target as its own draft is then still always right). Drafting from the start, or only after row 0 ended: the
    draft's encoder then runs on the two rows left."""
    model, inputs = mm.model(name), mm.batch_inputs(name, 3, seed=2)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    eos, reference = row_zero_ends_first(model, inputs, common)
    stats = spec_adapt.SpecStats()
    policy = PlainBetween(3, range(6)) if late else FixedLength(3)
    out = model.generate(**inputs, **common, eos_token_id=eos, custom_generate=spec_adapt.generate,
                         drafter=own_encoder_draft(name, model, 3, seed=2), assistant_policy=policy, spec_stats=stats)
    assert torch.equal(out, reference)
    assert min(stats.per_row_new_tokens) < MAX_NEW == max(stats.per_row_new_tokens)
    assert stats.accepted == stats.drafted > 0 and stats.fallback is None
    first = next(record for record in stats.trace if max(record.drafted) > 0)
    assert len(first.drafted) == (2 if late else 3)


@pytest.mark.parametrize("name, shared", [("t5", False), ("whisper", False), ("whisper", True)])
def test_an_offloaded_draft_reads_the_encoder_outputs_of_the_rows_that_stayed(name, shared, tmp_path):
    """Row 0 ends while the draft is offloaded; after the reload the draft rebuilds its KV from a first forward,
    which attends to the encoder outputs of the two rows left."""
    model, inputs = mm.model(name), mm.batch_inputs(name, 3, seed=2)
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    eos, reference = row_zero_ends_first(model, inputs, common)
    draft = whisper_decoder_draft(2) if shared else copy.deepcopy(model)       # offloading empties its weights
    inner = ModelDrafter(draft) if shared else ModelDrafter(draft, prompt_inputs=encoder_inputs(draft, inputs))
    offload = spec_adapt.DraftOffload(inner, low=1, persist=2, folder=tmp_path / "draft")
    offload.free_memory = lambda: 0 if 2 <= offload._steps < 5 else 1 << 40      # short of memory in steps 2 to 4
    stats = spec_adapt.SpecStats()
    out = model.generate(**inputs, **common, eos_token_id=eos, custom_generate=spec_adapt.generate, drafter=offload,
                         assistant_policy=PlainBetween(3, range(1, 6)), spec_stats=stats)
    assert torch.equal(out, reference)
    assert [e["event"] for e in offload.events] == ["offload", "reload"]
    assert stats.trace[-1].drafted[0] > 0 and len(stats.trace[-1].drafted) == 2      # drafting again, two rows
    assert stats.accepted == stats.drafted > 0 and stats.fallback is None


def test_an_encoder_decoder_draft_without_encoder_inputs_is_refused_with_both_fixes():
    with pytest.raises(ValueError, match="encoder-decoder.*spec_adapt.enable.*assistant_model.*prompt_inputs"):
        run("t5", 1, mm.model("t5"), FixedLength(2))


def test_an_encoder_decoder_draft_for_a_decoder_only_target_is_refused():
    draft = own_encoder_draft("t5", mm.model("t5"), 1)
    with pytest.raises(ValueError, match="encoder-decoder.*decoder-only"):
        run("llava", 1, draft, FixedLength(2))


def test_an_encoder_decoder_draft_with_its_own_tokenizer_is_refused():
    from tiny_tokenizers import char_tokenizer

    tokenizer = char_tokenizer()
    drafter = CrossTokenizerDrafter(mm.model("bart"), tokenizer, tokenizer)
    with pytest.raises(ValueError, match="encoder-decoder model with a tokenizer of its own"):
        run("t5", 1, drafter, FixedLength(2))


def test_encoder_inputs_for_other_rows_than_the_calls_are_refused():
    with pytest.raises(ValueError, match="2 rows.*3"):
        run("t5", 3, own_encoder_draft("t5", mm.model("t5"), 2), FixedLength(2), strict=True)


@pytest.mark.parametrize("name", ["t5", "llava"])
def test_enable_hands_a_draft_with_inputs_of_its_own_the_users_confidence_threshold(name, monkeypatch):
    """The ModelDrafter `enable` makes to hand a draft the call's encoder inputs or images drafts under the call's
    `assistant_confidence_threshold` (none unless the user sets one)."""
    model, inputs = mm.model(name), mm.batch_inputs(name, 2, seed=1)
    common = dict(do_sample=False, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None)
    reference = model.generate(**inputs, **common)
    seen, begin = [], ModelDrafter.begin
    monkeypatch.setattr(ModelDrafter, "begin", lambda self, *a: (seen.append(self.threshold), begin(self, *a))[1])
    spec_adapt.enable(model, assistant_policy=FixedLength(3))
    try:
        for given in ({}, {"assistant_confidence_threshold": 0.25}):
            out = model.generate(**inputs, **common, **given, assistant_model=model)
            assert torch.equal(out, reference) and spec_adapt.last_stats().fallback is None
    finally:
        spec_adapt.disable(model)
    assert seen == [None, 0.25]


@pytest.mark.parametrize("name", ["llava", "t5"])
def test_prompt_lookup_beside_a_draft_model_is_refused_where_it_cannot_serve(name):
    """`assistant_model=` with `prompt_lookup_num_tokens` drafts from both through the several-source drafter; a
    target that reads images (its placeholders must not be copied) or an encoder-decoder target (its prompt is the
    encoder's) is refused by name at the call's start, rather than drafting from the model and dropping the lookup.
    Each alone still drafts."""
    model = mm.model(name)
    inputs = mm.batch_inputs(name, 1)
    draft = copy.deepcopy(model)
    spec_adapt.enable(model)
    try:
        with pytest.raises(ValueError, match="assistant_model= with prompt_lookup_num_tokens .* Pass one of the two"):
            model.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=draft,
                           prompt_lookup_num_tokens=2)
        model.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=draft)
        assert spec_adapt.last_stats().fallback is None
    finally:
        spec_adapt.disable(model)
