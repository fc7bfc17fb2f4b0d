"""Distill a small draft for a target that shares its tokenizer (default: SmolLM2-135M-Instruct).

    python -m spec_adapt.recipes.distill_draft --layers 2 --minutes 10 --out results/draft-2l
    python -m spec_adapt.recipes.distill_draft --resume results/draft-2l          # continue where it stopped

The draft is the target's architecture with `--layers` decoder layers, initialized from the target's first layers
(or from the layers listed in `--keep`, e.g. `--keep 0,1,28,29`: the last layers already map into the head's space);
the embeddings and LM head are the target's own, shared and frozen, so only the layers and the final norm are
trained and saved (`draft.safetensors`, a few MB per layer). Training data: the target's own greedy outputs for
ShareGPT first turns (generated once, cached in the output folder), distilled with KL(p_target || p_draft) on every
output position. A held-out report gives top-1 agreement (the greedy acceptance rate) and, with `--report-spec`,
the acceptance measured through spec_adapt on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from spec_adapt.loading import build_draft


def trainable_state(draft) -> dict:
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    return {k: v.detach().contiguous() for k, v in draft.state_dict().items() if k not in shared}


def make_data(target, tok, n: int, new_tokens: int, batch: int, cache: Path, exclude_first: int = 0) -> list:
    """Token sequences (prompt + the target's greedy output), with the index where the output starts. The first
    `exclude_first` prompts of the bench's ShareGPT workload are never used, so benchmarks measure unseen text."""
    if cache.exists():
        return torch.load(cache)
    from spec_adapt.recipes import workloads

    excluded = set(workloads.sharegpt(limit=exclude_first)["id"]) if exclude_first else set()
    pool = workloads.sharegpt(limit=n + exclude_first, max_chars=1000)
    pool = pool.filter(lambda row: row["id"] not in excluded)
    pool = pool.select(range(min(n, len(pool))))
    prompts = list(workloads.with_inputs(pool, tok)["input_text"])
    data = []
    for i in tqdm(range(0, len(prompts), batch), desc="target outputs"):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)
        out = target.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for b in range(out.shape[0]):
            start = int((enc["attention_mask"][b] == 0).sum())
            seq = out[b, start:]
            seq = seq[: int((seq != tok.pad_token_id).nonzero().max()) + 1] if (seq != tok.pad_token_id).any() else seq
            data.append({"ids": seq, "output_start": enc["input_ids"].shape[1] - start})
    torch.save(data, cache)
    return data


def batches(train: list[dict], size: int, seed: int):
    """Shuffled batches of sequences of similar length (little padding)."""
    order = sorted(range(len(train)), key=lambda i: len(train[i]["ids"]))
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    gen = torch.Generator().manual_seed(seed)
    return [groups[i] for i in torch.randperm(len(groups), generator=gen).tolist()]


