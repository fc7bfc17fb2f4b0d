"""Multi-token prediction (MTP) drafting: the MTP layers of a checkpoint draft from the target's own hidden states
(a feature drafter), batched, for every family in transformers whose checkpoints ship MTP layers."""

from __future__ import annotations

import functools

import pytest
import torch

import spec_adapt
from spec_adapt import EarlyExitVerifier, FixedLength, MTPDrafter, ScriptedDrafter, compat
from spec_adapt.drafters import MTPDrafter as ExportedMTPDrafter
from spec_adapt.model_kinds import UnsupportedCacheError

from mtp_models import FAMILIES, mtp_model
from test_sampling import follows_target

NEW = 12


@functools.lru_cache(maxsize=None)
def model_of(family: str, layers: int, seed: int = 0):
    return mtp_model(family, layers, seed=seed)


# Every family with MTP checkpoints that spec_adapt serves, with the most MTP layers its checkpoints have (GLM-4 MoE
# and DeepSeek-V3 chain two; the others one).
# Families with MTP checkpoints that cannot be served, and the refusal each meets at batch 1: Bailing hybrid's KDA
# layers make the model stateful, and stock refuses assisted generation (MTP included) for it, as spec_adapt does.
UNSERVED = {"bailing_hybrid": ("stock", ValueError, "assisted generation is not supported with stateful models")}
CASES = [(family, layers) for family, (_, layers) in FAMILIES.items() if family not in UNSERVED]


