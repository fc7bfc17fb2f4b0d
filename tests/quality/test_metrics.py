"""The metrics themselves, on fixed texts (fast; no generation)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

import spec_adapt.eval  # noqa: E402

from spec_adapt.eval import bertscore_f1, embedding_cosine, paired_stats  # noqa: E402
from spec_adapt.eval.quality_metrics import summary  # noqa: E402

SAME = ["The cat sat on the mat.", "def add(a, b):\n    return a + b"]
CLOSE = ["A cat was sitting on the mat.", "def add(x, y):\n    return x + y"]
FAR = ["Quarterly revenue rose by four percent.", "The mountains were covered in snow."]


def test_bertscore_orders_identical_close_unrelated():
    same, close, far = (bertscore_f1(SAME, other, progress=False) for other in (SAME, CLOSE, FAR))
    assert all(s == pytest.approx(1.0, abs=1e-5) for s in same)
    assert all(c > f for c, f in zip(close, far))


def test_cosine_orders_identical_close_unrelated():
    same, close, far = (embedding_cosine(SAME, other, progress=False) for other in (SAME, CLOSE, FAR))
    assert all(s == pytest.approx(1.0, abs=1e-5) for s in same)
    assert all(c > f for c, f in zip(close, far))


def test_paired_stats():
    a, b = [1.0, 2.0, 3.0, 4.0], [0.5, 1.4, 2.6, 3.4]
    s = paired_stats(a, b)
    assert s["n"] == 4 and s["mean_diff"] == pytest.approx(0.525)
    assert s["ci95"][0] < s["mean_diff"] < s["ci95"][1] and s["p_value"] < 0.01
    assert paired_stats(a, a)["p_value"] == 1.0
    assert summary([1.0, 1.0])["mean"] == 1.0


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="equal length"):
        bertscore_f1(SAME, SAME[:1], progress=False)


@pytest.mark.parametrize("name, key", [("spec_bertscore", "mean_f1"), ("spec_cosine", "mean_cosine")])
def test_local_evaluate_modules_load_offline(name, key):
    import evaluate

    metric = evaluate.load(str(Path(spec_adapt.eval.__file__).parent / "evaluate_metrics" / name))
    result = metric.compute(predictions=SAME, references=SAME)
    assert result[key] == pytest.approx(1.0, abs=1e-5)


def test_regime_test_false_alarm_rate_and_power():
    """further_than: under the null (ours and the control drawn alike) it flags at most ~alpha of the time; a config
    that is 0.2 less similar (about the gap between the other-seed and unrelated controls) is flagged nearly
    always, with 16 prompts and per-prompt spread like the real suite's."""
    import json
    import random

    from spec_adapt.eval.suite import further_than

    rng = random.Random(0)
    trials, n, alpha = 2000, 16, 0.01 / 8
    null_flags = shifted_flags = 0
    for _ in range(trials):
        prompt = [rng.gauss(0.45, 0.1) for _ in range(n)]       # prompt-level similarity, shared by both
        control = [p + rng.gauss(0, 0.08) for p in prompt]
        same = [p + rng.gauss(0, 0.08) for p in prompt]
        worse = [p - 0.2 + rng.gauss(0, 0.08) for p in prompt]
        null_flags += further_than(same, control, 0.02, alpha)["flagged"]
        shifted_flags += further_than(worse, control, 0.02, alpha)["flagged"]
    assert null_flags / trials < 0.01
    assert shifted_flags / trials > 0.95
    json.dumps(further_than(same, control, 0.02, alpha))             # the report is written as JSON
    with pytest.raises(ValueError, match="at least 2 prompts"):
        further_than([0.5], [0.5], 0.02, alpha)
