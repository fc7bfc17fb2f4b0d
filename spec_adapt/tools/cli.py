"""The `spec-adapt` command: demo (the main job), bench, profile, lab, serve, serve-bench, soak, export-vllm and eval."""

from __future__ import annotations

import argparse
import gc
import os

import torch

from spec_adapt.execution import bf16_capability
from spec_adapt.tools import options, serve
from spec_adapt.tools.models import draft_from_args, draft_options, fastest_draft


# The demo's configurations per model: stock generate (the baseline, always first), stock assisted generation or
# prompt lookup, and spec_adapt's configuration (docs/benchmarks.md has the measurements behind the choice).
DEMOS = {
    "smollm2-135m": dict(draft=None, configs=["target", "hf-lookup", "suffix:adaptive"], batch_sizes=[1, 4],
                         prompts=4, new_tokens=64, repeats=1, code="humaneval"),
    # Batch 1 only, so the demo stays short on a small CPU: `spec-adapt bench` measures batches (docs/benchmarks.md).
    "qwen2.5-coder-1.5b": dict(draft="qwen2.5-coder-0.5b",
                               configs=["target", "hf-assisted", "hf-lookup", "multi:adaptive"],
                               batch_sizes=[1], prompts=3, new_tokens=32, repeats=1, code="humaneval-chat",
                               edit=True),
}


def demo(args) -> None:
    """Stock generate vs stock speculation vs spec_adapt on HumanEval and ShareGPT prompts, through the one bench
    harness (interleaved repeats, identity against stock generate, one way of counting tokens)."""
    from spec_adapt.tools import bench as b
    from spec_adapt.tools.models import known, load_model, load_tokenizer
    from spec_adapt.recipes import workloads

    name = next(k for k, v in DEMOS.items() if known(k) == known(args.model))
    plan = DEMOS[name]
    torch.manual_seed(0)
    print(f"CPU: {cpu_name()}")
    print(f"Loading {name}" + (f" with the draft {plan['draft']}" if plan["draft"] else "") + "...")
    dtype = getattr(torch, args.dtype)
    tok = load_tokenizer(name)          # the targets load in their phases
    # Where this CPU computes bf16 natively, a bf16 target is what its users run: its cells sit beside float32's.
    twin = dtype == torch.float32 and bf16_capability(torch.device("cpu"))[0] == torch.bfloat16
    print(f"target dtype: {args.dtype}" + (" (prepared)" if args.prepare else "") + (
        ": float32 keeps every one-token and multi-token forward's argmax equal" if dtype == torch.float32 else
        ": chosen with --dtype"))
    if twin:
        print(f"this CPU computes bfloat16 natively: the rows ending in {b.TWIN} run a bfloat16 copy of the target, "
              "judged against stock generate on that copy")
    workloads_run = [("HumanEval", plan["code"]), ("ShareGPT", "sharegpt")] + (
        [("Edit", "edit")] if plan.get("edit") else [])
    prompts = {label: list(workloads.with_inputs(workloads.load(workload, plan["prompts"]), tok)["input_text"])
               for label, workload in workloads_run}
    cells = {label: [] for label in prompts}
    draft = None
    for phase, configs, load in _demo_phases(name, plan, dtype, twin, args.prepare):
        if plan["draft"] and draft is None and phase != "eager":
            # The draft's dtype is chosen apart from the target's: it changes which tokens the draft proposes,
            # never the output.
            draft = fastest_draft(load_model(plan["draft"], dtype=torch.float32)[0], args.prepare)
        model = load()
        for label, used in prompts.items():
            print(f"\n{label} ({phase}: {', '.join(configs)}): {len(used)} prompts, batch sizes "
                  f"{plan['batch_sizes']}, {plan['new_tokens']} new tokens")
            cells[label] += b.run_bench(model, tok, used, configs, plan["batch_sizes"], plan["new_tokens"],
                                        plan["repeats"], draft, rows=plan["prompts"], twin=model if twin else None,
                                        reference=False)
        del model                       # one target in memory at a time: the next phase loads its own
        gc.collect()
    order = b.ordered_configs([c for _, configs, _ in _demo_phases(name, plan, dtype, twin, args.prepare)
                               for c in configs])
    summaries = {label: b.summarize(sorted(found, key=lambda c: order.index(c.config)))
                 for label, found in cells.items()}
    if dtype == torch.bfloat16 or twin:
        print("\nA bfloat16 target (--dtype bfloat16, or the rows ending in @bf16): one-token decoding and "
              "multi-token verification sum in other orders and can break a tie between two logits 1 bf16 ulp "
              "apart differently (stock assisted generation included), so outputs are judged by the tie-aware "
              "identity rule: a difference only at the target's own near-ties is 'tie-equivalent', any other "
              "'differs'.")
    for label, summary in summaries.items():
        print(f"\n--- {label} ---")
        b.print_table(summary)
    print(f"\nspeedup = stock generate's time / the configuration's, same prompts, measured now on this machine"
          + ("; 'vs eager' = against stock generate on the model before spec_adapt.prepare" if args.prepare else "")
          + "; 'identical' = token-for-token equal to stock generate on the same model, 'tie-equivalent (k ties)' = "
          "equal up to the target's own near-ties (docs/execution.md), 'differs' = a failure. Configurations: "
          f"{', '.join(order)} (spec_adapt/tools/bench.py names them). Each model runs its rows in a phase of its "
          "own (the eager target, the prepared target, its bfloat16 copy), so only one target is in memory at a "
          "time; within a phase the configurations are interleaved.")
    print("\nIdentity checks (each call's output against stock generate's, same model and batch):")
    for label, summary in summaries.items():
        for s in summary:
            if s["identical"] is not None and s["checks"]:
                verdict = f"{s['differing']} DIFFERENT" if s["differing"] else s.get("verdict") or "identical"
                calls = f"{s['checks']} call" + ("s" if s["checks"] != 1 else "")
                print(f"  {label:<10} {s['config']:<16} B={s['batch_size']}: {calls}, {verdict}")
    print(f"\nPeak resident memory: {peak_memory_gib():.1f} GiB (this process's high-water mark, file-backed pages "
          "included)")


