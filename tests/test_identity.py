"""Greedy identity: spec_adapt output equals stock `model.generate` greedy output, token for token.

Scripted drafts make every acceptance pattern reachable (always right, always wrong, right for exactly j tokens,
different per row), and each case also checks that the acceptance the loop reports is exactly the scripted one,
so a drafter that silently fell back to plain decoding cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import spec_adapt
from spec_adapt import FixedLength, ModelDrafter
from spec_adapt.policies import Heuristic

from conftest import EOS, PAD, VOCAB, Collect, Oracle, SpareRows, cached_model, ragged_batch, stock_greedy, tiny_model

MODES = {"right": ["right"], "wrong": ["wrong"], "j2": [2], "mixed": ["right", "wrong", 1, 3, 0]}


def run_spec(model, ids, mask, drafter, policy, entry="custom", **kw):
    kw.setdefault("max_new_tokens", 24)
    stats = spec_adapt.SpecStats()
    if entry == "custom":
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                             custom_generate=spec_adapt.generate, drafter=drafter, assistant_policy=policy,
                             spec_stats=stats, **kw)
    else:
        spec_adapt.enable(model)
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                                 assistant_model=drafter, assistant_policy=policy, spec_stats=stats, **kw)
        finally:
            spec_adapt.disable(model)
    return out, stats


def assert_scripted_acceptance(stats, oracle):
    assert stats.fallback is None
    for rec in stats.trace:
        for row, drafted, accepted in zip(rec.rows, rec.drafted, rec.accepted):
            assert accepted == oracle.expected_accepted(row, drafted), (row, drafted, accepted)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch", [1, 2, 5, 8])
@pytest.mark.parametrize("gamma", [0, 1, 3, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_identity_scripted(arch, batch, gamma, mode):
    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=batch)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    oracle = Oracle(reference, mask, MODES[mode])
    entry = "custom" if (gamma + batch) % 2 else "enable"
    out, stats = run_spec(model, ids, mask, oracle.drafter(), FixedLength(gamma), entry=entry, eos_token_id=None)
    assert torch.equal(out, reference)
    assert_scripted_acceptance(stats, oracle)
    if gamma:
        assert stats.drafted > 0
    else:
        assert stats.drafted == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_eos_mid_batch(arch, batch):
    """Rows stop at EOS at different steps; finished rows are padded exactly like stock generate pads them."""
    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=10 + batch)
    free = stock_greedy(model, ids, mask, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 4])   # row 0 emits this token at its 5th step: make it the EOS
    reference = stock_greedy(model, ids, mask, eos_token_id=eos)
    oracle = Oracle(reference, mask, MODES["mixed"], eos=(eos,))
    out, stats = run_spec(model, ids, mask, oracle.drafter(), FixedLength(3), eos_token_id=eos)
    assert torch.equal(out, reference)
    assert_scripted_acceptance(stats, oracle)
    assert min(stats.per_row_new_tokens) < max(stats.per_row_new_tokens) or batch == 1
    assert [r.batch_size for r in stats.trace] == sorted((r.batch_size for r in stats.trace), reverse=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("draft", ["scripted", "model"])
def test_spare_rows_keep_identity(arch, draft):
    """Rows that finish stay in the target's batch as spare rows (the policy asks for all of them): the live rows'
    tokens equal stock generate's, the forward keeps the first shape, the spares' outputs never reach the buffer."""
    model = cached_model(arch)
    ids, mask = ragged_batch(6, seed=20)
    free = stock_greedy(model, ids, mask, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 3])
    reference = stock_greedy(model, ids, mask, eos_token_id=eos)
    oracle = Oracle(reference, mask, MODES["mixed"], eos=(eos,))
    drafter = oracle.drafter() if draft == "scripted" else tiny_model(arch, seed=7, layers=1)
    out, stats = run_spec(model, ids, mask, drafter, SpareRows(3), eos_token_id=eos)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0
    if draft == "scripted":
        assert_scripted_acceptance(stats, oracle)
    assert min(r.batch_size for r in stats.trace) < 6            # rows did leave ...
    assert {r.held for r in stats.trace} == {6}                  # ... and the target kept running 6 rows


def test_a_malformed_batch_rows_answer_is_refused(llama):
    class Bad(FixedLength):
        def batch_rows(self, live, held):
            return held + 1

    ids, mask = ragged_batch(4, seed=21)
    free = stock_greedy(llama, ids, mask, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 2])
    with pytest.raises(ValueError, match=r"Bad.batch_rows\(\d, 4\) returned 5; expected an int from \d"):
        run_spec(llama, ids, mask, None, Bad(2), eos_token_id=eos)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("mode", ["right", "mixed"])
def test_heuristic_policy(arch, batch, mode):
    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=3)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    oracle = Oracle(reference, mask, MODES[mode])
    out, stats = run_spec(model, ids, mask, oracle.drafter(), Heuristic(initial=2), max_new_tokens=40,
                          eos_token_id=None)
    assert torch.equal(out, reference)
    assert_scripted_acceptance(stats, oracle)
    if mode == "right":   # all accepted: +2 per step
        assert max(max(r.gammas) for r in stats.trace) > 2


def test_eos_several_ids_and_min_new_tokens(llama):
    ids, mask = ragged_batch(4, seed=5)
    free = stock_greedy(llama, ids, mask, eos_token_id=None)
    eos = [int(free[0, ids.shape[1] + 2]), int(free[1, ids.shape[1] + 6])]
    kw = dict(eos_token_id=eos, min_new_tokens=4)
    reference = stock_greedy(llama, ids, mask, **kw)
    oracle = Oracle(reference, mask, MODES["mixed"], eos=eos)
    out, _ = run_spec(llama, ids, mask, oracle.drafter(), FixedLength(4), **kw)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("processors", [
    dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2), dict(suppress_tokens=[5, 6, 7]),
])
def test_logits_processors_position_by_position(llama, processors):
    ids, mask = ragged_batch(5, seed=6)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None, **processors)
    oracle = Oracle(reference, mask, MODES["mixed"])
    out, stats = run_spec(llama, ids, mask, oracle.drafter(), FixedLength(3), eos_token_id=None, **processors)
    assert torch.equal(out, reference)
    assert_scripted_acceptance(stats, oracle)


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria(llama):
    ids, mask = ragged_batch(4, seed=7)
    free = stock_greedy(llama, ids, mask, eos_token_id=None)
    token = int(free[2, ids.shape[1] + 3])
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    reference = stock_greedy(llama, ids, mask, eos_token_id=EOS, stopping_criteria=criteria)
    oracle = Oracle(reference, mask, MODES["right"], eos=(EOS, token))
    out, _ = run_spec(llama, ids, mask, oracle.drafter(), FixedLength(5), eos_token_id=EOS,
                      stopping_criteria=StoppingCriteriaList([StopAfterToken(token)]))
    assert torch.equal(out, reference)


class StopRowsAfter(StoppingCriteria):
    """Stops the row whose prompt ends with token t once it has after[t] new tokens (a criterion that knows rows by
    their tokens, as spec_adapt asks it one row at a time)."""

    def __init__(self, after: dict, prompt_length):
        self.after, self.prompt_length = after, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        new = input_ids.shape[1] - self.prompt_length
        return torch.tensor([new >= self.after.get(int(t), 10**6) for t in input_ids[:, self.prompt_length - 1]])


@pytest.mark.parametrize("modes", [["right", 2, "wrong"], ["right"], ["wrong"]])
@pytest.mark.parametrize("stop", ["token", "rows 3", "rows 20", "rows 3 5 12"])     # rows k0 k1 ..: row b after kb
def test_custom_stopping_criteria_without_eos_are_stocks(llama, modes, stop):
    """No EOS: stock pads finished rows only when it has an EOS, so a row a custom criterion stopped goes on writing
    its own tokens until every row has stopped (or max_length), and the call ends there. spec_adapt does the same,
    token for token, whatever the rows drafted past the stops."""
    ids, mask = ragged_batch(3, seed=7)
    free = stock_greedy(llama, ids, mask, eos_token_id=None)
    start = ids.shape[1]
    if stop == "token":
        criterion = StopAfterToken(int(free[1, start + 2]))
    else:      # the rows' prompts end with different tokens here
        after = [int(k) for k in stop.split()[1:]]
        criterion = StopRowsAfter({int(ids[b, -1]): k for b, k in enumerate(after)}, start)
    criteria = StoppingCriteriaList([criterion])
    reference = stock_greedy(llama, ids, mask, eos_token_id=None, stopping_criteria=criteria)
    oracle = Oracle(free, mask, modes)
    for batch in (3, 1):
        expected = reference if batch == 3 else stock_greedy(llama, ids[:1], mask[:1], eos_token_id=None,
                                                             stopping_criteria=criteria)
        out, stats = run_spec(llama, ids[:batch], mask[:batch], oracle.drafter(), FixedLength(3), eos_token_id=None,
                              stopping_criteria=criteria)
        assert torch.equal(out, expected), (batch, out, expected)
        assert stats.new_tokens == sum(stats.per_row_new_tokens) == (out.shape[1] - start) * batch
    if stop == "token":
        assert not bool((reference[1, start + 3:] == PAD).all())        # stock wrote on after row 1 stopped
    if stop == "rows 3 5 12":
        assert reference.shape[1] == start + 12


def test_scores_and_dict_output(llama):
    ids, mask = ragged_batch(3, seed=8)
    kw = dict(eos_token_id=None, return_dict_in_generate=True, output_scores=True, output_logits=True)
    reference = stock_greedy(llama, ids, mask, **kw)
    oracle = Oracle(reference.sequences, mask, MODES["mixed"])
    out, stats = run_spec(llama, ids, mask, oracle.drafter(), FixedLength(3), **kw)
    assert isinstance(out, spec_adapt.SpecGenerateOutput)
    assert out.spec_stats is stats
    assert torch.equal(out.sequences, reference.sequences)
    assert len(out.scores) == len(reference.scores)
    for ours, theirs in zip(out.scores, reference.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(out.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_streamer_receives_every_token(llama):
    ids, mask = ragged_batch(1, seed=9)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None)
    oracle = Oracle(reference, mask, [2])
    streamer = Collect()
    spec_adapt.enable(llama)
    try:
        out = llama.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                             eos_token_id=None, pad_token_id=PAD, assistant_model=oracle.drafter(),
                             assistant_policy=FixedLength(4), streamer=streamer)
    finally:
        spec_adapt.disable(llama)
    assert torch.equal(out, reference)
    assert streamer.tokens == reference[0].tolist() and streamer.ended


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_draft_model_same_weights_accepts_everything(arch):
    model = cached_model(arch)
    ids, mask = ragged_batch(5, seed=11)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    out, stats = run_spec(model, ids, mask, ModelDrafter(model), FixedLength(4), eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0 and stats.accepted == stats.drafted


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("policy", [FixedLength(3), Heuristic(initial=4)])
def test_draft_model_random_weights(arch, policy):
    model = cached_model(arch)
    draft = tiny_model(arch, seed=123, layers=1)
    ids, mask = ragged_batch(8, seed=12)
    reference = stock_greedy(model, ids, mask, eos_token_id=None)
    out, stats = run_spec(model, ids, mask, draft, policy, eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0 and stats.acceptance_rate < 0.5


def test_draft_with_padded_superset_vocabulary(llama):
    """A draft whose embedding matrix is rounded up past the target's vocabulary is sliced, not rejected."""
    draft = tiny_model("llama", seed=0, vocab=VOCAB + 32)
    with torch.no_grad():   # same weights on the shared part: it must accept everything
        for name, p in draft.named_parameters():
            q = dict(llama.named_parameters())[name]
            p.copy_(q if p.shape == q.shape else torch.cat([q, torch.full_like(p[q.shape[0]:], -1e3)]))
    ids, mask = ragged_batch(4, seed=13)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None)
    out, stats = run_spec(llama, ids, mask, ModelDrafter(draft), FixedLength(3), eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.accepted == stats.drafted > 0


def test_draft_in_other_dtype(llama):
    """The draft's inputs and outputs cross explicitly to and from its own device/dtype."""
    draft = tiny_model("llama", seed=0).to(torch.bfloat16)
    ids, mask = ragged_batch(4, seed=14)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None)
    out, stats = run_spec(llama, ids, mask, draft, FixedLength(3), eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.accepted > 0


def test_compaction_keeps_identity(llama, monkeypatch):
    """Force compaction after every rollback: moving valid entries must not change a single token."""
    from spec_adapt import ledger

    original = ledger.KVLedger.rollback

    def rollback_then_compact(self, keep_len, dropped=None):
        original(self, keep_len, dropped)
        self.compact()

    monkeypatch.setattr(ledger.KVLedger, "rollback", rollback_then_compact)
    ids, mask = ragged_batch(6, seed=15)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None, max_new_tokens=40)
    oracle = Oracle(reference, mask, MODES["mixed"])
    out, stats = run_spec(llama, ids, mask, oracle.drafter(), FixedLength(5), eos_token_id=None,
                          max_new_tokens=40)
    assert torch.equal(out, reference)
    assert stats.compactions >= stats.steps