def ragged():
    """Three left-padded prompts of lengths 7, 5 and 3."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 3, 4, 5, 6, 7], [0, 0, 0, 0, 9, 12, 3]])
    mask = (torch.arange(7)[None, :] >= torch.tensor([[0], [2], [4]])).long()
    return ids, mask


def stock_rows(model, ids, mask, **kw):
    """Stock greedy generate, each row alone (no padding)."""
    return [model.generate(ids[b : b + 1, int((mask[b] == 0).sum()):], max_new_tokens=NEW, do_sample=False, **kw)[0]
            for b in range(len(ids))]


def assert_rows_equal(out, mask, references):
    for b, reference in enumerate(references):
        row = out[b, int((mask[b] == 0).sum()):]
        assert row.tolist()[: len(reference)] == reference.tolist(), f"row {b}"


@pytest.mark.parametrize("family,layers", CASES)
def test_greedy_matches_stock_per_row_and_the_layers_draft(family, layers):
    model = model_of(family, layers)
    ids, mask = ragged()
    references = stock_rows(model, ids, mask)
    # A plan deeper than the layers: each step drafts as many tokens as the checkpoint has layers (stock's depth).
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         custom_generate=spec_adapt.generate, drafter=MTPDrafter(model),
                         assistant_policy=FixedLength(layers + 1), strict=True)
    stats = spec_adapt.last_stats()
    assert_rows_equal(out, mask, references)
    assert stats.fallback is None and stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    assert max(max(r.drafted) for r in stats.trace) == layers
    one = model.generate(ids[:1], max_new_tokens=NEW, do_sample=False, custom_generate=spec_adapt.generate,
                         drafter=MTPDrafter(model), assistant_policy=FixedLength(layers), strict=True)
    assert one[0].tolist() == references[0].tolist() and spec_adapt.last_stats().drafted > 0


@pytest.mark.parametrize("family", list(UNSERVED))
def test_unserved_families_are_refused_by_name(family):
    who, error, message = UNSERVED[family]
    model = model_of(family, FAMILIES[family][1])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with pytest.raises(error, match=message):
        if who == "stock":
            model.generate(ids, max_new_tokens=NEW, do_sample=False, use_mtp=True)
        else:
            assert model.generate(ids, max_new_tokens=NEW, do_sample=False, use_mtp=True).shape[1] > ids.shape[1]
            model.generate(ids, max_new_tokens=NEW, do_sample=False, custom_generate=spec_adapt.generate,
                           drafter=MTPDrafter(model), assistant_policy=FixedLength(1), strict=True)


@pytest.mark.parametrize("family,layers", CASES[:1])
def test_use_mtp_after_enable_at_batch_3(family, layers):
    model = model_of(family, layers)
    ids, mask = ragged()
    references = stock_rows(model, ids, mask)
    stock_mtp = model.generate(ids[:1], max_new_tokens=NEW, do_sample=False, use_mtp=True)   # batch 1 only
    spec_adapt.enable(model)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_mtp=True)
        assert_rows_equal(out, mask, references)
        assert spec_adapt.last_stats().fallback is None and spec_adapt.last_stats().drafted > 0
        assert torch.equal(model.generate(ids[:1], max_new_tokens=NEW, do_sample=False, use_mtp=True), stock_mtp)
    finally:
        spec_adapt.disable(model)


class Recorded(MTPDrafter):
    """Records every proposal with the committed tokens it drafted from; compacts its cache after every rollback."""

    def begin(self, input_ids, attention_mask):
        super().begin(input_ids, attention_mask)
        self.seen, self.compactions = [], 0

    def rollback(self, keep_len):
        super().rollback(keep_len)
        self.ledger.compact()

    def propose(self, request):
        proposal = super().propose(request)
        self.seen.append((request.tokens.clone(), request.lengths.clone(), request.rows.clone(), proposal))
        return proposal

    def end(self, tokens=None, lengths=None):
        if self.ledger is not None:
            self.compactions = self.ledger.compactions
        super().end(tokens, lengths)


def early_stop(model, ids, mask) -> int:
    """A token to stop rows at (EOS) which some row generates after a few tokens and another row later or never."""
    generated = [row[int(m.sum()):].tolist() for row, m in zip(stock_rows(model, ids, mask), mask)]
    first = {t: [row.index(t) if t in row else NEW for row in generated] for t in set(sum(generated, []))}
    return next(t for t, at in sorted(first.items()) if min(at) >= 2 and max(at) >= min(at) + 3)


def stock_mtp_drafts(model, mtp, tokens: torch.Tensor, depth: int) -> list[int]:
    """What stock's MtpModel drafts after `tokens` (a row's committed tokens, no padding), with no cache: the
    target's hidden states of the whole row, then every MTP layer over all of it."""
    with torch.no_grad():
        hidden = model(tokens[None], output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(1, len(tokens))[None, :]
        drafts, _, _ = mtp(input_ids=tokens[None, 1:], last_hidden_states=hidden[:, :-1], attention_mask=None,
                           position_ids=positions, mtp_cache=None)
    return drafts[0, :depth].tolist()


# Inkling's MTP layer has short convolutions, which the layers' cache keeps per input column; seed 3 gives a tiny
# Inkling whose rows stop late enough (at seed 0 they stop after a few tokens) and whose drafts are rejected at times.
@pytest.mark.parametrize("family,layers,gamma,seed", [("glm4_moe", 2, 1, 0), ("glm4_moe", 2, 3, 0), ("mellum", 1, 1, 0),
                                                       ("inkling_text", 1, 1, 3)])
def test_batched_drafts_are_stock_mtp_drafts_of_each_row(family, layers, gamma, seed):
    """The cache the layers keep (rolled back after rejections, compacted, following rows that leave) drafts what
    stock's MTP layers draft from each row's committed tokens alone, recomputed from scratch."""
    model = model_of(family, layers, seed)
    ids, mask = ragged()
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, mask[:1]])
    eos = early_stop(model, ids, mask)
    drafter = Recorded(model)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, custom_generate=spec_adapt.generate, drafter=drafter,
                         assistant_policy=FixedLength(gamma), strict=True)
    assert_rows_equal(out, mask, stock_rows(model, ids, mask, eos_token_id=eos, pad_token_id=0))
    assert min(len(r.rows) for r in spec_adapt.last_stats().trace) < len(ids)      # rows left mid-call
    assert drafter.compactions > 0
    checked = 0
    for tokens, lengths, rows, proposal in drafter.seen:
        for b, user_row in enumerate(rows.tolist()):
            n = int(proposal.lengths[b])
            if n:
                row = tokens[b, int((mask[user_row] == 0).sum()) : int(lengths[b])]     # no left padding
                assert proposal.tokens[b, :n].tolist() == stock_mtp_drafts(model, drafter.mtp, row, n)
                checked += 1
    assert checked > 10


def test_sampling_follows_the_target_distribution():
    """Lossless sampling: the MTP layers propose from their own distribution q, the acceptor applies the rejection
    rule (tests/test_sampling.py's enumerated harness)."""
    target = mtp_model("glm4_moe", 2, seed=5, head_scale=0.3, follow=0.5)
    assert follows_target(target, MTPDrafter(target), 6000, policy=FixedLength(2)) is None


def test_the_target_keeps_hidden_states_only_for_a_drafter_that_wants_them():
    model = model_of("glm4_moe", 2)
    asked = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: asked.append(kw.get("output_hidden_states")),
                                           with_kwargs=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        for drafter in (ScriptedDrafter(lambda row, context, gamma: [3] * gamma), MTPDrafter(model)):
            asked.clear()
            model.generate(ids, max_new_tokens=4, do_sample=False, custom_generate=spec_adapt.generate,
                           drafter=drafter, assistant_policy=FixedLength(2), strict=True)
            assert asked and set(asked) == ({-1} if drafter.wants_hidden else {None})
    finally:
        hook.remove()