def _demo_phases(name: str, plan: dict, dtype, twin: bool, prepare: bool):
    """[(phase, configurations, load)]: each phase's rows run on one target, loaded when the phase starts. The eager
    target (stock generate before spec_adapt.prepare), the prepared target and its bfloat16 copy never share the
    memory: the demo fits a machine that holds one of them and the draft."""
    from spec_adapt.tools import bench as b
    from spec_adapt.tools.models import load_model

    def loader(as_dtype, packed):
        def load():
            # The cached checkpoint is float32: another dtype is converted tensor by tensor, each float32 tensor's
            # file pages handed back as it goes (from_pretrained would hold the whole file resident beside the copy).
            model = load_model(name, dtype=torch.float32)[0]
            if as_dtype != torch.float32:
                from spec_adapt.execution import convert_paging_out

                convert_paging_out(model, as_dtype)
            if packed:
                from spec_adapt import prepare

                prepare(model)
            return model

        return load

    main = plan["configs"]
    phases = [("eager", ["target-eager"], loader(dtype, False))] if prepare else []
    phases.append(("prepared" if prepare else "target", main, loader(dtype, prepare)))
    if twin:
        phases.append(("bfloat16 copy", [main[0] + b.TWIN, main[-1] + b.TWIN], loader(torch.bfloat16, prepare)))
    return phases