def test_plain_generate_untouched_after_enable(llama):
    ids, mask = ragged_batch(3, seed=16)
    before = stock_greedy(llama, ids, mask, eos_token_id=None)
    spec_adapt.enable(llama)
    try:
        after = stock_greedy(llama, ids, mask, eos_token_id=None)
        assert "generate" in llama.__dict__
    finally:
        spec_adapt.disable(llama)
    assert "generate" not in llama.__dict__
    assert torch.equal(before, after)


def test_no_drafter_is_plain_decoding(llama):
    ids, mask = ragged_batch(5, seed=17)
    reference = stock_greedy(llama, ids, mask, eos_token_id=None)
    out, stats = run_spec(llama, ids, mask, None, FixedLength(3), eos_token_id=None)
    assert torch.equal(out, reference)
    assert stats.drafted == 0 and stats.steps == 23


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch", [1, 5, 8])
@pytest.mark.parametrize("policy", [FixedLength(4), Heuristic(initial=3)])
def test_prompt_lookup_identity(arch, batch, policy):
    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=20 + batch)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    out, stats = run_spec(model, ids, mask, spec_adapt.PromptLookupDrafter(), policy, eos_token_id=None,
                          max_new_tokens=40)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0 and stats.accepted > 0   # tiny models loop: lookup hits


