"""Chains on a synthetic model family: measured time per token of every chain against the scheduler's prediction.

    python benchmarks/chain_synthetic.py --batch-size 1 --new-tokens 48 --repeats 3 --out /tmp/chain-synthetic
    python benchmarks/chain_synthetic.py --smoke      # a 6-layer, 64-wide family, one tiny run

Family (`spec_adapt.tools.synthetic.layered_family`): a random 24-layer Llama target (hidden 512, vocab 8192, untied head) and two
drafts that are its first 1 and first 4 layers, so their costs follow their depth. Two scenarios set how much the
dropped layers matter: "middle-good" (the 4-layer level agrees well with the target) and "middle-poor" (it does
not). Every option runs the same prompts, interleaved in each repeat: stock `generate` (target only), every fixed
chain [0] / [1] / [0, 1] at each width W, and the ChainScheduler choosing online (one scheduler per scenario, kept
across calls as in serving). Reported: the median seconds per token of each option, the scheduler's prediction
for it after the run (T_eff from its own estimates), and the scheduler's choices over time. Every greedy output
is checked against target-only. Writes <out>/{chain.json, chain.md, chain.png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import spec_adapt
from spec_adapt import ChainDrafter, ChainScheduler, FixedLength
from spec_adapt.tools.bench import chain_windows, time_interleaved
from spec_adapt.tools.synthetic import agreement, layered_family

import _smoke

SCENARIOS = {"middle-good": (0.1, 0.01), "middle-poor": (0.05, 0.1)}
CHAINS = [(0,), (1,), (0, 1)]
SMOKE_FAMILY = dict(vocab=256, hidden=64, layers=6, cuts=(1, 3))


def generate(model, ids, new_tokens, **kw):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kw)


def run_scenario(name, scales, args):
    target, (small, middle) = layered_family(scales=scales, **(SMOKE_FAMILY if args.smoke else {}))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, target.config.vocab_size, (args.batch_size, 24), generator=gen) for _ in range(args.prompts)]
    references = [generate(target, ids, args.new_tokens) for ids in batches]
    agree = {name: sum(agreement(a, b, seq, start=24) for seq in references) / len(references)
             for name, a, b in [("0-1", middle, small), ("1-T", target, middle), ("0-T", target, small)]}

    scheduled = ChainDrafter([small, middle])
    scheduler = ChainScheduler(scheduled, widths=tuple(args.widths))
    options = {"target": None, "scheduler": None}
    options.update({f"{list(c)} W={w}": (c, w) for c in CHAINS for w in args.widths})

    def run(option, ids):
        if option == "target":
            return generate(target, ids, args.new_tokens)
        if option == "scheduler":
            return generate(target, ids, args.new_tokens, custom_generate=spec_adapt.generate,
                            drafter=scheduled, assistant_policy=scheduler)
        members, width = options[option]
        chain = ChainDrafter([small, middle])
        chain.use(list(members))
        return generate(target, ids, args.new_tokens, custom_generate=spec_adapt.generate, drafter=chain,
                        assistant_policy=FixedLength(width))

    fns = {o: (lambda o: lambda ids: (run(o, ids), None))(o) for o in options}   # "target" first: the reference
    cells = time_interleaved(fns, batches, args.repeats, args.batch_size, count=lambda ids, out: 1, desc=name)
    seconds = {o: [t / (len(batches) * args.new_tokens) for t in c.times] for o, c in cells.items()}
    identical = {o: c.identical for o, c in cells.items()}
    measured = {o: statistics.median(v) for o, v in seconds.items()}
    predicted = {o: scheduler.predict(*options[o]) for o in options if options[o] is not None}
    predicted["target"] = scheduler.predict((), 0)
    return {"scales": scales, "agreement": agree, "measured_s_per_token": measured, "spread": seconds,
            "predicted_s_per_token": predicted, "identical": identical,
            "choices": chain_windows(scheduler.history, parts=8, names=[0, 1]),
            "scheduler_state": scheduler.state_dict()}


def report(results, args, command) -> str:
    lines = [f"`{command}`", ""]
    for name, r in results.items():
        best = min((o for o in r["measured_s_per_token"] if o != "scheduler"), key=r["measured_s_per_token"].get)
        pairs = [o for o in r["measured_s_per_token"] if o.startswith("[0] ") or o.startswith("[1] ")]
        best_pair = min(pairs, key=r["measured_s_per_token"].get)
        lines += [f"### {name} (scales {r['scales']}; top-1 agreement " +
                  ", ".join(f"{k} {v:.2f}" for k, v in r["agreement"].items()) + ")", "",
                  "| option | measured ms/token | predicted ms/token | vs target | identical |", "|---|---|---|---|---|"]
        base = r["measured_s_per_token"]["target"]
        for o, m in r["measured_s_per_token"].items():
            p = r["predicted_s_per_token"].get(o)
            lines.append(f"| {o} | {1000 * m:.2f} | {'-' if p is None else f'{1000 * p:.2f}'} | {base / m:.2f}x | "
                         f"{'yes' if r['identical'][o] else 'NO'} |")
        predicted_best = min(r["predicted_s_per_token"], key=r["predicted_s_per_token"].get)
        lines += ["", f"Measured best: {best}; best 2-level pair: {best_pair}; scheduler's predicted best: "
                  f"{predicted_best}.", "", "Scheduler's choices per eighth of its steps: " +
                  "; ".join(f"{w['steps']}: {w['chain']} W={w['W']} ({w['share']:.0%})" for w in r["choices"]), ""]
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        names = list(r["measured_s_per_token"])
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [1000 * r["measured_s_per_token"][o] for o in names], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [1000 * r["predicted_s_per_token"].get(o, float("nan")) for o in names], 0.4,
               label="predicted (scheduler)")
        ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("ms per token")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4, help="batches per repeat")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", default="results/chain-synthetic")
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), prompts=1, new_tokens=8, repeats=1, widths=[2], out=_smoke.folder())
    import sys

    command = "python " + " ".join(sys.argv)
    torch.set_grad_enabled(False)
    results = {name: run_scenario(name, scales, args) for name, scales in SCENARIOS.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chain.json").write_text(json.dumps({"command": command, "args": vars(args), "results": results},
                                               indent=1))
    text = report(results, args, command)
    (out / "chain.md").write_text(text)
    plot(results, out / "chain.png")
    print(text)


if __name__ == "__main__":
    main()
