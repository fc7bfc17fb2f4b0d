"""Tokens per verification against the nodes verified per row: token trees against chains, per workload.

For every node count N: the chain FixedLength(N) and the tree FixedTree(N, depth=min(N, --depth)) of the same
drafter, greedy, batch 1, every output checked against stock `generate`. Tokens per verification = tokens committed by
verification steps / row-steps (the bonus or correction included, the prefill's first token not).

    python benchmarks/tree_curve.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --workloads humaneval-chat sharegpt --num-prompts 3 --new-tokens 48 --out results/tree-curve-qwen
    python benchmarks/tree_curve.py --smoke

Writes <out>/curve.json and <out>/curve.png and prints the table with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

import spec_adapt
from spec_adapt import FixedLength, FixedTree, ModelDrafter, PromptLookupDrafter
from spec_adapt.tools.cli import cpu_name
from spec_adapt.tools.models import load_model

import _smoke


def drafter_for(kind: str, draft, branch: int):
    if kind == "draft":
        return ModelDrafter(draft, branch=branch)
    if kind == "lookup":
        return PromptLookupDrafter(max_ngram=3, min_ngram=2)
    if kind == "suffix":
        return spec_adapt.SuffixDrafter(index=spec_adapt.drafters.SuffixIndex())   # fresh per call
    raise ValueError(kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default=None, help="a draft model (drafter 'draft')")
    parser.add_argument("--drafter", default="draft", choices=["draft", "lookup", "suffix"])
    parser.add_argument("--workloads", nargs="+", default=["humaneval-chat", "sharegpt"])
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--branch", type=int, default=4)
    parser.add_argument("--out", default="results/tree-curve")
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), globals(), draft="draft", workloads=["sharegpt"], num_prompts=1,
                        new_tokens=8, nodes=[1, 4], out=_smoke.folder())

    from spec_adapt.recipes import workloads

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model)
    spec_adapt.prepare(model)
    draft = None
    if args.draft:
        draft, _ = load_model(args.draft)
        spec_adapt.prepare(draft)
    rows, shapes = [], [(kind, n) for n in args.nodes for kind in ("chain", "tree")]
    for workload in args.workloads:
        ds = workloads.with_inputs(workloads.load(workload, args.num_prompts), tok)
        encoded = [tok(text, return_tensors="pt") for text in ds["input_text"]]
        plain = [model.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False) for enc in encoded]
        for kind, nodes in tqdm(shapes, desc=workload):
            policy = FixedLength(nodes) if kind == "chain" else FixedTree(nodes, min(nodes, args.depth))
            committed = row_steps = 0
            identical = True
            for enc, reference in zip(encoded, plain):
                out = model.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False,
                                     custom_generate=spec_adapt.generate,
                                     drafter=drafter_for(args.drafter, draft, args.branch), assistant_policy=policy)
                stats = spec_adapt.last_stats()
                identical &= torch.equal(out, reference)
                committed += sum(sum(r.committed) for r in stats.trace)
                row_steps += stats.row_steps
            rows.append({"workload": workload, "shape": kind, "nodes": nodes, "policy": repr(policy),
                         "tokens_per_verification": committed / max(row_steps, 1), "identical": identical})
    meta = {"cpu": cpu_name(), "model": args.model, "draft": args.draft, "drafter": args.drafter,
            "branch": args.branch, "depth": args.depth, "prompts": args.num_prompts, "new_tokens": args.new_tokens,
            "command": "python benchmarks/tree_curve.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if v is not None)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, meta, out / "curve.png")
    print(meta["cpu"])
    print("| workload | nodes | chain | tree | identical |\n|---|---|---|---|---|")
    for workload in args.workloads:
        for nodes in args.nodes:
            cell = {r["shape"]: r for r in rows if r["workload"] == workload and r["nodes"] == nodes}
            print(f"| {workload} | {nodes} | {cell['chain']['tokens_per_verification']:.2f} | "
                  f"{cell['tree']['tokens_per_verification']:.2f} | "
                  f"{cell['chain']['identical'] and cell['tree']['identical']} |")


def plot(rows, meta, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for shape, style in (("chain", "o-"), ("tree", "s-")):
            points = [(r["nodes"], r["tokens_per_verification"]) for r in rows
                      if r["workload"] == workload and r["shape"] == shape]
            ax.plot(*zip(*points), style, label=shape)
        ax.set_title(workload)
        ax.set_xlabel("nodes verified per row")
        ax.set_ylabel("tokens per verification")
        ax.legend()
    fig.suptitle(f"{meta['model']} / {meta['draft'] or meta['drafter']}, batch 1, {meta['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
