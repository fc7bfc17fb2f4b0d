"""Adaptive's decision time at a large batch: `choose` and `observe` per step, on synthetic steps (no model).

    python benchmarks/decision_time.py --batch 64 --steps 400
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from spec_adapt import Adaptive
from spec_adapt.metrics import StepRecord
from spec_adapt.policies.base import StepInfo


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)
    policy, rng, batch = Adaptive(), random.Random(0), args.batch
    choose = observe = 0.0
    for step in range(args.steps):
        info = StepInfo(batch, torch.arange(batch), torch.full((batch,), 10), torch.full((batch,), 100), step,
                        torch.full((batch,), 2))
        start = time.perf_counter()
        gammas = policy.choose(info)
        choose += time.perf_counter() - start
        gammas = gammas.tolist() if torch.is_tensor(gammas) else [gammas] * batch
        accepted = [min(g, rng.randrange(0, 5)) for g in gammas]
        record = StepRecord(batch, list(range(batch)), gammas, gammas, accepted, [a + 1 for a in accepted],
                            0.1 + 0.01 * max(gammas), 0, 0)
        start = time.perf_counter()
        policy.observe(record)
        observe += time.perf_counter() - start
    print(f"B={batch}: choose {1e6 * choose / args.steps:.0f} us, observe {1e6 * observe / args.steps:.0f} us per step")


if __name__ == "__main__":
    main()
