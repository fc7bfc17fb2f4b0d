"""Run by tests/test_distributed.py under torchrun (2 ranks, gloo): a target sharded by transformers' tensor or
pipeline parallelism speculates token-identically to stock `generate` under the same plan, on every rank.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/sharded_run.py MODELS_DIR tp|pp OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import spec_adapt
from spec_adapt import Adaptive, EarlyExitVerifier, Engine, FixedLength, FixedTree, ModelDrafter, ScriptedDrafter
from spec_adapt.distributed import Ranks, ranks_of
from spec_adapt.policies.policy import Policy

PAD, NEW = 0, 20


def ragged_batch():
    gen = torch.Generator().manual_seed(3)
    lengths, width = [9, 5, 7], 9
    ids = torch.full((3, width), PAD, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(3, 96, (n,), generator=gen)
        mask[b, width - n:] = 1
    return ids, mask


class Truth:
    """Scripted drafts from the stock output: row 0 right, row 1 wrong, row 2 right for 2 tokens; `branches` adds
    a wrong sibling at every depth (a tree)."""

    def __init__(self, reference, mask, branches=False, fail_on=None, fail_at=3):
        self.reference, self.pad, self.branches = reference, (mask == 0).sum(1).tolist(), branches
        self.fail_on, self.fail_at, self.calls = fail_on, fail_at, 0

    def __call__(self, row, context, gamma):
        self.calls += 1
        if self.fail_on == dist.get_rank() and self.calls == self.fail_at:
            raise RuntimeError(f"draft failure on rank {dist.get_rank()}")
        truth = self.reference[row, self.pad[row]:].tolist()[len(context): len(context) + gamma]
        right = {0: len(truth), 1: 0, 2: 2}[row]
        chain = truth[:right] + [(t + 1) % 96 for t in truth[right:]]
        if not self.branches:
            return chain
        return [chain, [(t + 5) % 96 for t in chain]]


class RankPolicy(Policy):
    """Answers differently on every rank (as wall-clock timings would): 1 on rank 0, 4 on rank 1."""

    def choose(self, info):
        return 1 + 3 * dist.get_rank()


class BrokenPolicy(Policy):
    def choose(self, info):
        raise ValueError("broken policy")


def main():
    models, plan, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = DistributedConfig(tp_size=2) if plan == "tp" else DistributedConfig(pp_size=2)
    ids, mask = ragged_batch()
    results = {}
    for arch in ("llama", "qwen2"):
        target = AutoModelForCausalLM.from_pretrained(models / arch, distributed_config=config, dtype=torch.float32)
        draft = AutoModelForCausalLM.from_pretrained(models / f"{arch}-draft", dtype=torch.float32)
        twin = AutoModelForCausalLM.from_pretrained(models / arch, dtype=torch.float32)    # unsharded: drafts agree
        sharded = isinstance(ranks_of(target), Ranks)
        stock = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                     eos_token_id=None)
        with torch.no_grad():
            ref, unsharded = target.generate(**stock), twin.generate(**stock)
        # transformers' pipeline stages after the first build a padded batch's mask from a cache layer they do not
        # hold, so stock generate under the pipeline plan differs from the model; spec_adapt's ledger gives every
        # stage its full mask. The reference is then the unsharded model's stock output.
        results[f"{arch} stock sharded == unsharded"] = {"identical": bool(torch.equal(ref, unsharded))}
        if plan == "pp":
            ref = unsharded
        cases = {
            "scripted": (ScriptedDrafter(Truth(ref, mask)), FixedLength(3)),
            "tree": (ScriptedDrafter(Truth(ref, mask, branches=True)), FixedTree(6, 3)),
            "draft model": (ModelDrafter(draft), Adaptive()),
            "twin draft model": (ModelDrafter(twin), FixedLength(4)),
            "policy differs per rank": (ScriptedDrafter(Truth(ref, mask)), RankPolicy()),
            "drafter fails on rank 0": (ScriptedDrafter(Truth(ref, mask, fail_on=0)), FixedLength(3)),
            "drafter fails on rank 1": (ScriptedDrafter(Truth(ref, mask, fail_on=1)), FixedLength(3)),
        }
        for name, (drafter, policy) in cases.items():
            stats = spec_adapt.SpecStats()
            out_ids = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                                      pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate,
                                      drafter=drafter, assistant_policy=policy, spec_stats=stats)
            results[f"{arch} {name}"] = {"identical": bool(torch.equal(out_ids, ref)), "sharded": sharded,
                                         "accepted": stats.accepted, "fallback": stats.fallback,
                                         "output": out_ids.tolist()}
        torch.manual_seed(100 + rank)          # each rank's own random numbers: the leader's draws must win
        sampled = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW,
                                  pad_token_id=PAD, eos_token_id=None, custom_generate=spec_adapt.generate,
                                  drafter=ModelDrafter(twin), assistant_policy=FixedLength(3))
        results[f"{arch} sampling"] = {"identical": True, "sharded": sharded, "output": sampled.tolist(),
                                       "accepted": -1, "fallback": None}
        for refused, make in (("EarlyExitVerifier", lambda: target.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=2, custom_generate=spec_adapt.generate,
                drafter=ScriptedDrafter(Truth(ref, mask)), verifier=EarlyExitVerifier())),
                ("Engine", lambda: Engine(target))):
            try:
                make()
                results[f"{arch} {refused} refused"] = {"identical": False}
            except ValueError as exc:
                results[f"{arch} {refused} refused"] = {"identical": "sharded" in str(exc)}
        try:                                   # a decision that fails on the leader fails every rank, no hang
            target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                            eos_token_id=None, custom_generate=spec_adapt.generate,
                            drafter=ScriptedDrafter(Truth(ref, mask)), assistant_policy=BrokenPolicy())
            results[f"{arch} policy error reaches every rank"] = {"identical": False}
        except Exception as exc:  # noqa: BLE001
            results[f"{arch} policy error reaches every rank"] = {"identical": "broken policy" in str(exc)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{plan}.json").write_text(json.dumps(everyone))
    dist.barrier()                 # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
