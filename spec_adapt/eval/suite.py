"""The quality suite: generate with target-only, fixed-length speculation and adaptive configurations, greedy and
sampled, and compare each against target-only and against fixed-length speculation, next to calibration controls.

Controls (reported beside every result, because scores depend on the backbone):
- identical: target-only greedy output against itself (the ceiling: 1.0);
- other seed: target-only sampled with seed A against seed B (what "same distribution" looks like);
- unrelated: target-only outputs paired with another prompt's output (what "different" looks like).
Greedy configurations must be exactly identical to target-only. A sampled configuration must be no further from
target-only (seed B) than target-only under seed A is: per prompt, d = score(ours, B) - score(A, B), and a one-sided
paired t-test must not show mean(d) < -tolerance at level `alpha` (Bonferroni-split over every check in the suite).
A fixed margin on the means would be flaky with few prompts: per-prompt scores spread by ~0.1, so the mean of 8 moves
by ~0.04 between machines. The suite also checks its own power: the unrelated control (seed-A outputs paired with
another prompt's) must be flagged by the same test, or the verdicts mean nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .quality_metrics import bertscore_f1, embedding_cosine, paired_stats, reward_scores, summary


@dataclass
class Config:
    name: str
    drafter: object = None           # a factory: () -> drafter (or None: target only)
    policy: object = None            # a factory: () -> Policy
    acceptor: object = None          # an Acceptor for this configuration's calls (the lossy test's LossyTopK)


def default_configs() -> list[Config]:
    from spec_adapt import FixedLength, PromptLookupDrafter, SuffixDrafter
    from spec_adapt.policies import ElasticEWMA, Nightjar
    from spec_adapt.drafters import SuffixIndex

    return [
        Config("target-only"),
        Config("fixed-4", lambda: PromptLookupDrafter(3, 2), lambda: FixedLength(4)),
        Config("suffix-nightjar", lambda: SuffixDrafter(SuffixIndex()), lambda: Nightjar(exploration="local")),
        Config("lookup-ewma", lambda: PromptLookupDrafter(3, 2), lambda: ElasticEWMA()),
    ]


def generate_texts(model, tok, prompts, config: Config, do_sample: bool, seed: int, new_tokens: int,
                   batch_size: int, temperature: float) -> list[str]:
    import spec_adapt

    texts = []
    torch.manual_seed(seed)
    extra = {}
    if config.drafter is not None:
        extra = dict(custom_generate=spec_adapt.generate, drafter=config.drafter(), assistant_policy=config.policy(),
                     acceptor=config.acceptor)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    for start in range(0, len(prompts), batch_size):
        enc = tok(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id, **sampling, **extra)
        texts += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


@dataclass
class Comparison:
    bertscore: dict
    cosine: dict
    exact_match: float
    per_pair_bertscore: list = field(default_factory=list)
    per_pair_cosine: list = field(default_factory=list)

    def as_dict(self):
        return {"bertscore": self.bertscore, "cosine": self.cosine, "exact_match": self.exact_match}


def compare_texts(a: list[str], b: list[str], progress=False) -> Comparison:
    bs = bertscore_f1(a, b, progress=progress)
    cos = embedding_cosine(a, b, progress=progress)
    return Comparison(summary(bs), summary(cos), sum(x == y for x, y in zip(a, b)) / len(a), bs, cos)


def run_suite(model, tok, prompts: list[str], configs: list[Config] | None = None, new_tokens: int = 64,
              batch_size: int = 16, temperature: float = 0.7, seeds=(0, 1), reward_model: str | None = None,
              tolerance: float = 0.02, alpha: float = 0.01, progress: bool = True) -> dict:
    from tqdm import tqdm

    configs = configs or default_configs()
    base = configs[0]
    texts = {}
    jobs = [(c, mode, seed) for c in configs for mode, seed in (("greedy", seeds[0]), ("sampled", seeds[0]))]
    jobs.append((base, "sampled", seeds[1]))
    for config, mode, seed in tqdm(jobs, desc="generating", disable=not progress):
        texts[(config.name, mode, seed)] = generate_texts(model, tok, prompts, config, mode == "sampled", seed,
                                                          new_tokens, batch_size, temperature)
    target_greedy = texts[(base.name, "greedy", seeds[0])]
    target_a, target_b = texts[(base.name, "sampled", seeds[0])], texts[(base.name, "sampled", seeds[1])]
    shift = target_greedy[1:] + target_greedy[:1]
    other_seed = compare_texts(target_a, target_b)
    controls = {
        "identical": compare_texts(target_greedy, target_greedy).as_dict(),
        "other_seed": other_seed.as_dict(),
        "unrelated": compare_texts(target_greedy, shift).as_dict(),
    }
    # Two metrics per sampled configuration, plus the power check below: split alpha over all of them.
    alpha_each = alpha / (2 * len(configs))
    scorer_lm = None if reward_model else (model, tok)
    rewards = {}
    for key, value in texts.items():
        rewards[key], scorer = reward_scores(prompts, value, reward_model=reward_model, lm=scorer_lm, progress=False)
    unrelated_sampled = compare_texts(target_a[1:] + target_a[:1], target_b)
    report = {"controls": controls, "scorer": scorer, "tolerance": tolerance, "alpha": alpha, "configs": {},
              "n": len(prompts), "new_tokens": new_tokens, "temperature": temperature,
              "power": sampled_regime(unrelated_sampled, other_seed, tolerance, alpha_each)}
    reference_config = configs[1].name if len(configs) > 1 else base.name
    for config in configs[1:]:
        entry = {}
        for mode in ("greedy", "sampled"):
            ours = texts[(config.name, mode, seeds[0])]
            # Sampled outputs are compared with target-only under the *other* seed, like the other-seed control.
            against = target_greedy if mode == "greedy" else target_b
            vs_target = compare_texts(ours, against)
            vs_fixed = compare_texts(ours, texts[(reference_config, mode, seeds[0])])
            reward = paired_stats(rewards[(config.name, mode, seeds[0])],
                                  rewards[(base.name, mode, seeds[0])])
            entry[mode] = {"vs_target": vs_target.as_dict(), "vs_fixed": vs_fixed.as_dict(), "reward_delta": reward,
                           "per_pair_bertscore": vs_target.per_pair_bertscore}
            if mode == "sampled":
                entry["regime"] = sampled_regime(vs_target, other_seed, tolerance, alpha_each)
        entry["verdict"] = {"greedy_identical": entry["greedy"]["vs_target"]["exact_match"] == 1.0,
                            "sampled_same_regime": entry["regime"]["same_regime"]}
        report["configs"][config.name] = entry
    report["texts"] = {f"{k[0]}|{k[1]}|{k[2]}": v for k, v in texts.items()}
    return report


def further_than(ours: list[float], control: list[float], tolerance: float, alpha: float) -> dict:
    """One-sided paired t-test of d = ours - control per prompt. `flagged` when the upper (1 - alpha) confidence bound
    of mean(d) lies below -tolerance: ours is significantly less similar to the reference than the control is."""
    paired = paired_stats(ours, control, upper_alpha=alpha)
    if paired["n"] < 2:
        raise ValueError(f"the sampled-regime test needs at least 2 prompts, got {paired['n']}")
    return {"mean_diff": paired["mean_diff"], "upper_bound": paired["upper_bound"],
            "flagged": paired["upper_bound"] < -tolerance}


def sampled_regime(ours: Comparison, control: Comparison, tolerance: float, alpha: float) -> dict:
    """Sampled outputs are in target-only's regime unless BERTScore or cosine is significantly further from
    target-only than the other-seed control."""
    checks = {"bertscore": further_than(ours.per_pair_bertscore, control.per_pair_bertscore, tolerance, alpha),
              "cosine": further_than(ours.per_pair_cosine, control.per_pair_cosine, tolerance, alpha)}
    return {**checks, "alpha": alpha, "same_regime": not any(c["flagged"] for c in checks.values())}


def write_report(report: dict, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps({"meta": meta, **report}, indent=1))
    (out / "quality.md").write_text(markdown(report, meta))
    _plot(report, out)


def markdown(report: dict, meta: dict) -> str:
    c = report["controls"]
    lines = [f"# Quality report: {meta.get('workload')} ({report['n']} prompts, {report['new_tokens']} new tokens, "
             f"temperature {report['temperature']})", "", f"Command: `{meta.get('command')}`", "",
             f"Reward scorer: `{report['scorer']}`. Backbone for BERTScore/cosine: all-MiniLM-L6-v2.", "",
             "| control | BERTScore F1 | cosine | exact match |", "|---|---|---|---|"]
    for name in ("identical", "other_seed", "unrelated"):
        lines.append(f"| {name} | {c[name]['bertscore']['mean']:.4f} | {c[name]['cosine']['mean']:.4f} | "
                     f"{c[name]['exact_match']:.2f} |")
    power = report["power"]
    power_verdict = ("NOT flagged: the sampled verdicts below have no power" if power["same_regime"]
                     else "flagged (the test has power)")
    lines += ["", f"Sampled verdicts: one-sided paired t-test per metric at alpha {power['alpha']:.4f} (Bonferroni), "
              f"tolerance {report['tolerance']}. Power check, the unrelated control paired with seed B: "
              f"BERTScore mean diff {power['bertscore']['mean_diff']:+.3f}, cosine "
              f"{power['cosine']['mean_diff']:+.3f}: {power_verdict}."]
    lines += ["", "| config | mode | BERTScore vs target | cosine vs target | exact | BERTScore vs fixed | "
              "reward delta [95% CI] (p) | verdict |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in report["configs"].items():
        for mode in ("greedy", "sampled"):
            e = entry[mode]
            r = e["reward_delta"]
            ok = entry["verdict"]["greedy_identical" if mode == "greedy" else "sampled_same_regime"]
            lines.append(f"| {name} | {mode} | {e['vs_target']['bertscore']['mean']:.4f} | "
                         f"{e['vs_target']['cosine']['mean']:.4f} | {e['vs_target']['exact_match']:.2f} | "
                         f"{e['vs_fixed']['bertscore']['mean']:.4f} | {r['mean_diff']:+.3f} "
                         f"[{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}] (p={r['p_value']:.2f}) | "
                         f"{'pass' if ok else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def _plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, mode in zip(axes, ("greedy", "sampled")):
        data, labels = [], []
        for name, entry in report["configs"].items():
            data.append(entry[mode]["per_pair_bertscore"])
            labels.append(name)
        ax.boxplot(data, tick_labels=labels, vert=True)
        for name, color in (("other_seed", "tab:green"), ("unrelated", "tab:red")):
            ax.axhline(report["controls"][name]["bertscore"]["mean"], color=color, ls="--", label=f"control: {name}")
        ax.set(title=f"{mode}: BERTScore F1 vs target-only", ylabel="F1")
        ax.legend(fontsize=7)
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=100)
    plt.close(fig)