def peak_memory_gib() -> float:
    """This process's peak resident memory (the kernel's high-water mark, as /usr/bin/time -v reports it)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20      # KiB on Linux


def bench(args) -> None:
    from pathlib import Path

    from spec_adapt.tools import bench as b
    from spec_adapt.tools.models import load_model
    from spec_adapt.recipes import workloads

    configs = _bench_configs(args)
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype=dtype, **_offload(args))
    twin = _twin(model, configs)
    draft, xdraft = draft_from_args(model, args), _xdraft(args)
    if args.bound is not None and (draft is None or 1 not in args.batch_sizes):
        print("--bound: the hindsight bound needs a draft model (--draft or --draft-layers) and batch size 1; "
              "the 'of bound' column stays empty")
    if args.prepare:
        from spec_adapt import prepare

        model, draft = prepare(model), prepare(draft) if draft is not None else None
        twin = prepare(twin) if twin is not None else None
        configs = [c for c in configs if c != "target-eager"]
        if not args.no_eager:
            configs.insert(1 if "target" in configs else 0, "target-eager")
    ds = workloads.with_inputs(workloads.load(args.prompts or args.workload, args.num_prompts), tok)
    prompts = list(ds["input_text"])
    if max(args.batch_sizes) > len(prompts):      # a workload can hold fewer prompts than --num-prompts asks
        raise SystemExit(f"argument --batch-sizes: takes batch sizes of at most the {len(prompts)} prompts "
                         f"{args.prompts or args.workload} gave, got {max(args.batch_sizes)}")
    from spec_adapt.tools.profiling import LatencyTable

    latency = LatencyTable.load(args.latency) if args.latency else None
    cells = b.run_bench(model, tok, prompts, configs, args.batch_sizes, args.new_tokens, args.repeats, draft,
                        rows=args.rows, latency=latency, ignore_eos=args.ignore_eos, policy_state=args.policy_state,
                        xdraft=xdraft, bound=args.bound, twin=twin)
    summary = b.summarize(cells)
    b.print_table(summary, b.run_bound(cells))
    name = Path(args.prompts).stem if args.prompts else args.workload
    meta = {"workload": name, "model": args.model, "draft": args.draft, "xdraft": args.xdraft, "dtype": args.dtype,
            "prepared": args.prepare, "cpu": cpu_name(), "target_memory_mb": args.target_memory,
            "device_map": getattr(model, "hf_device_map", None),
            **_draft_meta(draft, args), "policy_state": args.policy_state, "new_tokens": args.new_tokens,
            "prompts": len(prompts), "repeats": args.repeats, "bound_max_width": args.bound,
            "command": "spec-adapt " + " ".join(args.argv)}
    out = Path(args.out or f"results/bench-{name}-{args.dtype}")
    b.write_results(cells, summary, out, meta)
    print(f"\nwrote {out}/summary.json, summary.csv, traces.json, bench.png")


def _twin(model, configs: list[str]):
    """The target's bfloat16 copy where a configuration runs on it (<config>@bf16), else None."""
    from spec_adapt.tools import bench as b

    return b.bf16_twin(model) if any(b.is_twin(c) for c in configs) else None


def _bench_configs(args) -> list[str]:
    """--configs, with a cold row beside each default-policy configuration under --cold (the numbers are checked by
    their argument types and `_check_bench`, before any command runs)."""
    from spec_adapt.tools import bench as b

    twins = [c for c in args.configs if b.is_twin(c)]
    if twins and (args.target_memory is not None or args.dtype != "float32"):
        raise SystemExit(f"{', '.join(twins)}: the {b.TWIN} configurations run a bfloat16 copy beside a float32 "
                         "target held in memory; drop --target-memory and --dtype, or the suffix")
    if not args.cold:
        return list(args.configs)
    try:
        return b.cold_rows(args.configs)
    except ValueError as exc:
        raise SystemExit(f"--cold: {exc}") from exc


def _offload(args) -> dict:
    """--target-memory: accelerate spreads the target over that much memory and the disk (weights beyond the cap
    stream from the offload folder at every forward)."""
    if args.target_memory is None:
        return {}
    import atexit
    import tempfile

    folder = args.offload_folder
    if folder is None:      # weights streamed from disk for the run's whole life; removed when it ends
        scratch = tempfile.TemporaryDirectory(prefix="spec_adapt-offload-")
        atexit.register(scratch.cleanup)
        folder = scratch.name
    return {"device_map": "auto", "max_memory": {"cpu": f"{args.target_memory}MiB"}, "offload_folder": folder}


def serve_bench_cmd(args) -> None:
    from pathlib import Path

    from spec_adapt.tools import serve_bench as sb
    from spec_adapt.tools.models import load_model
    from spec_adapt.recipes import workloads

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    draft = draft_from_args(model, args)
    ds = workloads.with_inputs(workloads.load(args.prompts or args.workload, args.num_prompts), tok)
    memory = int(args.memory_budget * 2**20) if args.memory_budget else None
    phases = sb.parse_phases(args.phases) if args.phases else None
    results = sb.run_serve_bench(model, tok, list(ds["input_text"]), args.configs, args.rates, args.duration,
                                 args.max_batch, args.new_tokens, draft, seed=args.seed, memory=memory,
                                 phases=phases)
    name = Path(args.prompts).stem if args.prompts else args.workload
    meta = {"workload": name, "model": args.model, "draft": args.draft, "dtype": args.dtype,
            **_draft_meta(draft, args), "max_batch": args.max_batch, "new_tokens": args.new_tokens,
            "duration": args.duration, "memory_budget_mb": args.memory_budget, "phases": args.phases,
            "command": "spec-adapt " + " ".join(args.argv)}
    out = Path(args.out or f"results/serve-{args.model}-{name}")
    rows = sb.write(results, out, meta)
    sb.print_table(rows)
    print(f"\nwrote {out}/summary.json, timeline.json, serve.png")


