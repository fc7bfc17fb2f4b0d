"""Depth decided inside the step: a calibration of the draft's confidence against acceptance, the StopRule a policy
plans from its cost model, and a draft model that stops each row where the rule says (ragged depths, lossless)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import spec_adapt
from spec_adapt import Adaptive, FixedLength, ModelDrafter
from spec_adapt.running_estimates import Calibration, StopRule
from spec_adapt.stopping import Stopper
from spec_adapt.policies.policy import Plan, StepInfo

from conftest import PAD, cached_model, ragged_batch, stock_greedy

HALF = 0.5     # the synthetic draft is overconfident: a token of confidence q is accepted with probability q / 2


def overconfident_calibration(steps: int = 4000, seed: int = 0) -> Calibration:
    """A Calibration fed chains of a draft whose tokens are accepted with probability HALF x their confidence."""
    gen = torch.Generator().manual_seed(seed)
    calibration = Calibration()
    for _ in range(steps // 100):
        confidence = 0.2 + 0.8 * torch.rand(100, 4, generator=gen)
        hits = torch.rand(100, 4, generator=gen) < HALF * confidence
        accepted = hits.long().cumprod(dim=1).sum(dim=1)              # the run of acceptances before the first miss
        calibration.update(confidence, torch.full((100,), 4), accepted)
    return calibration


def right_depth(confidence: torch.Tensor, threshold: float) -> list[int]:
    """Analytically: the deepest k whose survival, the product of the true acceptances of the first k drafts, is at
    least the threshold (one more draft token pays exactly while its survival beats what its time costs)."""
    survival = torch.cumprod(HALF * confidence, dim=1)
    return (survival >= threshold).long().cumprod(dim=1).sum(dim=1).tolist()


def test_the_rule_picks_the_depth_the_cost_model_and_true_acceptance_give():
    # A step at batch 4 whose goodput is 40 tokens/s, where one more position costs 5 ms: a draft token pays when its
    # survival exceeds 40 x 0.005 / 4 = 0.05 tokens per row.
    threshold = 40 * 0.005 / 4
    confidence = torch.tensor([[0.9] * 8, [0.95, 0.6, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9],
                               [0.5] * 8, [0.99, 0.99, 0.3, 0.99, 0.99, 0.99, 0.99, 0.99]])
    rule = StopRule(threshold, overconfident_calibration())
    picked, right = rule.depths(confidence).tolist(), right_depth(confidence, threshold)
    assert all(abs(p - r) <= 1 for p, r in zip(picked, right)), (picked, right)


def test_without_calibration_the_rule_drafts_too_deep():
    """The mutation check: the same rule reading the draft's confidence as its acceptance (an untrained
    calibration) goes past the right depth by more than a token on the overconfident draft."""
    threshold = 40 * 0.005 / 4
    confidence = torch.tensor([[0.9] * 8, [0.5] * 8])
    picked = StopRule(threshold, Calibration()).depths(confidence).tolist()
    right = right_depth(confidence, threshold)
    assert all(p > r + 1 for p, r in zip(picked, right)), (picked, right)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=8), st.lists(st.floats(0, 1), min_size=1, max_size=8))
def test_the_calibration_is_a_probability_that_reads_only_reached_tokens(confidences, outcomes):
    calibration = Calibration(bins=5)
    width = min(len(confidences), len(outcomes))
    confidence = torch.tensor([confidences[:width]])
    accepted = sum(1 for _ in __import__("itertools").takewhile(lambda x: x > 0.5, outcomes[:width]))
    before = calibration.reached.clone()
    calibration.update(confidence, [width], [accepted])
    reached = min(width, accepted + 1)
    assert float((calibration.reached - before).sum()) == reached
    values = calibration(torch.linspace(0, 1, 11))
    assert bool(((values >= 0) & (values <= 1)).all())


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.3", [], [0.2, 2.0], [0.1] * 2000, [True],
                                 (0.1, None)])
def test_a_stop_rule_refuses_a_threshold_that_is_not_a_probability(bad):
    with pytest.raises(ValueError, match="threshold"):
        StopRule(bad, Calibration())


@pytest.mark.parametrize("bins, prior", [(0, 4.0), (10, 0.0), (True, 4.0), (10, math.inf)])
def test_a_calibration_refuses_absurd_sizes(bins, prior):
    with pytest.raises(ValueError, match="Calibration"):
        Calibration(bins, prior)


class Ruled(FixedLength):
    """FixedLength(k) plus a stop rule: rows stop where their survival under `calibration` drops below `threshold`."""

    def __init__(self, k, threshold, calibration=None):
        super().__init__(k)
        self.rule = StopRule(threshold, calibration or Calibration())
        self.records = []

    def choose(self, info: StepInfo):
        return Plan(super().choose(info), stop=self.rule)

    def observe(self, record):
        self.records.append(record)


@pytest.mark.parametrize("sampling", [False, True])
def test_rows_stop_at_their_own_depth_and_the_output_is_the_targets(sampling):
    target, draft = cached_model("llama"), cached_model("llama", seed=1)
    ids, mask = ragged_batch(4, seed=3)
    policy = Ruled(6, 0.003)      # a random tiny draft is unsure of itself: survivals of 0.1-0.3 per token
    kwargs = dict(do_sample=sampling, max_new_tokens=20, pad_token_id=PAD, eos_token_id=None)
    torch.manual_seed(0)
    out = target.generate(input_ids=ids, attention_mask=mask, custom_generate=spec_adapt.generate,
                          drafter=ModelDrafter(draft), assistant_policy=policy, **kwargs)
    if not sampling:
        assert torch.equal(out, stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=20))
    ragged = [r for r in policy.records if max(r.gammas) == 6 and len(set(r.drafted)) > 1 and 0 < min(r.drafted)]
    assert ragged, "no step where rows that asked for the same width drafted different depths"
    assert all(r.confidence is not None and r.confidence.shape[1] == max(r.drafted) for r in policy.records
               if max(r.drafted))


def test_the_default_policy_with_the_rule_plans_its_threshold_from_the_cost_model_and_learns():
    target, draft = cached_model("llama"), cached_model("llama", seed=1)
    ids, mask = ragged_batch(3, seed=4)
    policy = Adaptive(stop_rule=True)
    plans = []
    choose = policy.choose

    def spy(info):
        plan = choose(info)
        plans.append((plan, dict(policy._pending)))
        return plan

    policy.choose = spy
    for _ in range(3):
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD,
                              eos_token_id=None, custom_generate=spec_adapt.generate, drafter=ModelDrafter(draft),
                              assistant_policy=policy)
        assert torch.equal(out, stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=24))
    ruled = [plan for plan, pending in plans if isinstance(plan, Plan) and plan.stop is not None]
    assert ruled and all(pending["width"] > 0 for plan, pending in plans if isinstance(plan, Plan))
    assert all(0 <= t <= 1 for plan in ruled for t in plan.stop.thresholds)
    assert float(policy.calibration.reached.sum()) > Calibration().reached.sum()    # it learned from the steps


def test_a_steep_line_through_wide_steps_never_predicts_a_negative_step_or_threshold():
    """Drafting steps measured only at wide depths (7 and 8, as a stop rule's steps cluster) with a steep slope put
    the line below zero at narrow widths. A step costs at least a plain one, so every predicted time stays positive,
    and a probe planned from them carries a threshold in [0, 1] (a negative one used to raise inside the call)."""
    from spec_adapt.policies.estimators import LineFit

    policy = Adaptive(stop_rule=True, probe_every=1, max_probe_gap=1)
    fit = policy.cost.lines[("full", 1)] = LineFit()
    for _ in range(4):
        fit.add(7, 0.5)
        fit.add(8, 1.0)
    assert fit(1) < 0                                   # what the line says at width 1
    for _ in range(5):
        policy.cost.observe_verify(1, 1, 0.2)
    assert all(policy.step_time(1, s) >= 0.2 for s in range(policy.max_gamma + 1))
    info = StepInfo(1, torch.tensor([0]), torch.tensor([5]), torch.tensor([40]), 3, draft_lag=torch.tensor([1]),
                    closed=True)
    for _ in range(4):
        plan = policy.choose(info)
        if isinstance(plan, Plan) and plan.stop is not None:
            assert all(0 <= t <= 1 for t in plan.stop.thresholds)


def _ruled_plan(policy, batch=1):
    info = StepInfo(batch, torch.arange(batch), torch.full((batch,), 5), torch.full((batch,), 40), 3,
                    draft_lag=torch.ones(batch, dtype=torch.long), closed=True)
    return policy.choose(info)


def test_the_threshold_is_the_goodput_the_rule_reached_times_the_time_per_drafted_token():
    """G x dT / B: dT the slope of the line through drafting steps (here 0.05 s per drafted token), G the tokens per
    second the rule's own steps committed (here 8 per 0.5 s), not the counts' prediction, which the rule's
    selective drafting makes optimistic: a threshold set too high lowers the goodput and the next threshold."""
    from spec_adapt.metrics import StepRecord

    policy = Adaptive(explore=0.0, stop_rule=True)
    for _ in range(5):
        policy.cost.observe_verify(1, 1, 0.25)
    policy.calibration.update(torch.full((1, 2), 0.9), [2], [2])      # the drafter has reported its confidence
    for depth in (2, 4, 6, 2, 4, 6):
        plan = _ruled_plan(policy)
        assert isinstance(plan, Plan) and plan.stop is not None and int(plan.gammas.max()) == policy.max_gamma
        accepted = depth - 1
        policy.observe(StepRecord(1, [0], [policy.max_gamma], [depth], [accepted], [accepted + 1],
                                  0.3 + 0.05 * depth, 0.05 * depth, 0.3, confidence=torch.full((1, depth), 0.9)))
    goodput = None
    for depth in (2, 4, 6, 2, 4, 6):          # the EMA (weight 0.1) of each step's committed tokens per second
        rate = depth / (0.3 + 0.05 * depth)
        goodput = rate if goodput is None else 0.9 * goodput + 0.1 * rate
    assert policy.goodput[1] == pytest.approx(goodput)
    assert _ruled_plan(policy).stop.thresholds == pytest.approx((goodput * 0.05,), rel=1e-6)


def test_a_row_always_drafts_its_first_token():
    """The rule never declines a row's first token, whatever its survival: the calibration learns only from drafted
    tokens, and whether to draft at all is the policy's decision."""
    rule = StopRule([0.9], Calibration())
    assert rule.depths(torch.tensor([[0.01, 0.99], [0.99, 0.99]])).tolist() == [1, 2]
    assert rule.depths(torch.zeros(2, 0)).tolist() == [0, 0]


def test_an_unsure_draft_that_is_right_learns_to_draft_deep():
    """The target as its own draft, on a tiny random model: every token is accepted, at a confidence of ~0.05 (a flat
    distribution). The calibration learns only from drafted tokens; every asked row drafts at least its first, so
    it learns that low confidence is accepted here, and rows go on to draft several tokens."""
    target = cached_model("llama")
    ids, mask = ragged_batch(3, seed=4)
    policy = Adaptive(explore=0.0, stop_rule=True)
    for _ in range(2):
        stats = spec_adapt.SpecStats()
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD,
                              eos_token_id=None, custom_generate=spec_adapt.generate,
                              drafter=spec_adapt.ModelDrafter(target),     # the draft model alone, its state fresh
                              assistant_policy=policy, spec_stats=stats)
        assert torch.equal(out, stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=24))
        if any(r.confidence is not None and r.confidence.shape[1] for r in stats.trace):
            break
    confidences = torch.cat([r.confidence.flatten() for r in stats.trace if r.confidence is not None])
    assert float(confidences.max()) < 0.2                               # the draft is unsure of every token
    assert policy.calibration(torch.tensor([0.05])).item() > 0.5        # and learned that it is right anyway
    assert max(max(r.drafted) for r in stats.trace) > 2