def test_prompt_lookup_worked_example():
    from spec_adapt.drafters.lookup import lookup_continuation

    context = torch.tensor([5, 8, 3, 9, 4, 5, 8])
    assert lookup_continuation(context, 3, 2, 1).tolist() == [3, 9, 4]
    assert lookup_continuation(torch.tensor([1, 2, 3]), 3, 2, 1).tolist() == []
    # The most recent match wins: [7] occurs at 0 and 2; the one at 2 is followed by 6.
    assert lookup_continuation(torch.tensor([7, 5, 7, 6, 7]), 2, 1, 1).tolist() == [6, 7]
    # A copy that reaches the end goes on with what it copied: a run continues as a run, a cycle as a cycle.
    assert lookup_continuation(torch.tensor([4, 9, 9, 9, 9]), 3, 3, 1).tolist() == [9, 9, 9]
    assert lookup_continuation(torch.tensor([7, 1, 2, 1, 2]), 3, 2, 1).tolist() == [1, 2, 1]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_suffix_drafter_identity_and_memory_across_calls(arch, batch):
    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=30 + batch)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=40)
    drafter = spec_adapt.SuffixDrafter(index=spec_adapt.drafters.SuffixIndex(depth=6), min_share=0.0)
    first, stats1 = run_spec(model, ids, mask, drafter, Heuristic(initial=3), eos_token_id=None, max_new_tokens=40)
    second, stats2 = run_spec(model, ids, mask, drafter, Heuristic(initial=3), eos_token_id=None, max_new_tokens=40)
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert stats1.fallback is None and stats2.fallback is None and stats2.accepted > 0
    # The second call has the first call's outputs in its index: it drafts the same text and needs far fewer steps
    # (drafts that run past the end of what was seen are still rejected, as they should be).
    assert stats2.acceptance_rate > stats1.acceptance_rate
    assert stats2.steps < stats1.steps / 2


