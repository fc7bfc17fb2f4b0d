"""Draft offload / reload on this machine: memory actually freed (process RSS) and the time each move takes.

    python benchmarks/offload.py --models smollm2-135m qwen2.5-coder-0.5b --dtypes float32 bfloat16
    python benchmarks/offload.py --smoke      # a tiny random model, written to a temporary folder

The first offload writes accelerate's offload files (one memmap per tensor); later offloads reuse them. RSS is read
after gc; freed memory is returned to the OS by the allocator for large tensors (glibc mmap), which is what a
co-located process (a growing KV cache, another model) can use.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import psutil
import torch

from spec_adapt.drafters.offload import DraftOffload
from spec_adapt.tools.models import load_model

import _smoke


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def measure(name, dtype):
    model = load_model(name, dtype=getattr(torch, dtype))[0]
    with tempfile.TemporaryDirectory() as folder:
        offload = DraftOffload(model, folder=Path(folder) / "draft")
        size, before = offload.size, rss()
        row = {"model": name, "dtype": dtype, "weights_mb": size / 2**20}
        for episode in (1, 2):
            offload.offload()
            during = rss()
            offload.reload()
            after = rss()
            off, on = offload.events[-2]["seconds"], offload.events[-1]["seconds"]
            row |= {f"offload{episode}_s": off, f"reload{episode}_s": on,
                    f"freed{episode}_mb": (before - during) / 2**20, f"back{episode}_mb": (after - during) / 2**20}
    del model, offload
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--out", default="results/memory/offload")
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), globals(), models=["tiny"], dtypes=["float32"], out=_smoke.folder())
    rows = [measure(m, d) for m in args.models for d in args.dtypes]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['model']:>20} {r['dtype']:>8}: weights {r['weights_mb']:.0f} MB; offload {r['offload1_s']:.2f} s "
              f"(again {r['offload2_s']:.2f} s), RSS freed {r['freed1_mb']:.0f} MB; reload {r['reload1_s']:.2f} s "
              f"(again {r['reload2_s']:.2f} s), back {r['back1_mb']:.0f} MB")


if __name__ == "__main__":
    main()
