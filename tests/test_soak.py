"""The soak harness itself (the 20,000-request run is `spec-adapt soak`; docs/benchmarks.md has its numbers)."""

from __future__ import annotations

import pytest

from spec_adapt.tools import soak


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_a_short_soak_serves_identically_and_reports_its_windows(drafter):
    report = soak.run_soak(requests=120, max_batch=4, drafter=drafter, window=40, check_every=10, progress=False,
                           policy="fixed2")
    assert [w["served"] for w in report["windows"]] == [40, 80, 120]
    assert report["checked"] == 12 and report["identical"] == 12
    assert all(w["rss_mb"] > 0 and w["ms_per_request"] > 0 for w in report["windows"])
    assert report["drafted"] > 0 and report["fallback"] is None


def test_the_verdict_reads_growth_after_warm_up():
    windows = [{"served": s, "rss_mb": 100 + (s >= 2000) * s / 1000, "ms_per_request": 1.0 + (s >= 4000)}
               for s in range(1000, 6001, 1000)]
    verdict = soak._verdict(windows)
    assert verdict["rss_from"] == 2000 and verdict["rss_growth_mb"] == pytest.approx(4.0)
    assert verdict["time_ratio_last_to_first"] == pytest.approx(2.0)


def test_unknown_soak_options_are_refused():
    with pytest.raises(ValueError, match="window to be a positive int"):
        soak.run_soak(requests=4, window=0, progress=False)
    with pytest.raises(ValueError, match="fixed<k>"):
        soak.run_soak(requests=4, policy="fastest", progress=False)
    with pytest.raises(ValueError, match="model, lookup or suffix"):
        soak.make_drafter("oracle", None)
