"""Replay the several-source router offline: the real `MultiSourceDrafter` over recorded outputs, no forward.

    python benchmarks/router_replay.py --workloads edit humaneval-chat --num-prompts 6 --new-tokens 48
    python benchmarks/router_replay.py --smoke    # tiny random models, traces kept in a temporary folder

Greedy output does not depend on what is drafted, so one stock `generate` per prompt fixes it, and one teacher-forced
forward of the draft model gives, at every output position t, how many tokens from t the draft model would predict
in a row (`spec_adapt.tools.bound.agreement_runs`). The replay then runs the router step by step: prompt lookup and
the suffix index propose from the committed tokens as they do in a call; the draft model's place is taken by a
scripted drafter that is right exactly as far as the draft model would be; every offer is judged and learned from as
in a call. A step's seconds are modelled, not timed (a line per verification and per draft token, `--verify` and
`--draft`; the defaults are this repository's float32 pair on a 2-core AMD EPYC, read off `spec-adapt bench`
traces), so a run is the same on any machine and under any load: it compares router rules, and a rule it favours
is then measured with `spec-adapt bench`.

Printed per workload: the speedup over plain decoding (the same modelled costs) of the draft model alone at fixed
widths, prompt lookup alone, the default (model, lookup, suffix) at fixed model widths, and the several-source
hindsight bound (`several_sources_schedule`: the best source and width per step, knowing the future). The draft
model's catch-up after free steps is not charged, so the default is, if anything, flattered against the model alone.
The recorded outputs are cached (`--traces`), so a second run loads no model.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

from spec_adapt.drafters import MultiSourceDrafter, PromptLookupDrafter, ScriptedDrafter, SourceState, SuffixDrafter
from spec_adapt.drafters import SuffixIndex
from spec_adapt.drafters.drafter import DraftRequest, Observes
from spec_adapt.metrics import StepRecord
from spec_adapt.policies.cost import CostReader, StepCost
from spec_adapt.processors import ScoreProcessor
from spec_adapt.tools.bound import lookup_runs, several_sources_schedule

import _smoke


class Costs:
    """Modelled seconds: a verification of w tokens a + b (w - 1), k draft tokens c + d k (0 for none)."""

    def __init__(self, verify: tuple[float, float], draft: tuple[float, float], widest: int = 40):
        self.a, self.b = verify
        self.c, self.d = draft
        cost = StepCost()
        for w in range(1, widest + 1):
            for _ in range(3):                 # the step-cost model reads a width once it has 3 samples
                cost.observe_verify(1, w, self.verify(w))
        for k in range(1, 9):
            for _ in range(3):
                cost.observe_draft("model", 1, k, self.draft(k))
        self.reader = CostReader(cost, threading.Lock())

    def verify(self, fed: int) -> float:
        return self.a + self.b * (fed - 1)

    def draft(self, tokens: int) -> float:
        return self.c + self.d * tokens if tokens else 0.0


def record(model_name: str, draft_name: str, workloads: list[str], prompts: int, new_tokens: int,
           traces: dict | None = None) -> dict:
    """Per prompt: its tokens, the target's greedy output and the draft model's agreement runs along it (`traces`:
    what an earlier run recorded, kept; only the prompts it lacks are generated)."""
    from spec_adapt import prepare
    from spec_adapt.loading import load_model
    from spec_adapt.recipes import workloads as recipes
    from spec_adapt.tools.bound import agreement_runs
    from tqdm import tqdm

    model, tok = load_model(model_name)
    draft, _ = load_model(draft_name)
    model = prepare(model)
    traces = dict(traces or {})
    for name in workloads:
        texts = recipes.with_inputs(recipes.load(name, prompts), tok)["input_text"]
        for i, text in enumerate(tqdm(texts, desc=f"recording {name}")):
            if f"{name}-{i}" in traces:
                continue
            ids = tok(text, return_tensors="pt").input_ids
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
            traces[f"{name}-{i}"] = {"prompt": ids[0].tolist(), "output": out.tolist(),
                                     "runs": agreement_runs(draft, ids[0], out, model.config.vocab_size)}
    return traces


def model_script(trace: dict):
    """The draft model's stand-in: right for as many tokens as the draft model would be, then one wrong token."""
    start, out, runs = len(trace["prompt"]), trace["output"], trace["runs"]

    def script(row, context, gamma):
        t = len(context) - start
        right = out[t: t + min(runs[t], gamma)]
        if len(right) < gamma and t + len(right) < len(out):
            right = right + [out[t + len(right)] + 1]          # any other token: rejected
        return right[:gamma]
    return script


