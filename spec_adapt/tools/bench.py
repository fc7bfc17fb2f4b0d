"""`spec-adapt bench`: configurations side by side on a workload, at several batch sizes, in one process.

Every repeat runs every batch of prompts through every configuration in turn (interleaved, so machine noise hits
all of them alike). Reported per configuration and batch size: tokens/s, time per output token, acceptance
length, alpha, per-position acceptance, and the speedup over target-only (median and spread over repeats). Greedy
outputs are checked against target-only outputs. Acceptance traces (per step: batch size, gammas, drafted,
accepted) are saved for the policy lab.

Configuration names:
  target                        stock `generate`, target only (always included: the baseline)
  target-eager                  stock `generate` on the model as it was before `spec_adapt.prepare` (with --prepare:
                                the speedup over what the user had; identity is not judged across the two)
  none:fixed0                   spec_adapt's loop with no drafter (its overhead over stock generate; use --ignore-eos)
  hf-lookup                     stock transformers prompt lookup (prompt_lookup_num_tokens=10), batch size 1 only
  hf-assisted                   stock assisted generation with --draft, batch size 1 only
  hf-uag                        stock Universal Assisted Generation with --xdraft (its own tokenizer), batch size 1
  <drafter>:<policy>            spec_adapt; drafter in {none, lookup, suffix, draft, multi, draftc, draftp, draftpc,
                                wrong, draftb<k>, xdraft, xdraftc, xchain}, policy in {adaptive, adaptive-tree,
                                fixed<k>, tree<N>x<D>[p], heuristic[<initial>], nightjar, nightjar-local, ucb, goodput, goodput-explore, ewma,
                                per-request, chain} ("wrong" drafts tokens that are never right; draftc/draftp/
                                draftpc: the draft with the 0.4 confidence exit / a 32,768-token short head / both;
                                draftb<k>: the draft growing trees with branch k; tree<N>x<D>: FixedTree(N, D), "p"
                                pooled; adaptive-tree: Adaptive(trees=True)); xdraft: --xdraft, a draft with its own
                                tokenizer (CrossTokenizerDrafter) drafting the full width, xdraftc: with its default
                                0.4 confidence exit; xchain: [--xdraft -> --draft -> target]; draft: the draft
                                model alone (ModelDrafter); multi: the default for a draft model, MultiSourceDrafter
                                over it, prompt lookup and the suffix index (a fresh index per call)
  chain:<policy>                [prompt lookup -> --draft -> target]; policy "chain" = ChainScheduler over it
                                (suffix starts every call with an empty index: it never sees the outputs it is
                                measured on, so its numbers are those of a cold start)
  <config>@bf16                 any configuration above on a bfloat16 copy of the target (`twin=`; prepared when
                                the target is): judged against target@bf16 (stock `generate` on that copy, added
                                when missing), tie-aware; its speedup is over the float32 `target`, and "vs bf16
                                stock" over target@bf16
  <config> (cold)               a spec_adapt configuration whose every call starts from a fresh policy: each timed
                                call is a first call (`cold_rows` adds one beside each <drafter>:adaptive); the
                                plain row's policy carries what it learned from call to call (warm)

With a draft model at batch 1, `bound=` adds the hindsight bound of length schedules with that draft
(`spec_adapt.tools.bound`) and, per configuration, the fraction of the bound's speedup it reaches.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Cell:
    config: str
    batch_size: int
    times: list[float] = field(default_factory=list)       # per repeat, seconds for all batches
    tokens: list[int] = field(default_factory=list)        # per repeat, new tokens generated
    drafted: int = 0
    accepted: int = 0
    row_steps: int = 0
    step_tokens: int = 0
    per_position: list[list[int]] = field(default_factory=list)   # [drafted, accepted] per position
    identical: bool | None = True     # None: a configuration identity is not judged against (target-eager)
    checks: int = 0                   # outputs compared with the reference's, and how many of them differed
    differing: int = 0                # beyond ties (spec_adapt.identity): a failure
    tied: int = 0                     # outputs that differ only at the target's own near-ties
    ties: int = 0                     # tie positions in those outputs

    @property
    def verdict(self) -> str | None:
        """"identical", "tie-equivalent (k ties)" or "differs" (the identity rule's words); None: not judged."""
        if self.identical is None:
            return None
        if not self.identical:
            return "differs"
        return f"tie-equivalent ({self.ties} ties)" if self.tied else "identical"
    trace: list[dict] = field(default_factory=list)
    choices: list[tuple] = field(default_factory=list)     # a ChainScheduler's (batch size, chain, W) per step
    draft_seconds: float = 0.0     # drafting time of the steps that drafted
    draft_positions: int = 0       # per step, the longest row's draft: one draft-model forward per position
    verify_seconds: float = 0.0
    verify_steps: int = 0
    steps: int = 0
    plain_steps: int = 0           # steps the policy ran at gamma = 0 for every row
    verifier: dict = field(default_factory=dict)   # summed SpecStats.verifier counters (EarlyExitVerifier)
    warm: bool | None = None       # --policy-state: the policy started from a saved state (None: not applicable)
    bound: dict | None = None      # the hindsight bound on the same inputs (`bound.hindsight`; batch 1 with a draft)

    def add_stats(self, stats) -> None:
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.row_steps += stats.row_steps
        self.step_tokens += sum(sum(r.committed) for r in stats.trace)
        for i, (d, a) in enumerate(zip(stats.per_position_drafted, stats.per_position_accepted)):
            if i >= len(self.per_position):
                self.per_position.append([0, 0])
            self.per_position[i][0] += d
            self.per_position[i][1] += a
        self.steps += len(stats.trace)
        self.plain_steps += sum(max(r.gammas, default=0) == 0 for r in stats.trace)
        drafting = [r for r in stats.trace if max(r.drafted, default=0) > 0]
        self.draft_seconds += sum(r.draft_time for r in drafting)
        self.draft_positions += sum(max(r.drafted) for r in drafting)
        self.verify_seconds += sum(r.verify_time for r in drafting)
        self.verify_steps += len(drafting)
        for key, value in stats.verifier.items():
            if isinstance(value, int):
                self.verifier[key] = self.verifier.get(key, 0) + value
        self.trace.extend(
            {"batch_size": r.batch_size, "held": r.held, "gammas": r.gammas, "drafted": r.drafted,
             "accepted": r.accepted, "step_time": r.step_time, "source": (r.telemetry or {}).get("source")}
            for r in stats.trace
        )


def build_config(name: str, model, tok, new_tokens: int, draft=None, latency=None, ignore_eos=False, xdraft=None):
    """Return fn(encoded batch) -> (sequences, SpecStats | None), or None if the config cannot run. `ignore_eos`:
    every row generates exactly `new_tokens` (to measure the loop itself, e.g. its overhead at gamma = 0).
    `xdraft`: (model, tokenizer) of a draft with its own tokenizer. A spec_adapt name ending in COLD gets a fresh
    policy at every call."""
    import spec_adapt

    common = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    if ignore_eos:
        common["eos_token_id"] = None
    if name == "target":
        return lambda enc: (model.generate(**enc, **common), None)
    if name == "target-eager":
        from spec_adapt.execution import eager, prepared

        if not prepared(model):         # the model as loaded is the model before prepare (the demo's eager phase)
            return lambda enc: (model.generate(**enc, **common), None)

        def unprepared(enc):
            with eager(model):
                return model.generate(**enc, **common), None

        return unprepared
    if name == "hf-lookup":
        return lambda enc: (model.generate(**enc, **common, prompt_lookup_num_tokens=10), None)
    if name == "hf-assisted":
        if draft is None:
            return None
        return lambda enc: (model.generate(**enc, **common, assistant_model=draft), None)
    if name == "hf-uag":
        if xdraft is None:
            return None
        return lambda enc: (model.generate(**enc, **common, assistant_model=xdraft[0], tokenizer=tok,
                                           assistant_tokenizer=xdraft[1]), None)
    cold = name.endswith(COLD)
    drafter_name, policy_name, verify_name = split_config(name)
    verifier = parse_verifier(verify_name)
    make_drafter = drafter_factory(drafter_name, tok, draft, xdraft)
    # One policy object per configuration: what it learns carries over from call to call, as in serving.
    if policy_name == "chain":            # the scheduler steers one chain object, kept across calls
        chain = make_drafter()
        fresh = lambda: spec_adapt.ChainScheduler(chain)      # noqa: E731
        make_drafter = lambda: chain      # noqa: E731
    else:
        fresh = lambda: parse_policy(policy_name or "heuristic", latency)      # noqa: E731

    def run(enc):
        if cold:                          # a cold row never learns across calls: each call is a policy's first
            run.policy = fresh()
        out = model.generate(**enc, **common, custom_generate=spec_adapt.generate, drafter=make_drafter(),
                             assistant_policy=run.policy, verifier=verifier)
        return out, spec_adapt.last_stats()

    run.policy, run.cold = fresh(), cold
    return run


COLD = " (cold)"     # the suffix of a configuration whose every call starts from a fresh policy
TWIN = "@bf16"       # the suffix of a configuration run on the target's bfloat16 copy


def is_twin(name: str) -> bool:
    return TWIN in name


def on_target(name: str) -> str:
    """The configuration as it runs on whichever copy of the target (multi:adaptive@bf16 (cold) ->
    multi:adaptive (cold))."""
    return name.replace(TWIN, "")


def ordered_configs(configs: list[str], reference: bool = True) -> list[str]:
    """The run's configurations in timing order: `target` first (the float32 reference; left out with
    `reference=False`, for a run that adds rows to a table whose reference ran apart), then, where any configuration
    runs on the bf16 copy, target@bf16 (that copy's reference), then the rest as given."""
    names = (["target"] if reference or "target" in configs else []) + [c for c in configs if c != "target"]
    if any(is_twin(name) for name in names):
        names = names[:1] + ["target" + TWIN] + [c for c in names[1:] if c != "target" + TWIN]
    return names


def bf16_twin(model):
    """A bfloat16 copy of an unprepared float32 target, for the <config>@bf16 configurations (prepare it as the
    target is). A user with a CPU that computes bf16 natively (`spec_adapt.execution.native_bf16`) runs the target
    this way: its stock `generate` is the baseline there."""
    import copy

    from spec_adapt.execution import prepared

    if prepared(model):
        raise ValueError("bf16_twin copies the target before spec_adapt.prepare: the packed copy is not copied")
    if getattr(model, "hf_device_map", None):
        raise ValueError("bf16_twin copies a target held whole in memory; this one is spread by a device map "
                         "(--target-memory): drop the @bf16 configurations or the memory cap")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"bf16_twin copies a float32 target beside itself; this one is "
                         f"{next(model.parameters()).dtype}: run its configurations without the @bf16 suffix")
    return copy.deepcopy(model).to(torch.bfloat16)


