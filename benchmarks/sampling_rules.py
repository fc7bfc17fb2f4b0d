"""What the coupled sampling rule costs in acceptance against rejection sampling, on tiny random Llama pairs whose
draft is a perturbed copy of the target (spec_adapt.tools.synthetic.perturbed_copy) at several noise levels.

    python benchmarks/sampling_rules.py     # CPU, about a minute; prints a table, writes results/sampling_rules.json
    python benchmarks/sampling_rules.py --smoke     # one noise level, 4 prompts, written to a temporary folder

Per noise level, two measures:
- per position, over the target's own sampled continuations of a few prompts: rejection sampling's acceptance
  sum_x min(p(x), q(x)) = 1 - TV (exact), and the coupled rule's P(argmax(log p + g) == argmax(log q + g)) (2,000
  Gumbel draws per position), with its lower bound (1 - TV) / (1 + TV);
- end to end: model.generate with the draft model at FixedLength(4), both rules, 32 prompts, the same seed: accepted
  / drafted, and tokens a row commits per drafting step.
Temperature 1, no top-k: the whole distributions compete.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import spec_adapt  # noqa: E402
from spec_adapt import Acceptor, FixedLength  # noqa: E402
from spec_adapt.tools.synthetic import perturbed_copy  # noqa: E402

from conftest import PAD, tiny_model  # noqa: E402

import _smoke  # noqa: E402

VOCAB, SCALE, NOISES, DRAWS = 512, 0.5, (0.1, 0.2, 0.4, 0.8), 2000


def per_position(target, draft, prompts, gen) -> dict:
    """Acceptance of one draft token at each position of the target's sampled continuations."""
    with torch.no_grad():
        seqs = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                               max_new_tokens=24, pad_token_id=PAD, eos_token_id=None, top_k=None)
        p = target(seqs).logits[:, prompts.shape[1] - 1:-1].float().softmax(-1).flatten(0, 1)      # [N, V]
        q = draft(seqs).logits[:, prompts.shape[1] - 1:-1].float().softmax(-1).flatten(0, 1)
    tv = 0.5 * (p - q).abs().sum(-1)
    agree = torch.zeros(len(p))
    for _ in range(DRAWS // 100):       # 100 draws of the noise at a time
        g = -torch.empty(100, *p.shape).exponential_(generator=gen).log()                      # [100, N, V]
        agree += ((p.log() + g).argmax(-1) == (q.log() + g).argmax(-1)).float().sum(0)
    agree /= DRAWS
    return {"tv": float(tv.mean()), "rejection": float((1 - tv).mean()), "coupled": float(agree.mean()),
            "coupled_lower_bound": float(((1 - tv) / (1 + tv)).mean()), "positions": len(tv)}


def end_to_end(target, draft, prompts, rule: str) -> dict:
    stats = spec_adapt.SpecStats()
    torch.manual_seed(0)
    target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=None,
                    max_new_tokens=48, pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate,
                    drafter=draft, assistant_policy=FixedLength(4), acceptor=Acceptor(rule=rule), spec_stats=stats)
    steps = sum(1 for r in stats.trace if max(r.drafted) > 0)
    committed = sum(sum(r.committed) for r in stats.trace if max(r.drafted) > 0)
    rows = sum(len(r.committed) for r in stats.trace if max(r.drafted) > 0)
    return {"acceptance": stats.accepted / max(stats.drafted, 1), "tokens_per_row_step": committed / max(rows, 1),
            "steps": steps}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--noises", type=float, nargs="+", default=list(NOISES))
    p.add_argument("--prompts", type=int, default=32, help="prompts of the end-to-end runs (the first 8 per position)")
    p.add_argument("--out", default="results/sampling_rules.json")
    _smoke.add(p)
    args = _smoke.apply(p.parse_args(), noises=[0.4], prompts=4, out=_smoke.folder("sampling_rules.json"))
    torch.manual_seed(0)
    target = tiny_model("llama", seed=3, vocab=VOCAB)
    with torch.no_grad():        # logits with a real spread: a few likely tokens, a long tail
        target.lm_head.weight.mul_(SCALE)
    prompts = torch.randint(3, VOCAB, (args.prompts, 6), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    rows = []
    for noise in args.noises:
        draft = perturbed_copy(target, noise, seed=4)
        row = {"noise": noise, **per_position(target, draft, prompts[:8], gen)}
        for rule in ("rejection", "coupled"):
            row[f"e2e_{rule}"] = end_to_end(target, draft, prompts, rule)
        rows.append(row)
        print(f"noise {noise}: TV {row['tv']:.3f}  per position: rejection {row['rejection']:.3f}  coupled "
              f"{row['coupled']:.3f} (bound {row['coupled_lower_bound']:.3f})  end to end acceptance: rejection "
              f"{row['e2e_rejection']['acceptance']:.3f} coupled {row['e2e_coupled']['acceptance']:.3f}; tokens per "
              f"row-step {row['e2e_rejection']['tokens_per_row_step']:.2f} / "
              f"{row['e2e_coupled']['tokens_per_row_step']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"vocab": VOCAB, "scale": SCALE, "draws": DRAWS, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