def replay(trace: dict, drafter, width: int, costs: Costs) -> dict:
    """One call through `drafter` with the model asked for `width` tokens a step: seconds, steps, and per source
    [steps, drafted, accepted]."""
    prompt, out = trace["prompt"], trace["output"]
    start, n = len(prompt), len(out)
    full, process = prompt + out, ScoreProcessor(None)
    drafter.begin(torch.tensor([prompt]), None)
    committed, seconds, steps, sources = start + 1, 0.0, 0, {}
    most = getattr(drafter, "max_free", 0)
    while committed < start + n:
        buffer = torch.zeros(1, start + n + 1, dtype=torch.long)
        buffer[0, :committed] = torch.tensor(full[:committed])
        left = start + n - committed
        request = DraftRequest(buffer, torch.tensor([committed]), torch.tensor([min(width, left - 1)]),
                               torch.tensor([0]), False, process, cost=costs.reader,
                               free=torch.tensor([min(left - 1, most)]) if most else None)
        proposal = drafter.propose(request)
        k, t = int(proposal.lengths[0]), committed - start
        drafts = proposal.tokens[0, :k].tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == out[t + accepted]:
            accepted += 1
        source = ((proposal.telemetry or {}).get("source") or ["model"])[0] if k else None
        draft_s, verify_s = costs.draft(k) if source == "model" else 0.0, costs.verify(k + 1)
        seconds += draft_s + verify_s
        steps += 1
        entry = sources.setdefault(source or "plain", [0, 0, 0])
        for i, value in enumerate((1, k, accepted)):
            entry[i] += value
        drafter.rollback(torch.tensor([committed + accepted]))
        if isinstance(drafter, Observes):       # a drafter that learns from each step's record
            drafter.observe(StepRecord(1, [0], [width], [k], [accepted], [min(accepted + 1, left)],
                                       draft_s + verify_s, draft_s, verify_s, telemetry=proposal.telemetry,
                                       free=proposal.free.tolist() if proposal.free is not None else None))
        committed += min(accepted + 1, left)
    drafter.end(torch.tensor([full]), torch.tensor([len(full)]))
    return {"seconds": seconds, "steps": steps, "sources": sources}


def bound(trace: dict, costs: Costs, max_free: int = 32) -> float:
    n = len(trace["output"])
    runs = trace["runs"][:n] + [0]
    free = lookup_runs(torch.tensor(trace["prompt"]), torch.tensor(trace["output"]), max_free)
    with_draft = [costs.verify(g + 1) + costs.draft(g) for g in range(9)]
    return several_sources_schedule(runs, free, with_draft, [costs.verify(g + 1) for g in range(max_free + 1)],
                                    0.0)[0]


def configurations(widths: list[int]) -> dict:
    """name -> (fn(trace, shared state) -> drafter, model width)."""
    configs = {f"draft model alone, width {g}": (lambda tr, state: ScriptedDrafter(model_script(tr)), g)
               for g in widths}
    configs["prompt lookup alone"] = (lambda tr, state: MultiSourceDrafter(None, [PromptLookupDrafter()],
                                                                           state=state), 0)
    for g in widths:
        configs[f"several sources, model width {g}"] = (
            lambda tr, state: MultiSourceDrafter(ScriptedDrafter(model_script(tr)),
                                                 [PromptLookupDrafter(), SuffixDrafter(SuffixIndex())], state=state), g)
    return configs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--workloads", nargs="+", default=["edit", "humaneval-chat"])
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--verify", type=float, nargs=2, default=[0.29, 0.02], metavar=("A", "B"),
                        help="a verification of w tokens costs A + B (w - 1) seconds")
    parser.add_argument("--draft-cost", type=float, nargs=2, default=[0.02, 0.11], metavar=("C", "D"),
                        help="k draft tokens cost C + D k seconds")
    parser.add_argument("--traces", type=Path, default=None,
                        help="recorded outputs (read; prompts it lacks are recorded and added)")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(argv), globals(), workloads=["edit"], num_prompts=1, new_tokens=12,
                        widths=[2], traces=Path(_smoke.folder("traces.json")), out=Path(_smoke.folder("replay.json")))
    path = args.traces or Path.home() / ".cache" / "spec_adapt" / (
        f"router-replay-{args.model}-{args.draft}-{args.new_tokens}.json")
    traces = json.loads(path.read_text()) if path.exists() else {}
    wanted = [f"{w}-{i}" for w in args.workloads for i in range(args.num_prompts)]
    if any(key not in traces for key in wanted):
        traces = record(args.model, args.draft, args.workloads, args.num_prompts, args.new_tokens, traces)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(traces))
    traces = {key: traces[key] for key in wanted}
    costs = Costs(tuple(args.verify), tuple(args.draft_cost))
    results = {}
    for workload in args.workloads:
        keys = [k for k in traces if k.rsplit("-", 1)[0] == workload]
        plain = sum((len(traces[k]["output"]) - 1) * costs.verify(1) for k in keys)
        rows = {}
        for name, (make, width) in configurations(args.widths).items():
            state = SourceState()                 # shared across the workload's prompts, as the default's is
            done = [replay(traces[k], make(traces[k], state), width, costs) for k in keys]
            rows[name] = plain / sum(d["seconds"] for d in done)
        rows["several-source bound (hindsight)"] = plain / sum(bound(traces[k], costs) for k in keys)
        results[workload] = rows
        print(f"{workload}: {len(keys)} prompts, {args.new_tokens} new tokens, modelled costs "
              f"(verify {args.verify[0]} + {args.verify[1]} (w - 1) s, draft {args.draft_cost[0]} + "
              f"{args.draft_cost[1]} k s); speedup over plain decoding")
        for name, speedup in rows.items():
            print(f"  {name:<36} {speedup:5.2f}x")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