def split_config(name: str) -> tuple[str, str, str]:
    """A spec_adapt configuration's (drafter, policy, verifier) names: "<drafter>:<policy>[+<verifier>][ (cold)]"
    ("+ee": EarlyExitVerifier, cost-gated; "+ee-always"; no verifier: "")."""
    config, _, verifier = on_target(name).removesuffix(COLD).partition("+")
    drafter, _, policy = config.partition(":")
    return drafter, policy, verifier


def fixed_width(policy: str) -> int | None:
    """The width of a "fixed<k>" policy name ("fixed": 4), None for any other policy."""
    if not policy.startswith("fixed") or not (policy[5:] == "" or policy[5:].isdigit()):
        return None
    return int(policy[5:] or 4)


def cold_rows(configs: list[str]) -> list[str]:
    """`configs` with a cold row after each one running the default policy (<drafter>:adaptive[+verifier]): the
    plain row times later calls of one policy object (warm), the cold row first calls of fresh ones."""
    out = []
    for name in configs:
        out.append(name)
        if split_config(name)[1] == "adaptive" and not name.endswith(COLD):
            out.append(name + COLD)
    if len(out) == len(configs):
        raise ValueError("a cold row needs a <drafter>:adaptive configuration (the default policy) in the configs")
    return out


CHAIN_LEVELS = ["lookup", "draft"]      # the levels of the bench's chain, for naming what a scheduler chose