def test_refusals_are_named():
    model = model_of("glm4_moe", 2)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="FullVerifier"):
        model.generate(ids, max_new_tokens=3, custom_generate=spec_adapt.generate, drafter=MTPDrafter(model),
                       verifier=EarlyExitVerifier(layers=[0]))
    other = mtp_model("glm4_moe", 1, seed=3)
    with pytest.raises(ValueError, match="generate with that model"):
        model.generate(ids, max_new_tokens=3, custom_generate=spec_adapt.generate, drafter=MTPDrafter(other))
    spec_adapt.enable(model)
    try:
        with pytest.raises(ValueError, match="do not also pass"):
            model.generate(ids, max_new_tokens=3, use_mtp=True, assistant_model=other)
    finally:
        spec_adapt.disable(model)
    from conftest import tiny_model

    plain = spec_adapt.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match="num_mtp_layers"):
        plain.generate(ids, max_new_tokens=3, use_mtp=True)
    assert ExportedMTPDrafter is MTPDrafter and compat.mtp_layer_count(model) == 2


def test_the_serving_engine_drafts_for_requests_that_join_a_running_batch():
    """Rows joining a running batch get the MTP layers' cache rows and their prefill's hidden states: every
    request drafts with the layers and returns stock's tokens."""
    from conftest import drive_engine
    from spec_adapt import Engine

    model = model_of("glm4_moe", 2)
    ids, mask = ragged()
    prompts = [ids[b][mask[b].bool()] for b in range(len(ids))]
    budgets, arrivals = [NEW, NEW - 2, NEW - 4], [0, 2, 3]
    engine = Engine(model, drafter=MTPDrafter(model), assistant_policy=FixedLength(2), max_batch=3, pad_token_id=0,
                    eos_token_id=None)
    handles = drive_engine(engine, prompts, budgets, arrivals)
    assert engine.fallback is None
    for prompt, budget, handle in zip(prompts, budgets, handles):
        stock = model.generate(prompt[None], max_new_tokens=budget, do_sample=False)[0]
        assert handle.result() == stock[len(prompt):].tolist()
    assert engine.stats.drafted > 0 and engine.stats.accepted > 0
    assert max(r.batch_size for r in engine.stats.trace) == 3
    drafted = {slot: 0 for slot in range(3)}
    for record in engine.stats.trace:
        for slot, count in zip(record.rows, record.drafted):
            drafted[int(slot)] += int(count)
    assert all(drafted.values()), drafted                           # the joining requests drafted too


@pytest.mark.parametrize("weight", [0.5, 0.1])
def test_use_mtp_with_assistant_ensemble_weight_is_stocks(weight):
    """Stock's lossy ensemble verification with its MTP drafts (drafts judged against w * p_target + (1 - w) * q_mtp):
    the MTP layers draft here what stock's draft (`test_batched_drafts_are_stock_mtp_drafts_of_each_row`), so at
    stock's schedule (as many drafts a step as the layers) each row's tokens are stock's ensemble output for its
    prompt alone, at batch 1 and batch 3. `stats.lossy` says so."""
    model = model_of("glm4_moe", 2)
    ids, mask = ragged()
    pads = (mask == 0).sum(dim=1).tolist()
    stock = [model.generate(ids[b:b + 1, pads[b]:], max_new_tokens=NEW, do_sample=False, use_mtp=True,
                            assistant_ensemble_weight=weight)[0] for b in range(3)]
    plain = stock_rows(model, ids, mask)
    assert any(s.tolist() != p.tolist() for s, p in zip(stock, plain))     # the weight changes some row's tokens
    spec_adapt.enable(model, assistant_policy=FixedLength(2))
    try:
        for b in range(3):
            one = model.generate(ids[b:b + 1, pads[b]:], max_new_tokens=NEW, do_sample=False, use_mtp=True,
                                 assistant_ensemble_weight=weight)
            assert one[0].tolist() == stock[b].tolist(), b
            assert spec_adapt.last_stats().lossy == f"assistant_ensemble_weight={weight}"
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_mtp=True,
                             assistant_ensemble_weight=weight)
        assert_rows_equal(out, mask, stock)
        assert spec_adapt.last_stats().drafted > 0
    finally:
        spec_adapt.disable(model)
