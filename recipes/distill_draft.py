"""Distill a small draft for a target that shares its tokenizer (default: SmolLM2-135M-Instruct).

    python recipes/distill_draft.py --layers 2 --minutes 10 --out results/draft-2l
    python recipes/distill_draft.py --resume results/draft-2l          # continue where it stopped

The draft is the target's architecture with `--layers` decoder layers, initialized from the target's first layers;
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


def build_draft(target, layers: int):
    from spec_adapt.synthetic import truncated_copy

    draft = truncated_copy(target, layers).train()               # first layers, embeddings, norm, head
    draft.model.embed_tokens = target.model.embed_tokens          # shared, frozen
    draft.lm_head = target.lm_head
    for p in list(draft.model.embed_tokens.parameters()) + list(draft.lm_head.parameters()):
        p.requires_grad_(False)
    return draft


def trainable_state(draft) -> dict:
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    return {k: v.detach().contiguous() for k, v in draft.state_dict().items() if k not in shared}


def load_draft(target, path: str | Path):
    """Rebuild a distilled draft: the target's shared weights plus the saved layers."""
    path = Path(path)
    meta = json.loads((path / "draft.json").read_text())
    draft = build_draft(target, meta["layers"])
    draft.load_state_dict(load_file(path / "draft.safetensors"), strict=False)
    return draft.eval()


def make_data(target, tok, n: int, new_tokens: int, batch: int, cache: Path) -> list[torch.Tensor]:
    """Token sequences (prompt + the target's greedy output), with the index where the output starts."""
    if cache.exists():
        return torch.load(cache)
    from spec_adapt.recipes import workloads

    prompts = list(workloads.with_inputs(workloads.sharegpt(limit=n, max_chars=1000), tok)["input_text"])
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


def kd_loss(target, draft, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        teacher = target(ids[None]).logits[0, start - 1 : -1].float()
    student = draft(ids[None]).logits[0, start - 1 : -1].float()
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
    parser.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--heldout", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--out", default="results/draft")
    parser.add_argument("--resume", help="an output folder to continue from")
    parser.add_argument("--report-spec", action="store_true", help="also measure acceptance through spec_adapt")
    args = parser.parse_args()

    from spec_adapt.models import load_model

    out = Path(args.resume or args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    target, tok = load_model()
    for p in target.parameters():
        p.requires_grad_(False)
    meta = json.loads((out / "draft.json").read_text()) if args.resume else {
        "layers": args.layers, "step": 0, "history": [], "prompts": args.prompts, "heldout": args.heldout,
        "new_tokens": args.new_tokens}
    if args.resume:     # the data split and its sizes belong to the run, not to the resuming command
        args.prompts, args.heldout, args.new_tokens = meta["prompts"], meta["heldout"], meta["new_tokens"]
    draft = build_draft(target, meta["layers"])
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=args.lr)
    if args.resume:
        draft.load_state_dict(load_file(out / "draft.safetensors"), strict=False)
        opt.load_state_dict(torch.load(out / "optimizer.pt"))
    data = make_data(target, tok, args.prompts + args.heldout, args.new_tokens, 16, out / "data.pt")
    train, heldout = data[args.heldout :], data[: args.heldout]
    if not meta["history"]:
        meta["history"].append({"step": 0, "heldout_agreement": agreement(target, draft.eval(), heldout)})
        print(f"held-out top-1 agreement before training: {meta['history'][0]['heldout_agreement']:.3f}")

    deadline = time.time() + 60 * args.minutes
    draft.train()
    bar = tqdm(desc="distilling", unit="seq")
    recent = []
    while time.time() < deadline:
        item = train[meta["step"] % len(train)]
        loss, agree = kd_loss(target, draft, item["ids"], item["output_start"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        meta["step"] += 1
        recent = (recent + [agree])[-50:]
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{sum(recent) / len(recent):.3f}")
        if meta["step"] % 200 == 0:
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
