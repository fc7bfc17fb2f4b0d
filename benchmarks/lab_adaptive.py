"""Adaptive vs the best fixed gamma in hindsight on the recorded SmolLM2 suffix-drafter traces (no model runs).

    python benchmarks/lab_adaptive.py --cycles 5

Replays results/lab-suffix/<workload>/traces.json under the fp32 latency table at B = 1, 4, 16 (closed loop);
model-free drafter, so only verification costs (the lab's draft_cost=False).
"""

from __future__ import annotations

import argparse
import json

from spec_adapt import Adaptive
from spec_adapt.tools import lab
from spec_adapt.policies.estimators import LatencyTable


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--latency", default="results/latency-float32.json")
    parser.add_argument("--workloads", nargs="+", default=["humaneval", "sharegpt"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    table = LatencyTable.load(args.latency)
    print(f"{'workload':<10} {'B':>3} {'best fixed':>10} {'adaptive vs best':>17}")
    for workload in args.workloads:
        pool = [lab.Request(**r) for r in json.load(open(f"results/lab-suffix/{workload}/traces.json"))]
        requests = [lab.Request(r.runs, name=r.name, lengths=r.lengths) for _ in range(args.cycles) for r in pool]
        for batch in args.batch_sizes:
            ours = lab.simulate(Adaptive(), requests, table, lab.Static(batch), draft_cost=False).goodput
            gamma, best, _ = lab.best_fixed(requests, table, lab.Static(batch), draft_cost=False)
            print(f"{workload:<10} {batch:>3} {gamma:>10} {100 * (ours / best.goodput - 1):>+16.1f}%")


if __name__ == "__main__":
    main()
