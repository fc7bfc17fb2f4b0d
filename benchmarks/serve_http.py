"""Three OpenAI-compatible servers under the same load, over HTTP, on one machine, in one run:

- `spec`: `spec-adapt serve` with the draft (the Qwen2.5-Coder pair by default: adaptive speculation, per row);
- `off`:  the same server with speculation off (`--drafter none`: its continuous batching, plain decoding);
- `tf`:   `transformers serve --continuous-batching` on the same target (stock's server, paged cache, no speculation).

    python benchmarks/serve_http.py --out results/serve-http
    python benchmarks/serve_http.py --smoke       # tiny random models, our two servers, seconds

Our two servers are prepared (`spec_adapt.prepare`; `--no-prepare` runs them eagerly) and the draft computes in
`--draft-dtype` (default fastest), as `make bench` runs the pair; transformers serve runs the target as it loads.
The servers run one at a time (each alone on the machine: two at once would share its cores), each started, loaded
and warmed by one request before its loads. Every server gets the same client (spec_adapt.tools.http_bench: the
`openai` client, streamed chat completions, greedy), the same prompts (HumanEval as chat, ShareGPT first turns and
the `edit` workload, interleaved; each load its own, so no load repeats an earlier one's) and the same loads: closed loops at concurrency 1, 4 and 16, then Poisson arrivals
at each rate. Writes summary.json (every row, the command, the CPU) and serve_http.png (throughput against arrival
rate; time per output token at p50/p90/p99 against concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import _smoke

SERVERS = ("spec", "off", "tf")
WARM = "Say hello."           # the request each server answers before its loads (no workload prompt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(kind: str, model: str, draft: str, port: int, args) -> list[str]:
    if kind == "tf":
        return ["transformers", "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                "--port", str(port), "--host", "127.0.0.1", model]
    spec = ["--draft", draft, "--draft-dtype", args.draft_dtype] if kind == "spec" else ["--drafter", "none"]
    return [sys.executable, "-m", "spec_adapt.tools.cli", "serve", "--model", model, *spec, "--served-name", "served",
            "--port", str(port), "--max-batch", str(args.max_batch), "--max-waiting", "1024",
            *([] if args.prepare else ["--no-prepare"])]


def wait_healthy(url: str, proc, seconds: float = 900) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"no answer from {url}/health in {seconds:.0f} s")


def serve_and_load(kind, args, prompts, model_path, draft_path, log) -> list[dict]:
    from spec_adapt.tools import http_bench
    from tqdm import tqdm

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(command(kind, model_path, draft_path, port, args), stdout=log, stderr=log,
                            env={**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
    try:
        wait_healthy(url, proc)
        name = "served" if kind != "tf" else model_path
        http_bench.run(url, name, [WARM], args.new_tokens, concurrencies=(1,), requests_per_load=1)  # warm up
        loads = len(args.concurrency) + len(args.rates)
        with tqdm(total=loads, desc=kind, unit="load") as bar:
            rows = http_bench.run(url, name, prompts, args.new_tokens, args.concurrency, args.rates,
                                  args.requests, progress=lambda row: bar.update(1))
        return [{"server": kind, **row} for row in rows]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def torch_threads() -> int:
    """The threads each server computes with (OMP_NUM_THREADS, else torch's default: the cores)."""
    import torch

    return int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())


def prompts_of(workloads: list[str], n: int) -> list[str]:
    from spec_adapt.recipes import workloads as w

    sets = [list(w.load(name, n)["prompt"]) for name in workloads]
    return [p for group in zip(*sets) for p in group]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for color, server in zip(("tab:blue", "tab:orange", "tab:green"), dict.fromkeys(r["server"] for r in rows)):
        rate = [r for r in rows if r["server"] == server and r["load"] == "rate"]
        a.plot([r["value"] for r in rate], [r["tokens_per_s"] for r in rate], "o-", color=color, label=server)
        conc = [r for r in rows if r["server"] == server and r["load"] == "concurrency"]
        for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
            b.plot([r["value"] for r in conc], [(r[f"tpot_p{q}"] or 0) * 1000 for r in conc], style, color=color,
                   label=f"{server} p{q}")
    a.set(xlabel="arrival rate (requests/s)", ylabel="output tokens/s", title="throughput under Poisson arrivals")
    b.set(xlabel="concurrency (closed loop)", ylabel="time per output token (ms)", xscale="log",
          title="time per output token")
    a.legend()
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--workloads", nargs="+", default=["humaneval-chat", "sharegpt", "edit"])
    p.add_argument("--num-prompts", type=int, default=16, help="per workload (enough for every load's own)")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--rates", type=float, nargs="*", default=[0.05, 0.2, 0.8])
    p.add_argument("--requests", type=int, default=16, help="requests per load (at least the concurrency)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--draft-dtype", choices=["float32", "bfloat16", "fastest"], default="fastest",
                   help="the spec server's draft dtype (as `make bench` loads it)")
    p.add_argument("--no-prepare", dest="prepare", action="store_false",
                   help="serve the target (ours, with and without speculation) unprepared; transformers serve is "
                        "never prepared")
    p.add_argument("--out", default="results/serve-http")
    _smoke.add(p)
    args = p.parse_args()
    if args.smoke:
        args = _smoke.apply(args, servers=["spec", "off"], num_prompts=2, concurrency=[1, 2], rates=[5.0],
                            requests=2, new_tokens=4, max_batch=2, out=_smoke.folder())
    from spec_adapt.loading import cached_safetensors, known
    from spec_adapt.tools.cli import cpu_name

    def folder_of(name):          # a known name's safetensors folder, which transformers serve loads too
        return str(cached_safetensors(known(name))) if known(name) else name

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        model_path = draft_path = str(out / "tiny")
        _smoke.target().save_pretrained(model_path)
        _smoke.tokenizer().save_pretrained(model_path)
    else:
        model_path, draft_path = folder_of(args.model), folder_of(args.draft)
    prompts = prompts_of(args.workloads, args.num_prompts)
    rows = []
    with open(out / "servers.log", "w") as log:
        for kind in args.servers:
            rows += serve_and_load(kind, args, prompts, model_path, draft_path, log)
    summary = {"command": "python " + " ".join(sys.argv), "cpu": cpu_name(), "model": args.model,
               "draft": args.draft, "workloads": args.workloads, "new_tokens": args.new_tokens,
               "max_batch": args.max_batch, "draft_dtype": args.draft_dtype, "prepared": args.prepare,
               "threads": torch_threads(), "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(rows, out / "serve_http.png")
    for r in rows:
        tpot = f"{r['tpot_p50'] * 1000:7.1f}" if r["tpot_p50"] else "      -"
        ttft = f"{r['ttft_p50']:6.2f}" if r["ttft_p50"] is not None else "     -"
        print(f"{r['server']:>5} {r['load']:>11} {r['value']:>6} tok/s {r['tokens_per_s']:7.2f} "
              f"tpot p50 {tpot} ms  ttft p50 {ttft} s  ok {r['answered']}/{r['requests']}")
    print(f"wrote {out}/summary.json and serve_http.png")


if __name__ == "__main__":
    main()