def test_suffix_index_defers_a_finished_call_until_it_is_read():
    """A call's text is indexed when the index is next read, not when the call ends: a call that never drafts
    again (or a fresh index per call) does not pay for it (85 ms per 32-row call on SmolLM2 at batch 32)."""
    a, b, c = 10, 11, 12
    index = spec_adapt.drafters.SuffixIndex(depth=2)
    drafter = spec_adapt.SuffixDrafter(index=index, min_share=0.0)
    tokens = torch.tensor([[0, a, b, c, a, b, c]])
    drafter.begin(tokens[:, :1], torch.ones(1, 1, dtype=torch.long))
    drafter.end(tokens, torch.tensor([7]))
    assert not index.next and index.pending                        # nothing indexed yet
    assert index.continuation([a, b], 2, min_share=0.0) == [c, a]  # a read indexes it first
    assert not index.pending
    eager = spec_adapt.drafters.SuffixIndex(depth=2)
    eager.add(tokens[0].tolist())
    assert index.next == eager.next


def test_suffix_index_worked_example():
    index = spec_adapt.drafters.SuffixIndex(depth=2)
    a, b, c, d = 10, 11, 12, 13
    index.add([a, b, c, a, b, d, a, b, c])
    assert index.continuation([99, a, b], 2, min_share=0.0) == [c, a]
    assert index.continuation([99, a, b], 2, min_share=0.7) == []      # c has only 2/3 of "a b"
    assert index.continuation([99, 98], 2, min_share=0.0) == []        # nothing known


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("make", ["prompt_lookup", "assisted"])
def test_transformers_candidate_generators_as_batched_drafters(arch, batch, make):
    """transformers' own CandidateGenerators (prompt lookup; the assistant model's, here with a perturbed copy of
    the target as its draft), one per row, under a policy: still exactly stock greedy."""
    from spec_adapt.tools.synthetic import perturbed_copy

    model = cached_model(arch)
    ids, mask = ragged_batch(batch, seed=40 + batch)
    reference = stock_greedy(model, ids, mask, eos_token_id=None, max_new_tokens=30)
    factory = getattr(spec_adapt.drafters.CandidateGeneratorDrafter, make)
    drafter = factory() if make == "prompt_lookup" else factory(perturbed_copy(model, 0.05, seed=3))
    out, stats = run_spec(model, ids, mask, drafter, Heuristic(initial=3), eos_token_id=None, max_new_tokens=30)
    assert torch.equal(out, reference)
    assert stats.fallback is None and stats.drafted > 0
    if make == "assisted":                      # a near copy of the target: most of its drafts are right
        assert stats.acceptance_rate > 0.5