def cpu_name() -> str:
    """The CPU's model name and its bf16 / AMX flags (every benchmark names the machine it ran on)."""
    import platform
    import re
    from pathlib import Path

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", info)
    flags = sorted(set(re.findall(r"\b(amx\w*|avx512_bf16|avx512_vnni)\b", info)))
    return f"{model.group(1).strip() if model else platform.processor()} [{' '.join(flags) or 'no bf16/AMX flags'}]"


def _draft_meta(draft, args) -> dict:
    if draft is None:
        return {}
    megabytes = draft.get_memory_footprint() / 2**20
    print(f"draft: {megabytes:.0f} MB of weights")
    return {"draft_quant": args.draft_quant, "draft_dtype": str(draft.dtype).replace("torch.", ""),
            "draft_mb": megabytes}


def _xdraft(args):
    """--xdraft: (model, tokenizer) of a draft with its own tokenizer, in the dtype --draft-dtype picks."""
    from spec_adapt.tools.models import load_model

    if not args.xdraft:
        return None
    if args.draft_dtype == "fastest":
        model, tokenizer = load_model(args.xdraft, dtype=torch.float32)
        return fastest_draft(model, args.prepare), tokenizer
    model, tokenizer = load_model(args.xdraft, dtype=getattr(torch, args.draft_dtype or args.dtype))
    if args.prepare:
        from spec_adapt import prepare

        model = prepare(model)
    return model, tokenizer


def profile_cmd(args) -> None:
    from spec_adapt.tools.models import load_model
    from spec_adapt.tools.profiling import profile

    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype))
    draft = draft_from_args(model, args)
    if args.prepare:
        from spec_adapt import prepare

        model, draft = prepare(model), prepare(draft) if draft is not None else None
    table = profile(model, draft, args.batch_sizes, args.lengths, args.lags, args.context, args.repeats)
    table.meta.update({"model": args.model, "dtype": args.dtype, "prepared": args.prepare, "cpu": cpu_name(),
                       "draft": args.draft or
                       (f"first {args.draft_layers} layers" if args.draft_layers else None)})
    from spec_adapt.tools.profiling import profile_path

    out = args.out or profile_path(model, draft)   # default: the cache Adaptive.for_model / generate read
    table.save(out)
    print(f"\nT(B, s) in ms (verify s+1 tokens, context {args.context}):")
    print("   B " + "".join(f"{f's={s}':>9}" for s in args.lengths))
    for b in args.batch_sizes:
        print(f"{b:>4} " + "".join(f"{1000 * table.step[b][s]:>9.1f}" for s in args.lengths))
    if draft is not None:
        print("draft ms/token: " + ", ".join(f"B={b}: {1000 * t:.1f}" for b, t in table.draft_token.items()))
        print("c_prefill ms:   " + ", ".join(f"L={l},B={b}: {1000 * t:.1f}" for l, row in table.prefill.items()
                                              for b, t in row.items()))
    print(f"wrote {out}")


def lab_cmd(args) -> None:
    import json
    from pathlib import Path

    from spec_adapt.tools import lab
    from spec_adapt.tools.bench import parse_policy
    from spec_adapt.tools.profiling import LatencyTable

    out = Path(args.out or f"results/lab-{args.workload}-{args.drafter}")
    out.mkdir(parents=True, exist_ok=True)
    traces_path = Path(args.traces) if args.traces else out / "traces.json"
    if traces_path.exists():
        pool = [lab.Request(**r) for r in json.loads(traces_path.read_text())]
    else:
        pool = _record(args)
        traces_path.write_text(json.dumps([r.__dict__ for r in pool]))
    table = LatencyTable.load(args.latency)
    requests = [lab.Request(r.runs, name=r.name, lengths=r.lengths) for _ in range(args.cycles) for r in pool]
    report = {}
    for spec in args.schedules:         # options.Schedule: the text, its kind and its checked value
        schedule = {"static": lab.Static, "batches": lab.Batches, "poisson": lab.Poisson,
                    "curve": lambda rate: lab.RateCurve([(60.0, 0.5), (60.0, rate)])}[spec.kind](spec.value)
        policies = {name: parse_policy(name, table) for name in args.policies}
        # Model-free drafters cost nothing to run: only the verification part of the table applies.
        result = lab.compare(policies, requests, table, schedule, max_batch=args.max_batch, draft_cost=False)
        report[spec] = result
        _print_lab(spec, result)
    _plot_lab(report, out)
    summary = {spec: {"best_fixed_gamma": r["best_fixed_gamma"], "best_fixed_goodput": r["best_fixed"].goodput,
                      "oracle_goodput": r["oracle"].goodput,
                      "fixed": {g: x.goodput for g, x in r["fixed"].items()},
                      "policies": {n: {k: v for k, v in p.items() if k != "result"} for n, p in r["policies"].items()}}
               for spec, r in report.items()}
    summary["command"] = "spec-adapt " + " ".join(args.argv)
    (out / "lab.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}/lab.json, lab.png")


