"""Adaptive vs the best fixed gamma in hindsight, in the lab (no model runs).

    python benchmarks/lab_adaptive.py --cycles 5
    python benchmarks/lab_adaptive.py --synthetic --seeds 5

Traces (default): replays results/lab-suffix/<workload>/traces.json under the fp32 latency table at B = 1, 4, 16
(closed loop); model-free drafter, so only verification costs (the lab's draft_cost=False).

`--synthetic`: eight synthetic workloads as closed generate calls of one row (12 calls of 48-64 tokens, one policy
across them, a draft model's cost per token in the table's slope): i.i.d. acceptance at 0.6-0.95, runs drawn from a
good or a bad regime per position (bimodal), and regimes that persist for about ten positions (bursty). Prints
each workload's mean and least ratio over `--seeds` draws, and the mean over all.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from spec_adapt import Adaptive
from spec_adapt.tools import lab
from spec_adapt.policies.estimators import LatencyTable


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--latency", default="results/latency-float32.json")
    parser.add_argument("--workloads", nargs="+", default=["humaneval", "sharegpt"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--synthetic", action="store_true", help="the synthetic workloads instead of the traces")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    if args.synthetic:
        return synthetic(args.seeds)
    table = LatencyTable.load(args.latency)
    print(f"{'workload':<10} {'B':>3} {'best fixed':>10} {'adaptive vs best':>17}")
    for workload in args.workloads:
        pool = [lab.Request(**r) for r in json.load(open(f"results/lab-suffix/{workload}/traces.json"))]
        requests = [lab.Request(r.runs, name=r.name, lengths=r.lengths) for _ in range(args.cycles) for r in pool]
        for batch in args.batch_sizes:
            ours = lab.simulate(Adaptive(), requests, table, lab.Static(batch), draft_cost=False).goodput
            gamma, best, _ = lab.best_fixed(requests, table, lab.Static(batch), draft_cost=False)
            print(f"{workload:<10} {batch:>3} {gamma:>10} {100 * (ours / best.goodput - 1):>+16.1f}%")


def slope_table(slope: float) -> LatencyTable:
    """T(1, s) / T(1, 0) = 1 + slope x s: verification and drafting together, per drafted token."""
    return LatencyTable(step={1: {s: 1.0 + slope * s for s in range(17)}})


def regimes(n: int, length: int, seed: int, good: float, bad: float, stay: float, p_good: float = 0.5):
    """Requests whose runs come from a good or a bad acceptance rate; the regime persists with probability `stay`
    from one position to the next (0: drawn afresh at each position, with `p_good`)."""
    rng, out = random.Random(seed), []
    for i in range(n):
        runs, is_good = [], rng.random() < p_good
        for _ in range(length):
            is_good = is_good if rng.random() < stay else rng.random() < p_good
            alpha, k = (good if is_good else bad), 0
            while k < 64 and rng.random() < alpha:
                k += 1
            runs.append(k)
        out.append(lab.Request(runs, name=f"regimes-{i}"))
    return out


WORKLOADS = [
    ("i.i.d. 0.90, slope 0.30", lambda s: lab.synthetic_requests(12, 48, 0.9, seed=s), 0.3),
    ("i.i.d. 0.80, slope 0.30", lambda s: lab.synthetic_requests(12, 48, 0.8, seed=s), 0.3),
    ("i.i.d. 0.75, slope 0.33", lambda s: lab.synthetic_requests(12, 48, 0.75, seed=s), 0.33),
    ("i.i.d. 0.60, slope 0.30", lambda s: lab.synthetic_requests(12, 48, 0.6, seed=s), 0.3),
    ("i.i.d. 0.95, slope 0.10", lambda s: lab.synthetic_requests(12, 64, 0.95, seed=s), 0.1),
    ("bimodal, slope 0.30", lambda s: regimes(12, 48, s, 0.95, 0.4, stay=0.0, p_good=0.6), 0.3),
    ("bursty, slope 0.30", lambda s: regimes(12, 48, s, 0.95, 0.3, stay=0.9), 0.3),
    ("bursty, slope 0.15", lambda s: regimes(12, 48, s, 0.95, 0.3, stay=0.9), 0.15),
]


def synthetic(seeds: int) -> None:
    print(f"{'workload':<26} {'adaptive / best fixed: mean':>28} {'least':>7}")
    every = []
    for name, make, slope in WORKLOADS:
        ratios = []
        for seed in range(seeds):
            requests, table = make(seed), slope_table(slope)
            _, best, _ = lab.best_fixed(requests, table, lab.Batches(1))
            ratios.append(lab.simulate(Adaptive(), requests, table, lab.Batches(1)).goodput / best.goodput)
        every += ratios
        print(f"{name:<26} {statistics.mean(ratios):>28.3f} {min(ratios):>7.3f}")
    print(f"{'all':<26} {statistics.mean(every):>28.3f} {min(every):>7.3f}")


if __name__ == "__main__":
    main()