def kd_loss(target, draft, items: list[dict], pad_id: int) -> tuple[torch.Tensor, float]:
    """KL(p_target || p_draft) on the output positions of a right-padded batch; logits only where needed."""
    length = max(len(it["ids"]) for it in items)
    ids = torch.full((len(items), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, it in enumerate(items):
        ids[b, : len(it["ids"])] = it["ids"]
        mask[b, : len(it["ids"])] = 1
    first = min(it["output_start"] for it in items) - 1          # first position whose logits are trained
    keep = length - first
    scored = torch.zeros(len(items), keep, dtype=torch.bool)      # position p predicts token p + 1 of the output
    for b, it in enumerate(items):
        scored[b, it["output_start"] - 1 - first : len(it["ids"]) - 1 - first] = True
    with torch.no_grad():
        teacher = target(ids, attention_mask=mask, logits_to_keep=keep).logits[scored].float()
    student = draft(ids, attention_mask=mask, logits_to_keep=keep).logits[scored].float()
    loss = torch.nn.functional.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True,
                                      reduction="batchmean")
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean().item()
    return loss, agree


def agreement(target, draft, data) -> float:
    hits = total = 0
    with torch.no_grad():
        for item in data:
            ids, start = item["ids"], item["output_start"]
            t = target(ids[None]).logits[0, start - 1 : -1].argmax(-1)
            d = draft(ids[None]).logits[0, start - 1 : -1].argmax(-1)
            hits += int((t == d).sum())
            total += t.numel()
    return hits / max(total, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--keep", help="comma-separated target layers to start from (default: the first --layers)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per optimizer step")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--heldout", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--out", default="results/draft")
    parser.add_argument("--resume", help="an output folder to continue from")
    parser.add_argument("--init", help="start from the layers saved in this output folder (same --keep/--layers)")
    parser.add_argument("--exclude-first", type=int, default=64,
                        help="never train on the first N prompts of the bench's ShareGPT workload")
    parser.add_argument("--report-spec", action="store_true", help="also measure acceptance through spec_adapt")
    args = parser.parse_args()

    from spec_adapt.loading import load_model

    out = Path(args.resume or args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    target, tok = load_model()
    for p in target.parameters():
        p.requires_grad_(False)
    meta = json.loads((out / "draft.json").read_text()) if args.resume else {
        "layers": args.layers, "keep": [int(i) for i in args.keep.split(",")] if args.keep else None,
        "step": 0, "optimizer_steps": 0, "batch": args.batch, "history": [], "prompts": args.prompts,
        "heldout": args.heldout, "exclude_first": args.exclude_first, "init": args.init,
        "new_tokens": args.new_tokens}
    if meta.get("keep"):
        meta["layers"] = len(meta["keep"])
    if args.resume:     # the data split and its sizes belong to the run, not to the resuming command
        args.prompts, args.heldout, args.new_tokens = meta["prompts"], meta["heldout"], meta["new_tokens"]
    draft = build_draft(target, meta["layers"], meta.get("keep"))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=args.lr)
    if args.init and not args.resume:
        draft.load_state_dict(load_file(Path(args.init) / "draft.safetensors"), strict=False)
    if args.resume:
        draft.load_state_dict(load_file(out / "draft.safetensors"), strict=False)
        opt.load_state_dict(torch.load(out / "optimizer.pt"))
    data = make_data(target, tok, args.prompts + args.heldout, args.new_tokens, 16, out / "data.pt",
                     meta.get("exclude_first", 0))
    train, heldout = data[args.heldout :], data[: args.heldout]
    if not meta["history"]:
        meta["history"].append({"step": 0, "heldout_agreement": agreement(target, draft.eval(), heldout)})
        print(f"held-out top-1 agreement before training: {meta['history'][0]['heldout_agreement']:.3f}")

    deadline = time.time() + 60 * args.minutes
    draft.train()
    bar = tqdm(desc="distilling", unit="seq")
    recent = []
    while time.time() < deadline:
        groups = batches(train, meta.get("batch", 1), seed=0)
        epoch, g = divmod(meta.setdefault("optimizer_steps", 0), len(groups))
        group = [train[i] for i in batches(train, meta.get("batch", 1), seed=epoch)[g]]
        loss, agree = kd_loss(target, draft, group, tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        meta["step"] += len(group)
        meta["optimizer_steps"] += 1
        recent = (recent + [agree])[-20:]
        bar.update(len(group))
        bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{sum(recent) / len(recent):.3f}")
        if meta["optimizer_steps"] % 50 == 0:
            _checkpoint(draft, opt, meta, out)
    bar.close()
    draft.eval()
    meta["history"].append({"step": meta["step"], "heldout_agreement": agreement(target, draft, heldout)})
    _checkpoint(draft, opt, meta, out)
    print(f"held-out top-1 agreement after {meta['step']} sequences: {meta['history'][-1]['heldout_agreement']:.3f}")
    if args.report_spec:
        _report_spec(target, tok, draft, heldout, meta, out)


def _checkpoint(draft, opt, meta, out: Path) -> None:
    save_file(trainable_state(draft), out / "draft.safetensors")
    torch.save(opt.state_dict(), out / "optimizer.pt")
    (out / "draft.json").write_text(json.dumps(meta, indent=1))


def _report_spec(target, tok, draft, heldout, meta, out: Path) -> None:
    import spec_adapt

    texts = [tok.decode(item["ids"][: item["output_start"]]) for item in heldout]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    stats = spec_adapt.SpecStats()
    target.generate(**enc, max_new_tokens=64, do_sample=False, custom_generate=spec_adapt.generate, drafter=draft,
                    assistant_policy=spec_adapt.FixedLength(3), spec_stats=stats)
    meta["spec_report"] = {"alpha": stats.acceptance_rate, "acceptance_length": stats.acceptance_length,
                           "per_position": stats.per_position_acceptance}
    (out / "draft.json").write_text(json.dumps(meta, indent=1))
    print(f"through spec_adapt (gamma = 3, held-out prompts): alpha {stats.acceptance_rate:.3f}, "
          f"acceptance length {stats.acceptance_length:.2f}")


if __name__ == "__main__":
    main()
