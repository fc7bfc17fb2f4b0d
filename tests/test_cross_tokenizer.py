"""A draft with another tokenizer: the text bridge's properties, and greedy identity with stock generate for
ragged batches, scripted and model drafts, chains, EOS inside a draft and the serving engine."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec_adapt
from spec_adapt import Adaptive, ChainDrafter, FixedLength, ScriptedDrafter
from spec_adapt.drafters.cross import CrossTokenizerDrafter, TextBridge, _Row

from conftest import EOS, PAD, spec_generate, stock_greedy, tiny_model
from tiny_tokenizers import CORPUS, bpe_tokenizer, char_tokenizer

TOKENIZERS = {
    "chars": lambda: char_tokenizer(),
    "metaspace": lambda: bpe_tokenizer("metaspace", 220),
    "bytelevel": lambda: bpe_tokenizer("bytelevel", 420),
}
TEXT = st.text(alphabet=st.sampled_from(list("abcdefghij klmnop.,()\n_=éß中🙂")), max_size=60)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@SETTINGS
@given(text=TEXT, cut=st.integers(1, 40), target=st.sampled_from(sorted(TOKENIZERS)),
       draft=st.sampled_from(sorted(TOKENIZERS)))
def test_proposals_never_say_more_than_the_drafted_text(text, cut, target, draft):
    """to_target: the proposed tokens continue the committed tokens with a prefix of the drafted text, and where
    the cut falls between two words of the target's own tokenization they are that tokenization's next tokens."""
    target_tok, bridge = TOKENIZERS[target](), TextBridge(TOKENIZERS[draft](), TOKENIZERS[target]())
    ids = target_tok.encode(text, add_special_tokens=False)
    if len(ids) < 2 or target_tok.unk_token_id in ids:      # only texts the target's tokenizer can spell
        return
    cut = min(cut, len(ids) - 1)
    committed = ids[:cut]
    rest = TextBridge.text(target_tok, ids, cut, len(ids))
    proposed = bridge.to_target(committed, rest, 100)
    before, after = decode(target_tok, committed), decode(target_tok, committed + proposed)
    if before.endswith("\ufffd"):       # committed text ends inside a character: nothing is proposed
        assert proposed == []
        return
    assert after.startswith(before) and decode(target_tok, ids).startswith(after.rstrip("\ufffd"))
    if target == "chars" and "\ufffd" not in rest:
        assert proposed == ids[cut:]


@SETTINGS
@given(pieces=st.lists(TEXT, min_size=1, max_size=8), target=st.sampled_from(sorted(TOKENIZERS)),
       draft=st.sampled_from(sorted(TOKENIZERS)))
def test_a_rows_draft_tokens_spell_its_committed_text_as_it_grows(pieces, target, draft):
    """However the committed tokens grow (any split, non-canonical tokenizations included), the draft's tokens of
    the row decode to exactly the committed text (where the draft's tokenizer can spell it), and only a bounded
    window is re-encoded."""
    target_tok, draft_tok = TOKENIZERS[target](), TOKENIZERS[draft]()
    drafter = CrossTokenizerDrafter(ScriptedDrafter(lambda *a: []), draft_tok, target_tok)
    committed = target_tok.encode("The", add_special_tokens=False)
    row = drafter._new_row(list(committed))
    for piece in pieces:
        committed += target_tok.encode(piece, add_special_tokens=False)    # each piece tokenized on its own
        if not drafter._align(row, committed):
            continue
        text = decode(target_tok, committed)
        if decode(draft_tok, draft_tok.encode(text, add_special_tokens=False)) == text:    # no <unk> in the draft
            assert decode(draft_tok, row.draft) == text
        assert len(committed) - row.anchor_target <= max(2 * 8, 64)


def test_the_draft_row_starts_with_the_draft_tokenizers_own_start_token():
    from transformers import PreTrainedTokenizerFast
    from tokenizers.processors import TemplateProcessing

    draft_tok = bpe_tokenizer("bytelevel", 420)
    with_bos = PreTrainedTokenizerFast(tokenizer_object=draft_tok.backend_tokenizer, bos_token="<s>",
                                       eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    drafter = CrossTokenizerDrafter(ScriptedDrafter(lambda *a: []), with_bos, char_tokenizer())
    row = drafter._new_row([1] + char_tokenizer().encode("Hello", add_special_tokens=False))   # target BOS first
    assert row.draft[0] == 1 and decode(with_bos, row.draft[1:]) == "Hello" and row.anchor_target == 1


# Greedy identity through generate -------------------------------------------------------------------------------

def prompts(tokenizer, n, skip=0):
    """n left-padded prompts of different lengths from the corpus, in `tokenizer`'s ids: (ids, mask)."""
    rows = [tokenizer.encode(CORPUS[(skip + i) % len(CORPUS)][: 12 + 7 * i], add_special_tokens=False)
            for i in range(n)]
    width = max(map(len, rows))
    ids = torch.full((n, width), PAD, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = torch.tensor(row), 1
    return ids, mask


class TextOracle:
    """A draft in the draft tokenizer's ids that knows the target's answer as text: 'right' drafts the draft's
    tokens of what follows, 'wrong' drafts text that never follows."""

    def __init__(self, target_tok, draft_tok, reference, mask, mode):
        pad = (mask == 0).sum(1).tolist()
        self.texts = [TextBridge.text(target_tok, reference[b, pad[b]:].tolist(), 0, reference.shape[1] - pad[b])
                      for b in range(len(pad))]
        self.draft_tok, self.mode = draft_tok, mode

    def __call__(self, row, context, gamma):
        seen = decode(self.draft_tok, context)
        assert self.texts[row].startswith(seen), (seen, self.texts[row])      # the row's draft tokens spell it
        rest = self.texts[row][len(seen):] if self.mode == "right" else "~~~~~~~~~~~~~~~~~~~~~~"
        return self.draft_tok.encode(rest, add_special_tokens=False)[:gamma]


@pytest.fixture(scope="module")
def pair():
    target_tok, draft_tok = char_tokenizer(), bpe_tokenizer("bytelevel", 420)
    target = tiny_model("llama", seed=11, vocab=len(target_tok))
    draft = tiny_model("gpt2", seed=12, vocab=len(draft_tok), layers=1)
    return target, target_tok, draft, draft_tok


def run(target, ids, mask, drafter, policy, eos=None, n=30):
    stats = spec_adapt.SpecStats()
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=eos,
                          max_new_tokens=n, custom_generate=spec_adapt.generate, drafter=drafter,
                          assistant_policy=policy, spec_stats=stats, strict=True)
    return out, stats


@pytest.mark.parametrize("mode", ["right", "wrong"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_scripted_cross_tokenizer_drafts_are_identical_to_stock(pair, mode, policy):
    target, target_tok, _, draft_tok = pair
    ids, mask = prompts(target_tok, 3)
    reference = stock_greedy(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    oracle = TextOracle(target_tok, draft_tok, reference, mask, mode)
    drafter = CrossTokenizerDrafter(ScriptedDrafter(oracle), draft_tok, target_tok)
    out, stats = run(target, ids, mask, drafter, FixedLength(4) if policy == "fixed" else Adaptive())
    assert torch.equal(out, reference) and stats.fallback is None
    if mode == "wrong":
        assert stats.accepted == 0
    elif policy == "fixed":      # a character-level target: the draft's right text is the target's right tokens
        assert stats.drafted > 30 and stats.accepted >= 0.8 * stats.drafted


def test_eos_inside_a_cross_tokenizer_draft(pair):
    """The target's answer holds its EOS: the right draft's text carries it, the target's tokenizer turns it into
    the EOS id mid-proposal, and each row stops there as stock does."""
    target, target_tok, _, draft_tok = pair
    ids, mask = prompts(target_tok, 3, skip=2)
    free = stock_greedy(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 6])            # a token row 0 generates: stock stops there
    reference = stock_greedy(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    oracle = TextOracle(target_tok, draft_tok, free, mask, "right")
    drafter = CrossTokenizerDrafter(ScriptedDrafter(oracle), draft_tok, target_tok)
    out, stats = run(target, ids, mask, drafter, FixedLength(5), eos=eos)
    assert torch.equal(out, reference) and stats.accepted > 0


@pytest.mark.parametrize("target_kind", ["chars", "metaspace", "bytelevel"])
def test_a_draft_model_with_another_tokenizer_is_identical_to_stock(target_kind):
    target_tok = TOKENIZERS[target_kind]()
    draft_tok = bpe_tokenizer("bytelevel" if target_kind != "bytelevel" else "metaspace", 300)
    target = tiny_model("llama", seed=3, vocab=len(target_tok))
    draft = tiny_model("gpt2", seed=4, vocab=len(draft_tok), layers=1)
    ids, mask = prompts(target_tok, 3, skip=4)
    reference = stock_greedy(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    for policy in (FixedLength(3), Adaptive()):
        out, stats = run(target, ids, mask, CrossTokenizerDrafter(draft, draft_tok, target_tok, None), policy)
        assert torch.equal(out, reference) and stats.fallback is None
    assert stats.drafted > 0


def test_chain_with_a_cross_tokenizer_first_level(pair):
    """ChainDrafter([cross-tokenizer draft, a model sharing the target's tokenizer]): identical to stock."""
    target, target_tok, _, draft_tok = pair
    ids, mask = prompts(target_tok, 3, skip=1)
    reference = stock_greedy(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    oracle = TextOracle(target_tok, draft_tok, reference, mask, "right")
    middle = tiny_model("llama", seed=11, vocab=len(target_tok))       # the target's twin: accepts what it would
    chain = ChainDrafter([CrossTokenizerDrafter(ScriptedDrafter(oracle), draft_tok, target_tok), middle])
    out, stats = run(target, ids, mask, chain, FixedLength(4))
    assert torch.equal(out, reference) and stats.accepted > 0


def test_enable_builds_the_drafter_from_stocks_tokenizer_arguments(pair):
    target, target_tok, draft, draft_tok = pair
    draft = copy.deepcopy(draft)
    with torch.no_grad():      # confident enough to pass the default 0.4 confidence exit
        draft.get_output_embeddings().weight.mul_(10.0)
    ids, mask = prompts(target_tok, 2)
    reference = stock_greedy(target, ids, mask, max_new_tokens=12, eos_token_id=None)
    spec_adapt.enable(target)
    try:
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                              eos_token_id=None, max_new_tokens=12, assistant_model=draft, tokenizer=target_tok,
                              assistant_tokenizer=draft_tok)
        assert torch.equal(out, reference) and spec_adapt.last_stats().drafted > 0
        with pytest.raises(ValueError, match="tokenizer="):
            target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=draft,
                            assistant_tokenizer=draft_tok)
    finally:
        spec_adapt.disable(target)


def test_prompt_lookup_beside_a_draft_with_another_tokenizer_drafts_from_both(pair):
    """`assistant_model=` and `assistant_tokenizer=` with `prompt_lookup_num_tokens`: the several-source drafter,
    whose model source is the cross-tokenizer draft and whose lookup copies the target's own tokens. On prompts that
    end in the target's own looping answer, prompt lookup's offers are taken; the output is stock's greedy."""
    from spec_adapt.drafters.sources import MultiSourceDrafter

    target, target_tok, draft, draft_tok = pair
    ids, mask = prompts(target_tok, 2)
    ids = stock_greedy(target, ids, mask, max_new_tokens=16, eos_token_id=None)       # answers that loop
    mask = torch.cat([mask, torch.ones(len(ids), 16, dtype=torch.long)], dim=1)
    reference = stock_greedy(target, ids, mask, max_new_tokens=16, eos_token_id=None)
    built = []
    init = MultiSourceDrafter.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    spec_adapt.enable(target)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(MultiSourceDrafter, "__init__", keep)
            stats = spec_adapt.SpecStats()
            out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                                  eos_token_id=None, max_new_tokens=16, assistant_model=draft, tokenizer=target_tok,
                                  assistant_tokenizer=draft_tok, prompt_lookup_num_tokens=4, spec_stats=stats)
    finally:
        spec_adapt.disable(target)
    assert torch.equal(out, reference) and stats.fallback is None
    assert isinstance(built[-1].model_drafter, CrossTokenizerDrafter)
    assert stats.per_source.get("lookup", {}).get("drafted", 0) > 0, stats.per_source


def test_boundaries_refuse_mismatched_tokenizers(pair):
    target, target_tok, draft, draft_tok = pair
    ids, mask = prompts(target_tok, 1)
    with pytest.raises(TypeError, match="draft_tokenizer"):
        CrossTokenizerDrafter(draft, "gpt2", target_tok)
    with pytest.raises(ValueError, match="target's own tokenizer"):      # a tokenizer bigger than the head
        run(target, ids, mask, CrossTokenizerDrafter(draft, draft_tok, bpe_tokenizer("bytelevel", 420)), FixedLength(2))
    with pytest.raises(ValueError, match="draft's own tokenizer"):
        run(target, ids, mask, CrossTokenizerDrafter(draft, bpe_tokenizer("bytelevel", 500), target_tok),
            FixedLength(2))


# Stock's tokenizer arguments through custom_generate --------------------------------------------------------------

def test_custom_generate_takes_stocks_tokenizer_arguments(pair):
    """`custom_generate=spec_adapt.generate` with `tokenizer=` and `assistant_tokenizer=`: the draft (in the draft
    tokenizer's ids) is wrapped in a CrossTokenizerDrafter, as after `enable`, and never verified as target ids."""
    target, target_tok, _, draft_tok = pair
    ids, mask = prompts(target_tok, 3)
    reference = stock_greedy(target, ids, mask, max_new_tokens=30, eos_token_id=None)
    oracle = TextOracle(target_tok, draft_tok, reference, mask, "right")
    stats = spec_adapt.SpecStats()
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                          max_new_tokens=30, custom_generate=spec_adapt.generate, drafter=ScriptedDrafter(oracle),
                          tokenizer=target_tok, assistant_tokenizer=draft_tok, assistant_policy=FixedLength(4),
                          spec_stats=stats, strict=True)
    assert torch.equal(out, reference) and stats.fallback is None
    assert stats.drafted > 30 and stats.accepted >= 0.8 * stats.drafted
    with pytest.raises(ValueError, match="tokenizer="):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=spec_adapt.generate,
                        drafter=ScriptedDrafter(oracle), assistant_tokenizer=draft_tok)


@pytest.mark.parametrize("entry", ["custom_generate", "enable"])
def test_the_users_confidence_threshold_reaches_a_cross_tokenizer_draft(pair, entry):
    """assistant_confidence_threshold=1.0 stops every row before its first draft token (no draft is that sure);
    stock's default (0.4) lets this confident draft draft."""
    target, target_tok, draft, draft_tok = pair
    draft = copy.deepcopy(draft)
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(10.0)
    ids, mask = prompts(target_tok, 2)
    reference = stock_greedy(target, ids, mask, max_new_tokens=12, eos_token_id=None)
    # A fixed width, not the clock-driven default policy: whether a row drafts depends on the threshold alone.
    common = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                  max_new_tokens=12, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                  assistant_policy=FixedLength(3))
    if entry == "enable":
        spec_adapt.enable(target)
        common["assistant_model"] = draft
    else:
        common.update(custom_generate=spec_adapt.generate, drafter=draft)
    try:
        for threshold, drafts in ((None, True), (1.0, False)):
            given = {} if threshold is None else {"assistant_confidence_threshold": threshold}
            out = target.generate(**common, **given)
            stats = spec_adapt.last_stats()
            assert torch.equal(out, reference) and (stats.drafted > 0) == drafts, (threshold, stats.drafted)
    finally:
        spec_adapt.disable(target)


