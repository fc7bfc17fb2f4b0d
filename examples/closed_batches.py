"""A generate call is a closed batch: no row joins, and it ends with its slowest row. Adaptive judges a width there by
the progress of the row that will take longest, not by the tokens all rows commit (throughput, right for serving).

Replayed in the lab (no model runs, a second): batches of 4 equally long requests, one that the drafter gets right
for long runs and three that it never gets right, verification 8% dearer per drafted token at batch 4.

    python examples/closed_batches.py
"""

from spec_adapt import Adaptive, FixedLength
from spec_adapt.tools.lab import Batches, Request, simulate, synthetic_requests
from spec_adapt.policies.estimators import LatencyTable


def main():
    table = LatencyTable(step={1: {s: 1 + 0.05 * s for s in range(17)}, 16: {s: 1 + 0.2 * s for s in range(17)}})
    requests = []
    for group in range(6):
        requests += synthetic_requests(1, 200, 0.95, seed=group) + [Request([0] * 200) for _ in range(3)]
    plain = simulate(FixedLength(0), requests, table, Batches(4)).seconds
    print("closed batches of 4 (generate calls): time relative to plain decoding")
    for name, policy in (("Adaptive", Adaptive()), ("Adaptive(closed_batches=False)", Adaptive(closed_batches=False))):
        result = simulate(policy, requests, table, Batches(4))
        drafting = sum(1 for _, _, gamma in result.history if gamma > 0) / len(result.history)
        print(f"  {name:30s} {result.seconds / plain:.3f}x, drafting on {drafting:.0%} of steps")


if __name__ == "__main__":
    main()