def chain_windows(choices: list[tuple], parts: int = 4, names=CHAIN_LEVELS) -> list[dict]:
    """The most chosen chain and W in each of `parts` consecutive stretches of a ChainScheduler's history, with its
    share; a chain is named by its levels' `names` joined with '>'."""
    from collections import Counter

    out, size = [], max(1, -(-len(choices) // parts))
    for start in range(0, len(choices), size):
        window = [(">".join(str(names[m]) for m in levels) or "target", w)
                  for _, levels, w in choices[start : start + size]]
        ((chain, width), count), = Counter(window).most_common(1)
        out.append({"steps": f"{start}-{start + len(window) - 1}", "chain": chain, "W": width,
                    "share": round(count / len(window), 2)})
    return out


def drafter_factory(name: str, tok, draft=None, xdraft=None):
    """fn() -> a fresh drafter for a config's drafter name (none, lookup, suffix, draft, draftc, draftp, draftpc,
    offload, wrong, chain, xdraft, xchain). "offload" is the draft inside a DraftOffload (low = 0, persist = 4): under a serve-bench
    memory budget it leaves when speculation is off and the queue waits for memory."""
    import spec_adapt

    make = {
        "none": lambda: None,
        "lookup": lambda: spec_adapt.PromptLookupDrafter(max_ngram=3, min_ngram=2),
        # A fresh index per call: repeats of the same prompts must not find their own earlier outputs.
        "suffix": lambda: spec_adapt.SuffixDrafter(index=spec_adapt.drafters.SuffixIndex()),
        # One source: the draft model alone (a bare model as drafter= is the several-source default, "multi").
        "draft": (lambda: spec_adapt.ModelDrafter(draft)) if draft is not None else None,
        # The draft with stock assisted generation's confidence early exit (a row stops below 0.4 top probability).
        "draftc": (lambda: spec_adapt.ModelDrafter(draft, confidence_threshold=0.4)) if draft is not None else None,
        # The draft with its head cut to 32,768 low ids + the prompt's tokens + special tokens (drafters.head); a
        # fresh one per call, so repeats never score with tokens learned from their own earlier outputs.
        "draftp": (lambda: spec_adapt.ModelDrafter(draft, head_tokens=32768)) if draft is not None else None,
        "draftpc": (lambda: spec_adapt.ModelDrafter(draft, confidence_threshold=0.4, head_tokens=32768))
        if draft is not None else None,
        "offload": (lambda: _offload(draft)) if draft is not None else None,
        "wrong": lambda: spec_adapt.ScriptedDrafter(
            lambda row, context, gamma: [(context[-1] + 1) % len(tok)] * gamma),
        "chain": (lambda: spec_adapt.ChainDrafter([spec_adapt.PromptLookupDrafter(3, 2), draft]))
        if draft is not None else None,
    }.get(name)
    if name in ("xdraft", "xdraftc", "xchain") and xdraft is not None:
        make = _cross_factory(name, tok, draft, xdraft)
    if name == "multi" and draft is not None:
        make = _multi_factory(draft)
    if name.startswith("draftb") and name[6:].isdigit() and draft is not None:
        make = lambda: spec_adapt.ModelDrafter(draft, branch=int(name[6:]))  # noqa: E731
    if make is None:
        raise ValueError(f"Unknown drafter {name!r} (or --draft missing for 'draft'/'draftc'/'offload'/'chain', "
                         "--xdraft for 'xdraft', both for 'xchain').")
    return make


def _multi_factory(draft):
    """The default for a draft model (`drafter=draft`): MultiSourceDrafter over it, prompt lookup and the suffix
    index, its router's estimates kept across the configuration's calls as the default keeps them; the suffix index
    fresh per call, so repeats of the same prompts never find their own earlier outputs."""
    import spec_adapt
    from spec_adapt.drafters import SourceState, SuffixIndex

    state = SourceState()
    return lambda: spec_adapt.MultiSourceDrafter(draft, [spec_adapt.PromptLookupDrafter(),
                                                         spec_adapt.SuffixDrafter(SuffixIndex())], state=state)


def _cross_factory(name: str, tok, draft, xdraft):
    """xdraft: the draft with its own tokenizer alone; xchain: it drafts, --draft verifies, then the target."""
    import spec_adapt
    from spec_adapt.drafters.cross import CrossTokenizerDrafter

    if name in ("xdraft", "xdraftc"):
        threshold = 0.4 if name == "xdraftc" else None      # xdraft: always the full width
        return lambda: CrossTokenizerDrafter(xdraft[0], xdraft[1], tok, confidence_threshold=threshold)
    if draft is None:
        return None
    return lambda: spec_adapt.ChainDrafter([CrossTokenizerDrafter(xdraft[0], xdraft[1], tok, confidence_threshold=None),
                                            draft])


def _offload(draft):
    from ..drafters.offload import DraftOffload

    return DraftOffload(draft, low=0, persist=4)


def parse_verifier(name: str):
    """"" = FullVerifier; "ee[<K>][@<layer>,...]" = EarlyExitVerifier(gate="auto"), "ee-always..." = gate="always"
    (e.g. "ee10@14" = K 10, checkpoint after layer 14). One object per configuration: its gate learns across calls."""
    import spec_adapt

    if not name:
        return None
    gate = "always" if name.startswith("ee-always") else "auto"
    rest = name.removeprefix("ee-always") if gate == "always" else name.removeprefix("ee")
    if name == rest:
        raise ValueError(f"Unknown verifier {name!r}: use ee[<K>][@<layers>] or ee-always[<K>][@<layers>].")
    k, _, layers = rest.partition("@")
    return spec_adapt.EarlyExitVerifier(layers=[int(x) for x in layers.split(",")] if layers else None,
                                        top_k=int(k or 10), gate=gate)


def parse_policy(name: str, latency=None):
    from spec_adapt import Adaptive, FixedLength
    from spec_adapt.policies import BanditSpecUCB, ElasticEWMA, GoodputModel, Heuristic, Nightjar, PerRequest

    presets = {
        "adaptive": lambda: Adaptive(latency=latency),
        "adaptive-tree": lambda: Adaptive(latency=latency, trees=True),
        "adaptive-stop": lambda: Adaptive(latency=latency, stop_rule=True),
        "nightjar": lambda: Nightjar(max_gamma=8, latency=latency),
        "nightjar-local": lambda: Nightjar(max_gamma=8, latency=latency, exploration="local"),
        "ucb": lambda: BanditSpecUCB(max_gamma=8),
        "goodput": lambda: GoodputModel(max_gamma=8, latency=latency),
        "goodput-explore": lambda: GoodputModel(max_gamma=8, latency=latency, explore=0.05),
        "ewma": lambda: ElasticEWMA(),
        "per-request": lambda: PerRequest(max_gamma=8, latency=latency),
    }
    if name in presets:
        return presets[name]()
    if fixed_width(name) is not None:
        return FixedLength(fixed_width(name))
    if name.startswith("tree") and "x" in name:
        from spec_adapt import FixedTree

        nodes, _, depth = name[4:].removesuffix("p").partition("x")
        return FixedTree(int(nodes), int(depth), pooled=name.endswith("p"))
    if name == "heuristic":
        return Heuristic()
    if name.startswith("heuristic"):
        return Heuristic(initial=int(name[9:]))
    raise ValueError(f"Unknown policy {name!r}: use adaptive, adaptive-tree, adaptive-stop, fixed<k>, "
                     "tree<N>x<D>[p], heuristic or heuristic<initial>.")


def run_bench(model, tok, prompts: list[str], configs: list[str], batch_sizes: list[int], new_tokens: int,
              repeats: int, draft=None, progress=True, rows: int = 8, latency=None, ignore_eos=False,
              policy_state=None, xdraft=None, bound: int | None = None, twin=None, reference=True) -> list[Cell]:
    """Batch size B runs the first max(B, rows) prompts (B = 1 on every prompt would take too long on a CPU).
    `policy_state`: a folder; each cell's policy starts from what a previous run saved there (warm; none saved:
    cold) and is saved there after the cell. `bound`: the widest draft of the hindsight bound, computed at batch 1
    with a draft from the target's own outputs in this run (None: no bound). `twin`: the bfloat16 copy of the
    target the <config>@bf16 configurations run on (`bf16_twin`). `reference=False`: `target` runs only if named
    (the demo runs each model's rows in a phase of its own)."""
    names = ordered_configs(configs, reference)
    if twin is None and any(is_twin(name) for name in names):
        raise ValueError(f"configurations ending in {TWIN} run on a bfloat16 copy of the target: pass it as twin= "
                         "(`bf16_twin(model)`, made before the target is prepared)")
    cells = []
    for batch in batch_sizes:
        runnable = {}
        for name in names:
            if name.startswith("hf-") and batch != 1:
                continue            # stock transformers speculation refuses batches
            on = twin if is_twin(name) else model
            fn = build_config(on_target(name), on, tok, new_tokens, draft, latency, ignore_eos, xdraft)
            if fn is not None:
                runnable[name] = fn
                if policy_state is not None:
                    fn.warm = _policy_file(policy_state, name, batch, fn, load=True)
        used = prompts[: max(batch, rows)]
        batches = [tok(used[i : i + batch], return_tensors="pt", padding=True)
                   for i in range(0, len(used) - batch + 1, batch)]
        eos = None if ignore_eos else tok.eos_token_id
        bounded = bound is not None and batch == 1 and draft is not None
        outputs = {}
        if bounded:
            runnable["target"] = _keeping_outputs(runnable["target"], outputs)
        row = time_interleaved(runnable, batches, repeats, batch,
                               count=lambda enc, out: _count_new(out[:, enc["input_ids"].shape[1]:], eos),
                               desc=f"B={batch}", progress=progress, unchecked={"target-eager"},
                               judge={"": _judge(model, eos), TWIN: _judge(twin, eos) if twin is not None else None},
                               group=lambda name: TWIN if is_twin(name) else "")
        if bounded:
            _add_bound(row, model, draft, batches, outputs, bound, progress)
        for name, fn in runnable.items():   # warm-up included: the scheduler's choices from its first step
            row[name].choices = list(getattr(getattr(fn, "policy", None), "history", None) or [])
            row[name].warm = getattr(fn, "warm", None)
            if policy_state is not None:
                _policy_file(policy_state, name, batch, fn, load=False)
        cells.extend(row.values())
    return cells


def _keeping_outputs(fn, kept: dict):
    """fn, also keeping its latest output per input object (greedy: every repeat's is the same)."""

    def run(enc):
        out, stats = fn(enc)
        kept[id(enc)] = out
        return out, stats

    return run


def _add_bound(row: dict, model, draft, batches: list, outputs: dict, max_width: int, progress: bool) -> None:
    """The hindsight bound over these batch-1 inputs, from the target's outputs kept while timing, set on every cell
    of the row (each reads its fraction of it). Its step costs are this run's own (`bound.measured_costs`): the
    timed steps of the configurations that draft chains with the draft model, and stock generate's time."""
    from .bound import hindsight

    prompts = [enc["input_ids"][0] for enc in batches]
    new = [outputs[id(enc)][0, len(p):] for enc, p in zip(batches, prompts)]
    result = hindsight(model, draft, prompts, new, max_width, progress, step_times=_draft_step_times(row),
                       plain_seconds=statistics.median(row["target"].times), draft_token=_draft_token_seconds(row),
                       free_times=_free_step_times(row))
    for cell in row.values():
        cell.bound = result


def _full_chain(name: str) -> str | None:
    """A configuration's drafter name where the bound reads its steps, else None: chains verified in full (no tree,
    no early exit) on the float32 target (the bound prices that model's steps, not its bf16 copy's)."""
    drafter, policy, verifier = split_config(name)
    if verifier or policy.startswith(("tree", "adaptive-tree")) or is_twin(name):
        return None
    return drafter


def _draft_token_seconds(row: dict) -> float | None:
    """Seconds per draft-model forward in the run (drafting time over the longest row's drafts, over the
    configurations `_draft_step_times` reads); None where none drafted."""
    seconds = positions = 0
    for name, cell in row.items():
        if _full_chain(name) in ("draft", "draftc"):
            seconds, positions = seconds + cell.draft_seconds, positions + cell.draft_positions
    return seconds / positions if positions else None


def _draft_step_times(row: dict) -> dict[int, list[float]]:
    """Seconds of every timed step by its widest row's draft, over the configurations whose steps the bound models:
    chains drafted by the draft model itself (draft, draftc) and verified in full (no tree, no early exit)."""
    times: dict[int, list[float]] = {}
    for name, cell in row.items():
        if _full_chain(name) not in ("draft", "draftc"):
            continue
        for step in cell.trace:
            width = max(step["drafted"], default=0)
            if width:
                times.setdefault(width, []).append(step["step_time"])
    return times


FREE_SOURCES = ("lookup", "suffix")     # drafters whose drafts cost no forward: their steps time a verification


def _free_step_times(row: dict) -> dict[int, list[float]]:
    """Seconds of every timed step that drafted from model-free sources alone, by its widest row's draft, verified in
    full: what a verification of that many tokens costs in this run (a lookup's scan is small beside a forward).
    The several-source configuration's steps count where every row that drafted took a free source."""
    times: dict[int, list[float]] = {}
    for name, cell in row.items():
        drafter = _full_chain(name)
        if drafter is None:
            continue
        for step in cell.trace:
            width = max(step["drafted"], default=0)
            sources = [s for s, d in zip(step.get("source") or [], step["drafted"]) if d]
            free = drafter in FREE_SOURCES or (drafter == "multi" and sources
                                               and all(s in FREE_SOURCES for s in sources))
            if width and free:
                times.setdefault(width, []).append(step["step_time"])
    return times


def _policy_file(folder, name: str, batch: int, fn, load: bool) -> bool | None:
    """Load (True if a saved state was found) or save a cell's policy state as JSON; None for policies without
    state_dict / load_state_dict (fixed lengths, stock configurations) and for cold rows (a fresh policy per call)."""
    import json
    import re

    policy = getattr(fn, "policy", None)
    if policy is None or getattr(fn, "cold", False) or not hasattr(policy, "state_dict") \
            or not hasattr(policy, "load_state_dict"):
        return None
    path = Path(folder) / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-B{batch}.json"
    if not load:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(policy.state_dict()))
        return None
    if not path.exists():
        return False
    policy.load_state_dict(json.loads(path.read_text()))
    return True


def time_interleaved(fns: dict, inputs: list, repeats: int, batch_size: int, count, desc: str = "",
                     progress: bool = True, unchecked=frozenset(), judge=None, group=None) -> dict[str, Cell]:
    """The one timing harness of every benchmark. `fns`: name -> fn(input) -> (output, SpecStats | None); the first
    is the reference the others' outputs must equal (except those named in `unchecked`, another execution
    configuration). `group(name)`: where fns run on different models (a target and its bf16 copy), the key of the
    model a name runs on; the first fn of each group is that group's reference (None: one group). `judge(input,
    reference, output)`, or {group: judge}: where an output is not equal to its reference, the identity rule's
    `Verdict` (`spec_adapt.identity.judge`: a difference at the target's own near-ties is not a failure), run after
    the timing; None: any difference fails. After a warm-up on inputs[0], each of `repeats` rounds runs every input
    through every fn in turn (interleaved, so machine noise hits all of them alike) and records per fn the round's
    seconds and tokens (`count(input, output)`: the one way tokens are counted). The progress bar ticks once per
    call."""
    from tqdm import tqdm

    group = group or (lambda name: "")
    judges = judge if isinstance(judge, dict) else {group(name): judge for name in fns}
    cells = {name: Cell(name, batch_size, identical=None if name in unchecked else True) for name in fns}
    bar = tqdm(total=len(fns) * (1 + repeats * len(inputs)), desc=desc, disable=not progress)
    for name, fn in fns.items():
        bar.set_postfix_str(f"warm-up {name}")
        fn(inputs[0])
        bar.update()
    for _ in range(repeats):
        elapsed = dict.fromkeys(fns, 0.0)
        produced = dict.fromkeys(fns, 0)
        for item in inputs:
            references = {}
            for name, fn in fns.items():
                bar.set_postfix_str(name)
                start = time.perf_counter()
                out, stats = fn(item)
                elapsed[name] += time.perf_counter() - start
                bar.update()
                produced[name] += count(item, out)
                key = group(name)
                if name in unchecked:
                    pass
                elif key not in references:
                    references[key] = out
                else:
                    _check(cells[name], item, references[key], out, judges.get(key))
                if stats is not None:
                    cells[name].add_stats(stats)
        for name in fns:
            cells[name].times.append(elapsed[name])
            cells[name].tokens.append(produced[name])
    bar.close()
    return cells


def _judge(model, eos):
    """The identity rule over a bench input (a tokenizer's batch): tie-aware, in the target's dtype."""
    from ..identity import judge

    return lambda enc, reference, out: judge(model, enc["input_ids"], enc.get("attention_mask"), reference, out,
                                             eos_token_id=eos)


def _check(cell: Cell, item, reference, out, judge) -> None:
    cell.checks += 1
    if torch.equal(out, reference):
        return
    verdict = judge(item, reference, out) if judge is not None else None
    if verdict is not None and verdict.ok:
        cell.tied += 1
        cell.ties += verdict.ties
    else:
        cell.identical = False
        cell.differing += 1


def _count_new(new: torch.Tensor, eos_id) -> int:
    """Generated tokens per row up to and including EOS (what the user gets), summed over the batch."""
    total = 0
    for row in new.tolist():
        n = len(row)
        if eos_id is not None and eos_id in row:
            n = row.index(eos_id) + 1
        total += n
    return total


def summarize(cells: list[Cell]) -> list[dict]:
    base = {c.batch_size: c for c in cells if c.config == "target"}
    eager = {c.batch_size: c for c in cells if c.config == "target-eager"}
    twins = {c.batch_size: c for c in cells if c.config == "target" + TWIN}
    out = []
    for c in cells:
        rates = [n / t for n, t in zip(c.tokens, c.times)]
        speedups = [b / t for b, t in zip(base[c.batch_size].times, c.times)]
        versus_eager = [b / t for b, t in zip(eager[c.batch_size].times, c.times)] if c.batch_size in eager else None
        twin = twins.get(c.batch_size) if is_twin(c.config) else None
        versus_twin = [b / t for b, t in zip(twin.times, c.times)] if twin is not None else None
        out.append({
            "config": c.config, "batch_size": c.batch_size,
            "tok_s": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
            "ms_per_token": 1000 * statistics.median(t / n for n, t in zip(c.tokens, c.times)),
            "speedup": statistics.median(speedups), "speedup_min": min(speedups), "speedup_max": max(speedups),
            "speedup_vs_eager": statistics.median(versus_eager) if versus_eager else None,
            "speedup_vs_bf16_stock": statistics.median(versus_twin) if versus_twin else None,
            **_versus_bound(c.bound, statistics.median(speedups)),
            "alpha": c.accepted / c.drafted if c.drafted else None,
            "acceptance_length": c.step_tokens / c.row_steps if c.row_steps else None,
            "per_position_acceptance": [a / d if d else 0.0 for d, a in c.per_position],
            # c: seconds per drafted position over seconds per verification step (of the steps that drafted)
            "c": (c.draft_seconds / c.draft_positions) / (c.verify_seconds / c.verify_steps)
            if c.draft_positions and c.verify_seconds else None,
            "plain_step_share": c.plain_steps / c.steps if c.steps else None, "warm": c.warm,
            "verify_ms": 1000 * c.verify_seconds / c.verify_steps if c.verify_steps else None,
            **({"pruned_share": c.verifier["pruned"] / max(1, c.verifier["tested"]),
                "pruned_step_share": c.verifier["pruned_steps"] / max(1, c.verifier["pruned_steps"]
                                                                    + c.verifier["full_steps"])}
               if c.verifier else {}),
            "identical": c.identical, "verdict": c.verdict, "checks": c.checks, "differing": c.differing,
            "tied": c.tied, "ties": c.ties, "repeats": len(c.times),
            **({"chains_chosen": chain_windows(c.choices)} if c.choices else {}),
        })
    return out


def _versus_bound(bound: dict | None, speedup: float) -> dict:
    """The bound's speedup (plain decoding's time over the best schedule's, both charged the same measured forward
    costs, so the cost model's error in absolute seconds cancels) and the fraction of it a configuration's measured
    `speedup` over stock generate reaches. None where no bound was computed: never a number the run did not measure."""
    if bound is None:
        return {"bound_speedup": None, "of_bound": None}
    reachable = bound["plain_seconds"] / bound["seconds"]
    return {"bound_speedup": reachable, "of_bound": speedup / reachable}


def run_bound(cells: list[Cell]) -> dict | None:
    """The run's hindsight bound (`bound.hindsight`, the same on every batch-1 cell); None: none was computed."""
    return next((c.bound for c in cells if c.bound is not None), None)


def _print_bound_notes(summary: list[dict], run: dict, bound: float) -> None:
    """What the bound is charged, the best fixed width under it, and the cost model against the run: each timed
    fixed width's speedup beside the speedup the model predicts for it."""
    from .bound import best_fixed_share

    source = ("this run's own timed steps and stock generate's time" if run.get("cost_source") == "run"
              else "a profile taken after the run (too few timed steps to take them from the run)")
    print(f"of bound: speedup / the hindsight bound's ({bound:.2f}x at B=1: the best draft-length schedule with "
          f"--draft over plain decoding, step costs from {source}; spec_adapt/tools/bound.py)")
    width, share = best_fixed_share(run)
    print(f"under the same cost model, the best fixed width in hindsight (FixedLength({width})) reaches {share:.0%} "
          "of the bound")
    if run.get("several_seconds"):
        several = run["plain_seconds"] / run["several_seconds"]
        print(f"several-source bound: {several:.2f}x (the best of the draft model at each width, prompt lookup at "
              f"each width up to {len(run['verify_costs']) - 1} and a plain step, per step in hindsight; lookup steps "
              "charged the verification alone)")
        for s in summary:
            if s["batch_size"] == 1:
                print(f"  {s['config']:<22} {s['speedup'] / several:.0%} of the several-source bound")
    for s in summary:
        drafter, policy, verifier = split_config(s["config"])
        width = fixed_width(policy)
        if s["batch_size"] == 1 and drafter == "draft" and not verifier and width is not None \
                and width < len(run["fixed_seconds"]):
            predicted = run["plain_seconds"] / run["fixed_seconds"][width]
            print(f"cost model check: {s['config']} measured {s['speedup']:.2f}x, the model predicts {predicted:.2f}x")


def write_results(cells: list[Cell], summary: list[dict], out_dir: Path, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    bound = run_bound(cells)
    (out_dir / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary, "bound": bound}, indent=1))
    (out_dir / "traces.json").write_text(json.dumps(
        [{"config": c.config, "batch_size": c.batch_size, "trace": c.trace} for c in cells if c.trace]))
    with open(out_dir / "summary.csv", "w", newline="") as f:
        fields = list(dict.fromkeys(k for row in summary for k in row if k not in ("per_position_acceptance",
                                                                                    "chains_chosen")))
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summary)
    _plot(summary, out_dir, meta)


