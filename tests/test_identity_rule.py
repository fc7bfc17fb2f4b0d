"""The tie-aware lossless rule (spec_adapt.identity) on a target whose logits are set by hand: a bigram table, so
ties, clear preferences and greedy continuations are exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spec_adapt.identity import DIFFERS, IDENTICAL, TIE, assert_lossless, judge, rescore, tolerance

V = 8


class Bigram(torch.nn.Module):
    """logits[t] = table[token t]: the next token depends on the last one only (in the table's dtype)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.table[input_ids])


def chain_table(dtype=torch.float32, tie=None, gap=None):
    """Token i's clear successor is (i + 1) % V at logit 10 (the rest 0). `tie`: token 3 is followed by 4 and 6
    equally; `gap`: by 4, and by 6 at 10 - gap."""
    table = torch.zeros(V, V)
    for i in range(V):
        table[i, (i + 1) % V] = 10.0
    if tie is not None:
        table[3, 6] = 10.0
    if gap is not None:
        table[3, 6] = 10.0 - gap
    return Bigram(table.to(dtype))


PROMPT = torch.tensor([[1, 2]])


def out(*tokens):
    return torch.cat([PROMPT, torch.tensor([tokens])], dim=1)


@pytest.mark.parametrize("dtype, per_unit", [(torch.float32, 8 * 2.0 ** -23), (torch.float16, 8 * 2.0 ** -10),
                                             (torch.bfloat16, 8 * 2.0 ** -7)])
def test_tolerance_per_dtype(dtype, per_unit):
    assert tolerance(dtype, 1.0) == pytest.approx(per_unit)
    assert tolerance(dtype, 10.0) == pytest.approx(10 * per_unit)
    assert tolerance(torch.bfloat16, 10.0) == pytest.approx(0.625)       # 10 bf16 spacings at |logit| 10
    assert tolerance(torch.float16, 10.0) == pytest.approx(0.078125)
    assert tolerance(torch.float32, 10.0) == pytest.approx(9.5367e-6, rel=1e-4)


def test_tolerance_is_refused_for_integer_dtypes():
    with pytest.raises(ValueError, match="floating-point"):
        tolerance(torch.int64, 1.0)


def test_identical_outputs():
    model = chain_table()
    verdict = judge(model, PROMPT, None, out(3, 4, 5), out(3, 4, 5))
    assert [r.status for r in verdict.rows] == [IDENTICAL] and verdict.ok and str(verdict) == "row 0: identical"


def test_a_true_tie_is_accepted():
    model = chain_table(tie=True)
    # after 3 the target ties 4 and 6; each output then follows its own greedy chain
    verdict = assert_lossless(model, PROMPT, None, out(3, 4, 5, 6), out(3, 6, 7, 0))
    row = verdict.rows[0]
    assert row.status == TIE and row.ties == 1 and row.first == 1 and str(row) == "tie-equivalent (1 tie)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_gap_within_the_tolerance_is_a_tie_and_beyond_it_is_not(dtype):
    inside = tolerance(dtype, 10.0) / 2
    outside = 4 * tolerance(dtype, 10.0)
    near = chain_table(dtype, gap=max(inside, torch.finfo(dtype).eps * 10))   # representable, within tolerance
    assert judge(near, PROMPT, None, out(3, 4, 5), out(3, 6, 7)).rows[0].status == TIE
    far = chain_table(dtype, gap=outside)
    assert judge(far, PROMPT, None, out(3, 4, 5), out(3, 6, 7)).rows[0].status == DIFFERS


def test_a_divergence_that_is_no_tie_is_rejected():
    model = chain_table(gap=1.0)
    verdict = judge(model, PROMPT, None, out(3, 4, 5), out(3, 6, 7))
    row = verdict.rows[0]
    assert not verdict.ok and row.status == DIFFERS and row.first == 1 and "not a tie" in row.reason
    with pytest.raises(AssertionError, match="not a tie"):
        assert_lossless(model, PROMPT, None, out(3, 4, 5), out(3, 6, 7))


def test_a_tie_followed_by_a_non_greedy_candidate_is_rejected():
    model = chain_table(tie=True)
    verdict = judge(model, PROMPT, None, out(3, 4, 5, 6), out(3, 6, 7, 1))    # 7 is followed by 0, not 1
    row = verdict.rows[0]
    assert row.status == DIFFERS and "candidate's token 3 is not the target's greedy choice" in row.reason


def test_a_divergence_at_a_token_no_output_ties_with_is_rejected():
    """Both tokens must be near the top: a candidate token far below a tie of two others is a loss."""
    model = chain_table(tie=True)
    assert judge(model, PROMPT, None, out(3, 4, 5), out(3, 0, 1)).rows[0].status == DIFFERS


def test_later_ties_are_counted_and_rows_are_judged_apart():
    table = chain_table(tie=True).table.clone()
    table[7, 2] = 10.0          # after 7: 0 and 2 tie
    model = Bigram(table)
    prompt = torch.tensor([[0, 1, 2], [5, 6, 7]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    reference = torch.cat([prompt, torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3]])], dim=1)
    candidate = torch.cat([prompt, torch.tensor([[3, 6, 7, 2], [0, 1, 2, 3]])], dim=1)
    verdict = judge(model, prompt, mask, reference, candidate)
    assert [str(r) for r in verdict.rows] == ["tie-equivalent (2 ties)", "identical"] and verdict.ties == 2


