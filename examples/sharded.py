"""A target sharded over processes by transformers (tensor or pipeline parallelism), speculating as on one process.

The same script runs on every rank; the first rank drafts and decides, the others follow (docs/distributed.md).
Output equals stock greedy generate.

    torchrun --nproc-per-node 2 examples/sharded.py               # tensor parallel
    torchrun --nproc-per-node 2 examples/sharded.py --plan pp     # pipeline parallel
"""

import argparse

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

import spec_adapt
from spec_adapt import Adaptive, PromptLookupDrafter
from spec_adapt.tools.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--plan", choices=["tp", "pp"], default="tp")
parser.add_argument("--model", default="qwen2.5-coder-0.5b")     # 14 heads, 2 KV heads: divisible by 2 ranks
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
config = DistributedConfig(tp_size=2) if args.plan == "tp" else DistributedConfig(pp_size=2)
model, tok = load_model(args.model, distributed_config=config)

messages = [[{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
            [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]]
text = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
batch = tok(text, return_tensors="pt", padding=True)
kwargs = dict(max_new_tokens=48, do_sample=False)

out = model.generate(**batch, **kwargs, custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(),
                     assistant_policy=Adaptive())
stats = spec_adapt.last_stats()
if args.plan == "tp":     # under pp, transformers' own generate builds a wrong mask for a padded batch
    stock = model.generate(**batch, **kwargs)
    same = torch.equal(out, stock)
else:
    same = None
if dist.get_rank() == 0:
    print(tok.decode(out[0, batch.input_ids.shape[1]:], skip_special_tokens=True))
    print(f"ranks: {dist.get_world_size()} ({args.plan}); verification steps: {stats.steps}; "
          f"drafts accepted: {stats.accepted}/{stats.drafted}" + ("" if same is None else f"; equal to stock: {same}"))
dist.destroy_process_group()