def _plot(summary: list[dict], out_dir: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(s["config"] for s in summary))
    bounded = [s for s in summary if s.get("of_bound") is not None]
    fig, axes = plt.subplots(1, 4 if bounded else 3, figsize=(21 if bounded else 16, 4.5))
    for config in configs:
        rows = [s for s in summary if s["config"] == config]
        bs = [s["batch_size"] for s in rows]
        axes[0].plot(bs, [s["tok_s"] for s in rows], marker="o", label=config)
        if rows[0]["acceptance_length"] is not None:
            axes[1].plot(bs, [s["acceptance_length"] for s in rows], marker="o", label=config)
            biggest = rows[-1]["per_position_acceptance"]
            axes[2].plot(range(1, len(biggest) + 1), biggest, marker=".", label=f"{config} (B={rows[-1]['batch_size']})")
    sizes = sorted({s["batch_size"] for s in summary})
    axes[0].set(xlabel="batch size", ylabel="tokens/s", title="throughput")
    axes[1].set(xlabel="batch size", ylabel="tokens per row per step", title="acceptance length")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
    axes[2].set(xlabel="draft position", ylabel="acceptance rate", title="per-position acceptance")
    for ax in axes[:3]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if bounded:
        _plot_bound(axes[3], bounded)
    fig.suptitle(f"{meta.get('workload')}: {meta.get('model')} {meta.get('dtype')}, {meta.get('new_tokens')} new tokens")
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=110)
    plt.close(fig)


