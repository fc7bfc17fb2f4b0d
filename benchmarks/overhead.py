"""Overhead of the speculative loop itself: stock `generate` vs spec_adapt with gamma = 0 (no drafter), side by side.

    python benchmarks/overhead.py --batch-sizes 1 4 16 --new-tokens 64 --repeats 5

Configurations alternate inside every repeat, so machine noise hits both; medians and the ratio are reported. EOS is
ignored so both generate exactly `--new-tokens` tokens per row (with EOS, spec_adapt retires finished rows early and
would look better than its loop overhead deserves). Outputs are checked identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import spec_adapt
from spec_adapt.models import load_model
from spec_adapt.recipes import workloads


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", default="results/overhead.json")
    args = parser.parse_args()

    model, tok = load_model(dtype=getattr(torch, args.dtype))
    prompts = list(workloads.with_inputs(workloads.sharegpt(limit=max(args.batch_sizes)), tok)["input_text"])
    common = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    configs = {
        "stock generate": lambda enc: model.generate(**enc, **common),
        "spec_adapt gamma=0": lambda enc: model.generate(
            **enc, **common, custom_generate=spec_adapt.generate, drafter=None,
            assistant_policy=spec_adapt.FixedLength(0)),
    }
    rows = []
    for batch in args.batch_sizes:
        enc = tok(prompts[:batch], return_tensors="pt", padding=True)
        for fn in configs.values():   # warm-up
            fn(enc)
        times = {name: [] for name in configs}
        outputs = {}
        for _ in tqdm(range(args.repeats), desc=f"B={batch}"):
            for name, fn in configs.items():
                start = time.perf_counter()
                outputs[name] = fn(enc)
                times[name].append(time.perf_counter() - start)
        identical = torch.equal(*outputs.values())
        tokens = batch * args.new_tokens
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({
            "batch_size": batch, "new_tokens_per_row": args.new_tokens, "dtype": args.dtype,
            "stock_tok_s": tokens / med["stock generate"], "spec_gamma0_tok_s": tokens / med["spec_adapt gamma=0"],
            "overhead": med["spec_adapt gamma=0"] / med["stock generate"] - 1, "identical": identical,
            "times": times,
        })
    print(f"\n{'B':>3} {'stock tok/s':>12} {'gamma=0 tok/s':>14} {'overhead':>9} identical")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['stock_tok_s']:>12.1f} {r['spec_gamma0_tok_s']:>14.1f} "
              f"{100 * r['overhead']:>8.1f}% {r['identical']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