def test_a_drafter_without_confidences_keeps_width_plans():
    """Prompt lookup reports no probabilities: the default policy plans widths for it, never a stop rule, so its
    rows draft the width the cost model chose (a rule would have nothing to read and the width would be max_gamma)."""
    target = cached_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    policy = Adaptive(stop_rule=True)
    plans = []
    choose = policy.choose

    def spy(info):
        plans.append(choose(info))
        return plans[-1]

    policy.choose = spy
    target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                    pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate,
                    drafter=spec_adapt.PromptLookupDrafter(), assistant_policy=policy)
    assert plans and not any(isinstance(p, Plan) for p in plans) and not policy.confident


def test_a_row_the_rule_stops_proposes_its_last_token_without_another_draft_forward():
    """The rule stops a row after its first token here (a threshold of 1 at the second position): the draft runs
    one forward per step (its catch-up, which yields the first token's logits) and proposes that token; feeding
    the token to read the next one's confidence would cost a second forward for a token never proposed."""
    target, draft = cached_model("llama"), cached_model("llama", seed=1)
    ids, mask = ragged_batch(2, seed=5)
    forwards = []
    hook = draft.register_forward_hook(lambda *args: forwards.append(1))
    policy = Ruled(4, [0.0, 1.0])
    try:
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                              pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate,
                              drafter=ModelDrafter(draft), assistant_policy=policy)
    finally:
        hook.remove()
    assert torch.equal(out, stock_greedy(target, ids, mask, eos_token_id=None, max_new_tokens=12))
    drafting = [r for r in policy.records if max(r.drafted)]
    assert drafting and all(max(r.drafted) == 1 for r in drafting)
    assert len(forwards) == len(drafting)


