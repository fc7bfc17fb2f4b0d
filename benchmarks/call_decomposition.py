"""Where a batched call's time goes on the real pair: the target's prefill, then the steps (draft, verify).

    python benchmarks/call_decomposition.py --batch 4 --new-tokens 32

One call each of stock `generate`, spec_adapt at γ = 0 and with the 0.5B draft at fixed widths, on the first
`--batch` HumanEval-chat prompts; prints wall time, the loop's prefill and step times. Single samples: run it twice.
"""

from __future__ import annotations

import argparse
import time

import torch

import spec_adapt
from spec_adapt import FixedLength, ModelDrafter
from spec_adapt.models import load_model
from spec_adapt.recipes import workloads


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tok = load_model("qwen2.5-coder-1.5b", dtype=dtype)
    draft = load_model("qwen2.5-coder-0.5b", dtype=dtype)[0]
    ds = workloads.with_inputs(workloads.load("humaneval-chat", args.batch), tok)
    batch = tok(list(ds["input_text"])[: args.batch], return_tensors="pt", padding=True)
    print("prompt batch", tuple(batch.input_ids.shape))
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            model(**batch)
            print(f"target prefill alone: {time.perf_counter() - start:.2f} s")

    def stock():
        start = time.perf_counter()
        model.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False)
        print(f"{'stock generate':16s} wall {time.perf_counter() - start:.2f} s")

    def ours(label, **kw):
        stats = spec_adapt.SpecStats()
        start = time.perf_counter()
        model.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False, custom_generate=spec_adapt.generate,
                       spec_stats=stats, **kw)
        wall = time.perf_counter() - start
        steps = sum(r.step_time for r in stats.trace)
        print(f"{label:16s} wall {wall:.2f} s: prefill {stats.time_prefill:.2f}, {len(stats.trace)} steps "
              f"{steps:.2f} (draft {stats.time_draft:.2f}, verify {stats.time_verify:.2f})")

    stock()
    ours("spec γ=0", assistant_policy=FixedLength(0))
    for gamma in (1, 2, 3):
        ours(f"draft fixed{gamma}", drafter=ModelDrafter(draft), assistant_policy=FixedLength(gamma))
    stock()


if __name__ == "__main__":
    main()
