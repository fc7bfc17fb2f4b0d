"""A ragged batch's prefill on a CPU: padded (one forward over [B, L]) against a row at a time without padding.

    python benchmarks/prefill_apart.py --model qwen2.5-coder-1.5b --workload edit --rows 4 \
        --out results/execution/prefill-apart-cpu.json
    python benchmarks/prefill_apart.py --smoke

The prompts are the workload's first `--rows`, rendered as the bench renders them and left padded. Both ways run
through the target's `KVLedger.prefill` (the model prepared, as the bench's `--prepare` does): padded with
`PREFILL_APART_TOKENS` out of reach, apart with it at 0. Per way: seconds per prefill, the median of `--repeats`
interleaved repeats after one warm-up each, and the ratio. Printed with the CPU's name, the prompt lengths, the
padding share and what the library's own rule (`KVLedger._prefills_apart`) chooses for this batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spec_adapt import ledger as ledger_module
from spec_adapt.execution import prepare
from spec_adapt.ledger import KVLedger
from spec_adapt.recipes.workloads import load, with_inputs
from spec_adapt.tools.models import load_model

import _smoke
from host_overhead import cpu_name


def prefill_seconds(model, enc, threshold: int) -> float:
    saved = ledger_module.PREFILL_APART_TOKENS
    ledger_module.PREFILL_APART_TOKENS = threshold
    try:
        began = time.perf_counter()
        with torch.inference_mode():
            KVLedger(model).prefill(enc.input_ids, enc.attention_mask)
        return time.perf_counter() - began
    finally:
        ledger_module.PREFILL_APART_TOKENS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--workload", default="edit")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), globals(), rows=2, repeats=1, out=Path(_smoke.folder("prefill.json")))

    model, tok = load_model(args.model)
    prepare(model)
    tok.padding_side = "left"
    texts = list(with_inputs(load(args.workload, args.rows), tok)["input_text"])
    enc = tok(texts, return_tensors="pt", padding=True)
    lengths = enc.attention_mask.sum(dim=1).tolist()
    padding = 1 - sum(lengths) / enc.input_ids.numel()
    ways = {"padded": 1 << 30, "apart": 0}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for name, threshold in ways.items():                     # warm-up
        prefill_seconds(model, enc, threshold)
    for _ in range(args.repeats):
        for name, threshold in ways.items():
            times[name].append(prefill_seconds(model, enc, threshold))
    median = {name: statistics.median(values) for name, values in times.items()}
    chosen = "apart" if KVLedger(model)._prefills_apart(enc.attention_mask) else "padded"
    result = {"cpu": cpu_name(), "model": args.model, "workload": args.workload, "lengths": lengths,
              "padding_share": round(padding, 3), "seconds": median,
              "apart_over_padded": median["apart"] / median["padded"], "rule_chooses": chosen, "repeats": args.repeats,
              "command": f"python benchmarks/prefill_apart.py --model {args.model} --workload {args.workload} "
                         f"--rows {args.rows}" + (f" --out {args.out}" if args.out else "")}
    print(f"{result['cpu']}: {args.model}, {args.workload}, prompts {lengths} ({padding:.0%} padding)")
    for name in ways:
        print(f"  {name:7s} {median[name]:7.2f} s")
    print(f"  apart / padded {result['apart_over_padded']:.2f}; the rule chooses: {chosen}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