def _plot_bound(ax, rows: list[dict]) -> None:
    """Each batch-1 configuration's fraction of the hindsight bound's speedup (the line at 1 is the bound)."""
    ax.barh([s["config"] for s in rows][::-1], [s["of_bound"] for s in rows][::-1])
    ax.axvline(1.0, color="k", lw=1)
    ax.set(xlabel="fraction of the bound's speedup", title=f"of bound (B=1; the bound: {rows[0]['bound_speedup']:.2f}x "
           "plain decoding)")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(alpha=0.3, axis="x")


def print_table(summary: list[dict], run: dict | None = None) -> None:
    """The summary as a table; `run`: the run's hindsight bound (`run_bound`), for its notes below the table."""
    eager = any(s.get("speedup_vs_eager") is not None for s in summary)
    twin = any(s.get("speedup_vs_bf16_stock") is not None for s in summary)
    bound = next((s["bound_speedup"] for s in summary if s.get("bound_speedup") is not None), None)
    print(f"\n{'config':<22} {'B':>3} {'tok/s':>8} {'ms/tok':>7} {'speedup':>16} " + ("vs eager " if eager else "")
          + ("vs bf16 stock " if twin else "")
          + ("of bound " if bound else "") + f"{'alpha':>6} {'acc.len':>7} {'c':>5} {'γ=0':>5} identical")
    for s in summary:
        alpha = f"{s['alpha']:.2f}" if s["alpha"] is not None else "-"
        length = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] is not None else "-"
        ratio = f"{s['c']:.2f}" if s.get("c") is not None else "-"
        plain = f"{s['plain_step_share']:.0%}" if s.get("plain_step_share") is not None else "-"
        spread = f"{s['speedup']:.2f}x [{s['speedup_min']:.2f}-{s['speedup_max']:.2f}]"
        versus = (f"{s['speedup_vs_eager']:>7.2f}x " if s.get("speedup_vs_eager") else f"{'-':>8} ") if eager else ""
        if twin:
            versus += (f"{s['speedup_vs_bf16_stock']:>13.2f}x " if s.get("speedup_vs_bf16_stock")
                       else f"{'-':>14} ")
        share = (f"{s['of_bound']:>8.0%} " if s.get("of_bound") is not None else f"{'-':>8} ") if bound else ""
        same = "n/a" if s["identical"] is None else s.get("verdict") or s["identical"]
        print(f"{s['config']:<22} {s['batch_size']:>3} {s['tok_s']:>8.1f} {s['ms_per_token']:>7.1f} {spread:>16} "
              f"{versus}{share}{alpha:>6} {length:>7} {ratio:>5} {plain:>5} {same}")
    if bound and run is not None:
        _print_bound_notes(summary, run, bound)
    for s in summary:
        if s.get("chains_chosen"):
            print(f"chains chosen by {s['config']} at B={s['batch_size']}: " + "; ".join(
                f"steps {w['steps']}: {w['chain']} W={w['W']} ({w['share']:.0%})" for w in s["chains_chosen"]))
