"""Resident memory of a target and draft pair, unprepared and prepared (`spec_adapt.prepare`), each configuration in a
process of its own: the memory the process holds after loading, preparing and running both models (resident set,
split into anonymous and file-backed pages). A 5-token forward over a 64-token context is timed in each (median of
`--repeats`; processes differ by a few percent run to run, so compare the timings loosely).

    python benchmarks/prepare_memory.py --out results/memory/prepare-qwen
    python benchmarks/prepare_memory.py --smoke       # tiny models, eager and prepared only

Configurations: `eager` (unprepared), `prepared` (the plain weights leave resident memory: one resident copy, the
packed one), `prepared-spill-off` (`prepare(spill=False)`: the plain weights stay resident beside the packed copy).
Writes <out>/memory.json and prints the table with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import _smoke

CONFIGS = ("eager", "prepared", "prepared-spill-off")


def status_mib() -> dict:
    """This process's resident memory, split into anonymous and file-backed pages, in MiB."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}


def forward_ms(model, repeats: int) -> float:
    """Median milliseconds of a 5-token forward after a 64-token context (what a verification of 4 drafts feeds)."""
    from transformers import DynamicCache
    from spec_adapt.compat import with_cache

    ids = torch.randint(100, 1000, (1, 69))
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            cache = DynamicCache()
            model(input_ids=ids[:, :64], use_cache=True, **with_cache(model, cache))
            start = time.perf_counter()
            model(input_ids=ids[:, 64:], use_cache=True, **with_cache(model, cache))
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def child(config: str, names: list[str], repeats: int, smoke: bool) -> dict:
    from spec_adapt import prepare

    if smoke:
        _smoke.use_tiny_models()
    from spec_adapt.tools.models import load_model

    models = [load_model(name, dtype=torch.float32)[0] for name in names]
    for model in models:
        if config != "eager":
            prepare(model, spill=config == "prepared")
    times = {name: forward_ms(model, repeats) for name, model in zip(names, models)}
    return {"config": config, **status_mib(), "forward_ms": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), repeats=1, configs=["eager", "prepared"],
                        out=Path(_smoke.folder()))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.child:
        print(json.dumps(child(args.child, args.models, args.repeats, args.smoke)))
        return
    from tqdm import tqdm
    from spec_adapt.tools.cli import cpu_name

    rows = []
    for config in tqdm(args.configs, desc="configurations"):
        run = subprocess.run([sys.executable, __file__, "--child", config, "--repeats", str(args.repeats),
                              "--models", *args.models] + ["--smoke"] * args.smoke, capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    base = rows[0]["VmRSS"]
    print(f"CPU: {cpu_name()}   models: {', '.join(args.models)} (float32)")
    print(f"{'configuration':<20}{'RSS MiB':>10}{'anon':>9}{'file':>9}{'x eager':>9}  forward ms")
    for row in rows:
        ms = ", ".join(f"{v:.0f}" for v in row["forward_ms"].values())
        print(f"{row['config']:<20}{row['VmRSS']:>10.0f}{row['RssAnon']:>9.0f}{row['RssFile']:>9.0f}"
              f"{row['VmRSS'] / base:>9.2f}  {ms}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"cpu": cpu_name(), "models": args.models, "command": " ".join(["python", *sys.argv])}
        (args.out / "memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