@pytest.mark.parametrize("entry", ["custom_generate", "enable"])
def test_stop_strings_with_a_tokenizer_are_stocks(pair, entry):
    """`stop_strings=` with `tokenizer=` stop each row where stock stops it, through either entry point."""
    target, target_tok, _, draft_tok = pair
    ids, mask = prompts(target_tok, 3)
    common = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=EOS,
                  max_new_tokens=30)       # with an EOS id, stock pads a row a stop string stopped
    free = target.generate(**common)
    generated = free[0, ids.shape[1]:].tolist()
    for start in range(2, 12):                                  # a plain text row 0 reaches early, that stops it
        stop = TextBridge.text(target_tok, generated, start, start + 2)
        reference = target.generate(**common, stop_strings=[stop], tokenizer=target_tok)
        if "<" not in stop and not torch.equal(reference, free):
            break
    assert not torch.equal(reference, free)
    oracle = TextOracle(target_tok, draft_tok, free, mask, "right")
    drafted = dict(assistant_tokenizer=draft_tok, assistant_policy=FixedLength(3))
    if entry == "enable":
        spec_adapt.enable(target)
        drafted["assistant_model"] = ScriptedDrafter(oracle)
    else:
        drafted.update(custom_generate=spec_adapt.generate, drafter=ScriptedDrafter(oracle))
    try:
        out = target.generate(**common, **drafted, stop_strings=[stop], tokenizer=target_tok)
        assert torch.equal(out, reference) and spec_adapt.last_stats().accepted > 0
    finally:
        spec_adapt.disable(target)
