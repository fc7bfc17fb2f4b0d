"""Greedy agreement of a target with itself between float32 and bfloat16: stock `generate` on the first prompts of each
workload in both dtypes; per prompt, the first position where the two dtypes choose differently and the share of
positions where they choose alike (what a bf16 target changes in the output, which no speculation does).

    python benchmarks/dtype_agreement.py --model qwen2.5-coder-1.5b --num-prompts 3 --new-tokens 48
    python benchmarks/dtype_agreement.py --smoke
"""

from __future__ import annotations

import argparse
import json

import torch

from spec_adapt.recipes import workloads
from spec_adapt.tools.models import load_model

import _smoke

DTYPES = ("float32", "bfloat16")


def outputs(args, dtype: str) -> dict:
    """(workload, prompt index) -> the greedy new tokens in `dtype`."""
    model, tok = load_model(args.model, dtype=getattr(torch, dtype))
    out = {}
    for workload in args.workloads:
        ds = workloads.with_inputs(workloads.load(workload, args.num_prompts), tok)
        for i, text in enumerate(ds["input_text"]):
            enc = tok([text], return_tensors="pt")
            ids = model.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False)
            out[(workload, i)] = ids[0, enc.input_ids.shape[1]:].tolist()
    return out


def compare(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b))
    first = next((j for j in range(n) if a[j] != b[j]), n)
    return {"tokens": n, "agree_prefix": first, "same_position": sum(x == y for x, y in zip(a, b)) / max(1, n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--workloads", nargs="+", default=["humaneval-chat", "sharegpt"])
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), num_prompts=1, new_tokens=8)
    torch.set_grad_enabled(False)
    runs = {dtype: outputs(args, dtype) for dtype in DTYPES}
    rows = [{"workload": w, "prompt": i, **compare(runs["float32"][(w, i)], runs["bfloat16"][(w, i)])}
            for (w, i) in runs["float32"]]
    print(json.dumps(rows, indent=1))
    total = max(1, sum(r["tokens"] for r in rows))
    print(f"prefix agreement {sum(r['agree_prefix'] for r in rows) / total:.3f}, positionwise "
          f"{sum(r['same_position'] * r['tokens'] for r in rows) / total:.3f}")


if __name__ == "__main__":
    main()