def _record(args):
    from spec_adapt import PromptLookupDrafter, SuffixDrafter
    from spec_adapt.drafters import SuffixIndex
    from spec_adapt.tools import lab
    from spec_adapt.tools.models import load_model
    from spec_adapt.recipes import workloads

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    prompts = list(workloads.with_inputs(workloads.load(args.workload, args.num_prompts), tok)["input_text"])
    drafter = {"lookup": lambda: PromptLookupDrafter(3, 2), "suffix": lambda: SuffixDrafter(SuffixIndex())}[args.drafter]()
    return lab.record_traces(model, tok, prompts, drafter, args.new_tokens)


def _print_lab(spec, result) -> None:
    print(f"\n[{spec}] best fixed gamma in hindsight: {result['best_fixed_gamma']} "
          f"({result['best_fixed'].goodput:.2f} tok/s); per-step oracle {result['oracle'].goodput:.2f} tok/s")
    print(f"{'policy':<18} {'tok/s':>8} {'vs best fixed':>14} {'vs oracle':>10} {'latency s':>10} {'switches':>9} "
          f"{'decision us':>12}")
    for name, row in result["policies"].items():
        print(f"{name:<18} {row['goodput']:>8.2f} {100 * row['vs_best_fixed']:>13.1f}% {100 * row['vs_oracle']:>9.1f}% "
              f"{row['mean_latency']:>10.2f} {row['switches']:>9} {1e6 * row['decision_time']:>12.1f}")


def _plot_lab(report, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(report), figsize=(6 * len(report), 8), squeeze=False)
    for col, (spec, result) in enumerate(report.items()):
        for name, row in result["policies"].items():
            history = row["result"].history
            window = max(1, len(history) // 100)
            xs = [h[0] for h in history][::window]
            ys = [sum(h[2] for h in history[i : i + window]) / len(history[i : i + window])
                  for i in range(0, len(history), window)]
            axes[0][col].plot(xs, ys, label=name, lw=1)
            curve = row["result"].regret_curve
            axes[1][col].plot([c[0] for c in curve], [c[1] for c in curve], label=name, lw=1)
        axes[0][col].set(title=f"{spec}: mean gamma chosen", xlabel="simulated seconds", ylabel="gamma")
        axes[1][col].set(title=f"{spec}: regret vs best fixed gamma", xlabel="step", ylabel="extra seconds")
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "lab.png", dpi=100)
    plt.close(fig)


def eval_cmd(args) -> None:
    from pathlib import Path

    from spec_adapt.eval.lossy import LossyTopK
    from spec_adapt.eval.suite import Config, default_configs, run_suite, write_report
    from spec_adapt.tools.models import load_model
    from spec_adapt.recipes import workloads

    model, tok = load_model(args.model)
    names = args.workloads
    prompts = []
    for name in names:
        ds = workloads.with_inputs(workloads.load(name, args.num_prompts), tok)
        prompts += list(ds["input_text"])
    configs = default_configs()
    if args.with_lossy:
        fixed = configs[1]
        configs.append(Config("lossy-top5", fixed.drafter, fixed.policy, LossyTopK(5)))
    report = run_suite(model, tok, prompts, configs, args.new_tokens, args.batch_size, args.temperature,
                       reward_model=args.reward_model)
    out = Path(args.out)
    meta = {"workload": "+".join(names), "command": "spec-adapt " + " ".join(args.argv)}
    write_report(report, out, meta)
    print((out / "quality.md").read_text())
    print(f"wrote {out}/quality.json, quality.md, quality.png")