def _write_case(data, most_width: int):
    """Rows, lengths, limits, counts (0 where a verifier kept no position), EOS ids and a buffer as the loop hands them
    to `Stopper`: a row's length is at most its limit, and the buffer holds the step's whole block past every row's
    length (`Rows.reserve`), at its limit too."""
    batch, length = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 6))
    width = data.draw(st.integers(1, most_width))
    held = data.draw(st.integers(batch, batch + 3))
    rows = torch.tensor(data.draw(st.permutations(range(held)))[:batch])
    old = torch.tensor([data.draw(st.integers(0, length)) for _ in range(batch)])
    limits = torch.tensor([data.draw(st.integers(int(o), length)) for o in old])
    new = torch.tensor([[data.draw(st.integers(0, 9)) for _ in range(width)] for _ in range(batch)])
    n = torch.minimum(torch.tensor([data.draw(st.integers(0, width)) for _ in range(batch)]), limits - old)
    eos = data.draw(st.sampled_from([None, [3], [3, 7]]))
    seed = data.draw(st.integers(0, 99))
    buffer = torch.randint(10, 20, (held, length + width), generator=torch.Generator().manual_seed(seed))
    stopper = Stopper([], length, "cpu")
    stopper.eos = torch.tensor(eos) if eos is not None else None
    return stopper, buffer, rows, old, new, n, limits


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_block_write_writes_each_rows_kept_tokens_and_nothing_else(data):
    """`Stopper._write` writes a step's tokens as one [B, W] block: row b gets new[b, :k] at old[b], k its count cut
    after the first EOS, and every other buffer entry (columns past k, rows not in the step) is unchanged; a row
    finishes at an EOS or at its limit. Checked against a row-by-row reference."""
    stopper, buffer, rows, old, new, n, limits = _write_case(data, 6)
    want = buffer.clone()
    eos = stopper.eos.tolist() if stopper.eos is not None else []
    kept, done = [], []
    for b, row in enumerate(rows.tolist()):
        hits = [j for j in range(int(n[b])) if int(new[b, j]) in eos]
        k = hits[0] + 1 if hits else int(n[b])
        want[row, int(old[b]): int(old[b]) + k] = new[b, :k]
        kept.append(k)
        done.append(bool(hits) or int(old[b]) + k >= int(limits[b]))
    got_n, got_finished = stopper._write(buffer, rows, old, new, n.clone(), limits)
    assert torch.equal(buffer, want)
    assert got_n.tolist() == kept and got_finished.tolist() == done


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_one_token_write_is_the_general_write(data):
    """A step without drafts writes one token a row through `Stopper._write_one`; whatever the rows, lengths, limits,
    counts (0 where a verifier kept no position) and EOS ids, it writes and stops exactly as the general `_write`."""
    stopper, buffer, rows, old, new, n, limits = _write_case(data, 1)
    mine, theirs = buffer.clone(), buffer.clone()
    got = stopper._write_one(mine, rows, old, new, n.clone(), limits)
    want = stopper._write(theirs, rows, old, new, n.clone(), limits)
    assert torch.equal(mine, theirs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
