"""What a learned policy says, as vLLM's `speculative_config`: the widths that paid per batch size on this machine.

    config = speculative_config(policy, method="draft_model", model="path/to/draft", max_batch=256)
    # vllm serve <target> --speculative-config "$(python -c 'import json; print(json.dumps(config))')"

`num_speculative_tokens_per_batch_size` is vLLM's dynamic speculative decoding table: entries [start_bs, end_bs, K]
mean K draft tokens while the running batch size is within [start_bs, end_bs]; K = 0 turns drafting off there and K
never exceeds `num_speculative_tokens`. `check_speculative_config` checks a config against those documented rules
(the ranges start at 1, are inclusive, ascending and contiguous). It was not checked against vLLM's own config class
here: vLLM is not a dependency of this library.
"""

from __future__ import annotations

import numbers


def speculative_config(policy, method: str, model: str | None = None, max_batch: int = 256, **extra) -> dict:
    """The `speculative_config` for vLLM from a policy with `to_vllm_schedule(max_batch)` (e.g. a learned
    `Adaptive`). `method`: vLLM's method name ("draft_model", "ngram", "suffix", ...); `model`: the draft's path for
    model-based methods; `extra`: further keys passed through (e.g. prompt_lookup_max for "ngram")."""
    if not hasattr(policy, "to_vllm_schedule"):
        raise TypeError(f"{type(policy).__name__} has no to_vllm_schedule(): export a learned spec_adapt.Adaptive.")
    table = [[int(lo), int(hi), int(k)] for lo, hi, k in policy.to_vllm_schedule(max_batch)]
    config = {"method": method, **({"model": model} if model is not None else {}),
              "num_speculative_tokens": max(1, max(k for _, _, k in table)),
              "num_speculative_tokens_per_batch_size": table, **extra}
    return check_speculative_config(config)


def check_speculative_config(config: dict) -> dict:
    """Raise ValueError naming the first rule `config` breaks; return it unchanged when it keeps them all."""
    if not isinstance(config, dict) or not isinstance(config.get("method"), str):
        raise ValueError("A speculative_config is a dict with a 'method' (e.g. 'draft_model', 'ngram').")
    top = config.get("num_speculative_tokens")
    if not _whole(top) or top < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {top!r}.")
    table = config.get("num_speculative_tokens_per_batch_size")
    if table is None:
        return config
    if not isinstance(table, list) or not table:
        raise ValueError("num_speculative_tokens_per_batch_size must be a non-empty list of [start_bs, end_bs, K].")
    expected_start = 1
    for entry in table:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(_whole(x) for x in entry)):
            raise ValueError(f"Each entry is [start_bs, end_bs, K] of ints, got {entry!r}.")
        start, end, k = entry
        if start != expected_start or end < start:
            raise ValueError(f"Batch-size ranges must start at 1 and follow each other without gaps or overlaps; "
                             f"{entry!r} should start at {expected_start} and end at or after its start.")
        if not 0 <= k <= top:
            raise ValueError(f"K must lie in [0, num_speculative_tokens={top}], got {k} in {entry!r}.")
        expected_start = end + 1
    return config


def _whole(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