def export_vllm_cmd(args) -> None:
    import json
    from pathlib import Path

    from spec_adapt.policies import Adaptive
    from spec_adapt.tools.vllm import speculative_config

    config = speculative_config(Adaptive.load(args.policy), args.method, args.model, args.max_batch)
    text = json.dumps(config, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")
    print(text)


def soak_cmd(args) -> None:
    import json
    from pathlib import Path

    from spec_adapt.tools import soak

    print(f"CPU: {cpu_name()}")
    report = soak.run_soak(args.requests, args.max_batch, args.drafter, args.window, args.check_every, args.seed,
                           policy=args.policy)
    report["cpu"], report["torch"], report["command"] = cpu_name(), torch.__version__, "spec-adapt " + " ".join(
        args.argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        soak.plot(report, out / "soak.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    print(f"served {report['requests']} requests; RSS growth from request {report.get('rss_from')} to the end: "
          f"{report.get('rss_growth_mb')} MB; time per request, last quarter / first quarter after warm-up: "
          f"{report.get('time_ratio_last_to_first')}; identical to stock: {report['identical']}/{report['checked']}; "
          f"drafter restarts: {report['restarts']}. Wrote {out}/soak.json and soak.png")


def main(argv=None) -> None:
    from spec_adapt.tools.models import known
    from spec_adapt.tools.vllm import METHODS

    parser = Parser(prog="spec-adapt", description="Adaptive, batched, lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the real pair on HumanEval + ShareGPT: stock generate, stock speculation, spec_adapt")
    p.add_argument("--model", default="qwen2.5-coder-1.5b", type=options.name_in(DEMOS, "a demo model",
                                                                             key=lambda name: known(name) or name),
                   help="qwen2.5-coder-1.5b (with its 0.5B draft) or smollm2-135m (the fast demo)")
    p.add_argument("--no-prepare", dest="prepare", action="store_false",
                   help="run the models eagerly (default: spec_adapt.prepare on target and draft)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the target's dtype (the draft's is chosen by this CPU's bf16 capability)")
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="configurations side by side on a workload (see spec_adapt/tools/bench.py)")
    p.add_argument("--workload", default="sharegpt", help="sharegpt, humaneval, humaneval-chat (HumanEval as a user message, for instruct models) or mixed")
    p.add_argument("--prompts", help="a JSONL file of prompts (overrides --workload)")
    p.add_argument("--num-prompts", type=options.count, default=16)
    p.add_argument("--rows", type=options.count, default=8, help="batch size B runs the first max(B, rows) prompts")
    p.add_argument("--latency", help="a latency table from `spec-adapt profile`, for the policies that use one")
    p.add_argument("--batch-sizes", type=options.batch_size, nargs="+", default=[1, 4, 16],
                   help="each at most --num-prompts")
    p.add_argument("--new-tokens", type=options.tokens, default=128)
    p.add_argument("--repeats", type=options.count, default=3)
    p.add_argument("--configs", nargs="+", default=["target", "hf-lookup", "lookup:fixed3", "suffix:heuristic4"])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--draft", help="a draft model path (enables draft:<policy>, chain:<policy> and hf-assisted)")
    p.add_argument("--xdraft", help="a draft with its own tokenizer (enables xdraft:<policy>, hf-uag, and with "
                   "--draft xchain:<policy>); its dtype follows --draft-dtype")
    draft_options(p)
    p.add_argument("--draft-layers", type=options.count, help="draft = the target's first N layers (a cost stand-in)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--ignore-eos", action="store_true", help="every row generates exactly --new-tokens")
    p.add_argument("--prepare", action="store_true", help="spec_adapt.prepare target and draft; adds target-eager "
                   "(stock generate on the unprepared model) beside target (stock generate on the prepared one)")
    p.add_argument("--no-eager", action="store_true", help="with --prepare, leave target-eager out (compare "
                   "configurations on the prepared models only)")
    p.add_argument("--target-memory", type=options.megabytes, help="MiB of memory the target may hold: accelerate "
                   "offloads the rest to disk (device_map='auto', max_memory), so its weights stream at every forward")
    p.add_argument("--offload-folder", help="where accelerate writes the offloaded weights (default: a temp folder)")
    p.add_argument("--policy-state", help="a folder: each cell's policy starts from the state a previous run saved "
                   "there (warm; cold if none) and is saved there afterwards")
    p.add_argument("--bound", type=options.bound_width, nargs="?", const=8, metavar="MAX_WIDTH",
                   help="at batch 1 with a draft: the hindsight bound of draft-length schedules up to MAX_WIDTH "
                   "(default 8) and each configuration's fraction of its speedup ('of bound'; docs/benchmarks.md)")
    p.add_argument("--cold", action="store_true", help="beside each <drafter>:adaptive configuration, a row "
                   "'<config> (cold)' whose every call starts from a fresh policy (the plain row: later calls, warm)")
    p.add_argument("--out", help="output folder (default results/bench-<workload>-<dtype>)")
    p.set_defaults(func=bench, check=_check_bench)
    p = sub.add_parser("profile", help="measure T(B, s), draft cost and c_prefill(L, B) on this machine")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--draft", help="draft model path")
    draft_options(p)
    p.add_argument("--draft-layers", type=options.count,
                   help="use the target's first N layers as a draft (cost stand-in)")
    p.add_argument("--batch-sizes", type=options.batch_size, nargs="+", default=[1, 4, 16])
    p.add_argument("--lengths", type=options.draft_length, nargs="+", default=[0, 1, 2, 4, 8],
                   help="draft lengths s: a step verifies s + 1 tokens")
    p.add_argument("--lags", type=options.tokens, nargs="+", default=[32, 128, 512],
                   help="tokens a draft catches up on (with a draft)")
    p.add_argument("--context", type=options.tokens, default=256, help="tokens in the cache before each measured step")
    p.add_argument("--repeats", type=options.count, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prepare", action="store_true", help="profile the models after spec_adapt.prepare (a prepared "
                   "model has its own profile: the default policy of a prepared model reads that one)")
    p.add_argument("--out", help="output JSON (default: the profile cache, ~/.cache/spec_adapt/profiles/<model, draft, "
                   "dtype, device>.json, which Adaptive.for_model and spec_adapt.generate's default policy load)")
    p.set_defaults(func=profile_cmd)
    p = sub.add_parser("lab", help="replay recorded acceptance traces: every policy vs best fixed gamma and oracle")
    p.add_argument("--workload", default="humaneval")
    p.add_argument("--num-prompts", type=options.count, default=16)
    p.add_argument("--drafter", choices=["lookup", "suffix"], default="suffix")
    p.add_argument("--new-tokens", type=options.tokens, default=128)
    p.add_argument("--traces", help="traces JSON to replay (default: <out>/traces.json, recorded if missing)")
    p.add_argument("--latency", required=True, help="latency table from `spec-adapt profile`")
    p.add_argument("--schedules", nargs="+", type=options.schedule,
                   default=[options.schedule(s) for s in ("static:1", "static:4", "static:16", "curve:20")],
                   help="static:B (B running, refilled), batches:B (closed batches: generate calls), poisson:RATE, "
                        "curve:RATE (RATE requests/s, finite and positive)")
    p.add_argument("--policies", nargs="+", default=["nightjar", "nightjar-local", "ucb", "goodput",
                                                     "goodput-explore", "ewma", "per-request", "heuristic4"])
    p.add_argument("--cycles", type=options.cycles, default=20, help="replay the recorded requests this many times")
    p.add_argument("--max-batch", type=options.batch_size, default=16, help="most requests running under poisson and "
                   "curve schedules")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out")
    p.set_defaults(func=lab_cmd)
    p = sub.add_parser("serve-bench", help="the serving engine under Poisson arrivals: throughput, TTFT, TPOT")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", help="draft model (enables draft:<policy>, draftc:<policy>, chain:<policy>)")
    draft_options(p)
    p.add_argument("--draft-layers", type=options.count, help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--workload", default="sharegpt", help="sharegpt, humaneval, humaneval-chat or mixed")
    p.add_argument("--prompts", help="a JSONL file of prompts (overrides --workload)")
    p.add_argument("--num-prompts", type=options.count, default=64)
    p.add_argument("--rates", type=options.rate, nargs="+", default=[0.25, 1.0, 4.0],
                   help="requests per second (rate x duration: at most a million arrivals)")
    p.add_argument("--duration", type=options.seconds, default=30.0, help="seconds of arrivals per (rate, config)")
    p.add_argument("--max-batch", type=options.batch_size, default=8)
    p.add_argument("--memory-budget", type=options.budget_mb, help="MB the engine may use (weights, resident draft, "
                   "KV reserved per request): admission waits for memory; drafter 'offload' leaves under pressure")
    p.add_argument("--phases", type=options.phases, help="a load that changes: RATE:SECONDS pairs, e.g. "
                   "0.1:30,1.5:30,0.1:30 (replaces --rates/--duration)")
    p.add_argument("--new-tokens", type=options.tokens, default=64)
    p.add_argument("--seed", type=options.seed, default=0)
    p.add_argument("--configs", nargs="+", default=["target", "lookup:fixed1", "lookup:fixed3", "lookup:adaptive",
                                                    "lookup:nightjar"])
    p.add_argument("--out")
    p.set_defaults(func=serve_bench_cmd, check=_check_serve_bench)
    p = sub.add_parser("export-vllm", help="a learned Adaptive (saved with .save) as vLLM's speculative_config")
    p.add_argument("--policy", required=True, help="a JSON file written by Adaptive.save")
    p.add_argument("--method", default="draft_model", type=options.name_in(METHODS, "one of vLLM's methods"),
                   help="vLLM's method: " + ", ".join(METHODS))
    p.add_argument("--model", help="the draft model's path, for model-based methods")
    p.add_argument("--max-batch", type=options.batch_size, default=256)
    p.add_argument("--out", help="write the config here as JSON (it is printed either way)")
    p.set_defaults(func=export_vllm_cmd)
    p = sub.add_parser("soak", help="the serving engine's thread serves many requests: memory and time per request")
    p.add_argument("--requests", type=options.count, default=20000)
    p.add_argument("--max-batch", type=options.batch_size, default=8)
    p.add_argument("--drafter", choices=["model", "lookup", "suffix"], default="model")
    p.add_argument("--policy", default="adaptive", help="adaptive (learns while it serves) or fixed<k>")
    p.add_argument("--window", type=options.count, default=500, help="requests per measurement point")
    p.add_argument("--check-every", type=options.count, default=100,
                   help="compare every Nth request with stock generate")
    p.add_argument("--seed", type=options.seed, default=0)
    p.add_argument("--out", default="results/soak-tiny")
    p.set_defaults(func=soak_cmd)
    p = sub.add_parser("eval", help="quality suite: BERTScore, cosine, reward deltas vs target-only and fixed-length")
    p.add_argument("--workloads", nargs="+", default=["sharegpt", "humaneval"])
    p.add_argument("--num-prompts", type=options.count, default=32, help="per workload")
    p.add_argument("--new-tokens", type=options.tokens, default=64)
    p.add_argument("--batch-size", type=options.batch_size, default=16)
    p.add_argument("--temperature", type=options.temperature, default=0.7)
    p.add_argument("--reward-model", help="path of an AutoModelForSequenceClassification reward model")
    p.add_argument("--with-lossy", action="store_true", help="add the deliberately lossy top-5 configuration")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--out", default="results/quality")
    p.set_defaults(func=eval_cmd)
    serve.add_parser(sub, options)
    import sys

    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    torch.set_grad_enabled(False)
    # What a user can get wrong (a file that is not what an option takes, a value out of range) ends as argparse's
    # own errors do: one line on stderr, exit status 2. SPEC_ADAPT_TRACEBACK=1 shows the traceback instead.
    try:
        if hasattr(args, "check"):          # what one option's type cannot see: options read together
            args.check(args)
        args.func(args)
    except SystemExit as exc:
        if not isinstance(exc.code, str):       # a status: what the command chose
            raise
        _user_error(exc.code, exc)              # a command's own check of its options
    except (OSError, ValueError, TypeError) as exc:      # json.JSONDecodeError is a ValueError
        if os.environ.get("SPEC_ADAPT_TRACEBACK", "").strip() not in ("", "0"):
            raise
        _user_error(str(exc) or type(exc).__name__, exc)


def _check_bench(args) -> None:
    """Batch size B runs whole batches of B among the first prompts: a B above --num-prompts would run none."""
    if max(args.batch_sizes) > args.num_prompts:
        raise SystemExit(f"argument --batch-sizes: takes batch sizes of at most --num-prompts ({args.num_prompts}), "
                         f"got {max(args.batch_sizes)}")


def _check_serve_bench(args) -> None:
    """Each rate's schedule of --duration seconds is drawn whole before its first request is served."""
    expected = max(args.rates) * args.duration
    if args.phases is None and expected > options.MAX_ARRIVALS:      # --phases checks its own
        raise SystemExit(f"argument --rates/--duration: {options.ARRIVALS}, got {max(args.rates):g} requests/s for "
                         f"{args.duration:g} s ({expected:.3g} arrivals)")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are `spec-adapt`'s: one line `spec-adapt: error: <message>` on stderr, exit status 2
    (no usage block: --help shows it)."""

    def error(self, message: str):
        _user_error(message, argparse.ArgumentError(None, message))


class UserError(SystemExit):
    """Exit status 2 after `spec-adapt: error: <message>` went to stderr; str() is the message."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _user_error(message: str, cause: BaseException):
    import sys

    message = " ".join(message.split())         # one line
    print(f"spec-adapt: error: {message}", file=sys.stderr)
    raise UserError(message) from cause


if __name__ == "__main__":
    main()