def test_outputs_end_at_eos_and_a_length_mismatch_differs():
    model = chain_table()
    assert judge(model, PROMPT, None, out(3, 4, 0), out(3, 4, 7), eos_token_id=4).rows[0].status == IDENTICAL
    assert judge(model, PROMPT, None, out(3, 4, 5), out(3, 4), eos_token_id=None).rows[0].status == DIFFERS


def test_rescore_reads_the_position_before_each_token():
    model = chain_table()
    logits = rescore(model, torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert logits.shape == (2, V) and logits.argmax(-1).tolist() == [3, 4]


def test_the_bench_reports_ties_apart_from_differences():
    """The bench's harness judges an output that is not equal to the reference with the identity rule: a
    difference at the target's own near-ties is "tie-equivalent (k ties)", a clear one "differs" (and so is any
    difference when no judge is given)."""
    from types import SimpleNamespace

    from spec_adapt.tools.bench import time_interleaved

    reference, other = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    fns = {"target": lambda item: (reference, None), "tie": lambda item: (other, None),
           "same": lambda item: (reference, None)}
    verdicts = {"tie": SimpleNamespace(ok=True, ties=2)}

    def judge(item, ref, out):
        return verdicts["tie"] if item == "tied input" else SimpleNamespace(ok=False, ties=0)

    cells = time_interleaved(fns, ["tied input"], 2, 1, count=lambda i, o: 1, progress=False, judge=judge)
    assert cells["tie"].verdict == "tie-equivalent (4 ties)" and cells["tie"].differing == 0
    assert cells["same"].verdict == "identical"
    cells = time_interleaved(fns, ["another input"], 1, 1, count=lambda i, o: 1, progress=False, judge=judge)
    assert cells["tie"].verdict == "differs" and cells["tie"].differing == 1
    cells = time_interleaved(fns, ["tied input"], 1, 1, count=lambda i, o: 1, progress=False)
    assert cells["tie"].verdict == "differs"


def test_the_bench_judges_each_model_against_its_own_reference():
    """Configurations on the target's bf16 copy are judged against stock generate on that copy, with that copy's
    judge: a bf16 output equal to bf16 stock is identical however far float32's output is from it."""
    from types import SimpleNamespace

    from spec_adapt.tools.bench import time_interleaved

    f32, bf16 = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 5, 6]])
    fns = {"target": lambda item: (f32, None), "spec": lambda item: (f32, None),
           "target@bf16": lambda item: (bf16, None), "spec@bf16": lambda item: (bf16, None),
           "off@bf16": lambda item: (f32, None)}
    judged = []

    def judge_of(name):
        return lambda item, ref, out: judged.append(name) or SimpleNamespace(ok=False, ties=0)

    cells = time_interleaved(fns, ["input"], 1, 1, count=lambda i, o: 1, progress=False,
                             judge={"": judge_of("f32"), "@bf16": judge_of("bf16")},
                             group=lambda name: "@bf16" if "@bf16" in name else "")
    assert cells["spec"].verdict == "identical" and cells["spec@bf16"].verdict == "identical"
    assert cells["target@bf16"].checks == 0            # the copy's reference is judged by nothing but itself
    assert cells["off@bf16"].verdict == "differs" and judged == ["bf16"]
