"""The cost curve: milliseconds per forward against tokens fed, for the target and the draft, eager and prepared
(`spec_adapt.prepare`), at several batch sizes, over a cached context. Median of `--repeats` forwards, eager and
prepared interleaved per point (the prepared model runs eagerly inside `spec_adapt.execution.eager`). Each forward
projects every fed position onto the vocabulary, as a verification does.

    python benchmarks/forward_costs.py --dtype float32 --out results/cost-curve-qwen-float32
    python benchmarks/forward_costs.py --smoke

Writes <out>/costs.json and <out>/costs.png, and prints the table with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spec_adapt.compat import with_cache
from tqdm import tqdm
from transformers import DynamicCache

from spec_adapt import prepare
from spec_adapt.execution import eager
from spec_adapt.tools.cli import cpu_name
from spec_adapt.tools.models import load_model

import _smoke


def primed(model, batch: int, context: int) -> DynamicCache:
    """A cache holding `context` tokens per row (one prefill per model and batch size; forwards crop back to it)."""
    cache = DynamicCache(config=model.config)
    model(torch.randint(100, 5000, (batch, context)), use_cache=True, **with_cache(model, cache), logits_to_keep=1)
    return cache


def forward_ms(model, cache, width: int, repeats: int, packed: bool) -> float:
    batch = cache.layers[0].keys.shape[0]
    times = []
    for i in range(repeats + 1):
        tokens = torch.randint(100, 5000, (batch, width))
        start = time.perf_counter()
        if packed:
            model(tokens, use_cache=True, **with_cache(model, cache), logits_to_keep=width)
        else:
            with eager(model):
                model(tokens, use_cache=True, **with_cache(model, cache), logits_to_keep=width)
        if i:                                    # the first is a warm-up
            times.append(time.perf_counter() - start)
        cache.crop(-width)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/cost-curve")
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), globals(), batch_sizes=[1, 2], widths=[1, 2], context=16, repeats=1,
                        out=_smoke.folder())
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    models = {"target": prepare(load_model(args.target, dtype=dtype)[0])}
    if args.draft:
        models["draft"] = prepare(load_model(args.draft, dtype=dtype)[0])
    for model in models.values():            # touch every weight, packed and plain, before anything is timed
        warm = primed(model, 1, args.context)
        for packed in (False, True):
            forward_ms(model, warm, 4, 2, packed)
    points = [(role, b, w) for role in models for b in args.batch_sizes for w in args.widths]
    rows, caches = [], {}
    for role, batch, width in tqdm(points, desc="forwards"):
        if (role, batch) not in caches:
            caches.clear()                   # one primed cache at a time (B = 16 x 200 tokens of the 1.5B is large)
            caches[(role, batch)] = primed(models[role], batch, args.context)
        pair = {}
        for packed in (False, True):
            pair["prepared" if packed else "eager"] = forward_ms(models[role], caches[(role, batch)], width,
                                                                args.repeats, packed)
        rows.append({"model": role, "batch": batch, "width": width, **pair})
    meta = {"cpu": cpu_name(), "dtype": args.dtype, "context": args.context, "repeats": args.repeats,
            "target": args.target, "draft": args.draft, "threads": torch.get_num_threads(),
            "command": "python benchmarks/forward_costs.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "costs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{meta['cpu']}, {args.dtype}, {args.context}-token context, median of {args.repeats}, ms per forward")
    print(f"{'model':<7} {'B':>3} {'tokens':>6} {'eager':>8} {'prepared':>9} {'ratio':>6}  vs 1 token: eager / prepared")
    for r in rows:
        one = next(x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"] and x["width"] == 1)
        print(f"{r['model']:<7} {r['batch']:>3} {r['width']:>6} {r['eager']:>8.0f} {r['prepared']:>9.0f} "
              f"{r['eager'] / r['prepared']:>5.2f}x  {r['eager'] / one['eager']:.2f}x / {r['prepared'] / one['prepared']:.2f}x")
    plot(rows, meta, out / "costs.png")


def plot(rows, meta, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(roles), figsize=(6 * len(roles), 4.2), squeeze=False)
    for ax, role in zip(axes[0], roles):
        for batch in sorted({r["batch"] for r in rows}):
            mine = [r for r in rows if r["model"] == role and r["batch"] == batch]
            widths = [r["width"] for r in mine]
            line = ax.plot(widths, [r["eager"] for r in mine], linestyle="--", marker="o", label=f"B={batch} eager")
            ax.plot(widths, [r["prepared"] for r in mine], color=line[0].get_color(), marker="s",
                    label=f"B={batch} prepared")
        ax.set(xscale="log", xlabel="tokens fed per row", ylabel="ms per forward", title=f"{role} ({meta['dtype']})")
        ax.set_xticks(sorted({r["width"] for r in rows}), [str(w) for w in sorted({r["width"] for r in rows})])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(meta["cpu"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
