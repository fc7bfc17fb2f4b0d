"""What a learned policy says, as vLLM's `speculative_config`: the widths that paid per batch size on this machine.

    config = speculative_config(policy, method="draft_model", model="path/to/draft", max_batch=256)
    # vllm serve <target> --speculative-config "$(python -c 'import json; print(json.dumps(config))')"

`num_speculative_tokens_per_batch_size` is vLLM's dynamic speculative decoding table: entries [start_bs, end_bs, K]
mean K draft tokens while the running batch size is within [start_bs, end_bs]; K = 0 turns drafting off there and K
never exceeds `num_speculative_tokens`. `check_speculative_config` checks a config against those documented rules
(the ranges start at 1, are inclusive, ascending and contiguous). `benchmarks/vllm_config_check.py` checks the
exported configs against vLLM's own `SpeculativeConfig` in an environment where vLLM is installed (vLLM is not a
dependency of this library).

`LookupProposer` and `SuffixProposer` serve spec_adapt's prompt lookup and suffix index inside vLLM as a
`custom_class` proposer (`{"method": "custom_class", "model": "spec_adapt.tools.vllm.SuffixProposer",
"num_speculative_tokens": 5, ...}`: vLLM reads the class path from `model`), following the documented interface:
`__init__(vllm_config)`, `load_model()`,
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]`. They honour
`num_speculative_tokens_per_batch_size` themselves. vLLM's own loader loads them (benchmarks/vllm_config_check.py);
this library's tests do not run them inside a serving vLLM engine.
"""

from __future__ import annotations

import numbers

import torch

from ..drafters.lookup import lookup_continuation
from ..drafters.suffix import SuffixIndex

# vLLM's speculative methods (its SpeculativeConfig.method; the model-specific MTP names reduce to "mtp"), and
# custom_class, which serves this module's proposers: what `spec-adapt export-vllm --method` takes.
METHODS = ("draft_model", "ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator",
           "dflash", "custom_class")


def speculative_config(policy, method: str, model: str | None = None, max_batch: int = 256, **extra) -> dict:
    """The `speculative_config` for vLLM from a policy with `to_vllm_schedule(max_batch)` (e.g. a learned
    `Adaptive`). `method`: vLLM's method name ("draft_model", "ngram", "suffix", ...); `model`: the draft's path for
    model-based methods; `extra`: further keys passed through (e.g. prompt_lookup_max for "ngram")."""
    if not hasattr(policy, "to_vllm_schedule"):
        raise TypeError(f"{type(policy).__name__} has no to_vllm_schedule(): export a learned spec_adapt.Adaptive.")
    from spec_adapt.policies.adaptive import MAX_EXPORT_BATCH

    if not _whole(max_batch) or not 1 <= max_batch <= MAX_EXPORT_BATCH:
        raise ValueError(f"max_batch must be an int in [1, {MAX_EXPORT_BATCH}], got {max_batch!r}.")
    table = [[int(lo), int(hi), int(k)] for lo, hi, k in policy.to_vllm_schedule(max_batch)]
    config = {"method": method, **({"model": model} if model is not None else {}),
              "num_speculative_tokens": max(1, max(k for _, _, k in table)),
              "num_speculative_tokens_per_batch_size": table, **extra}
    return check_speculative_config(config)


def check_speculative_config(config: dict) -> dict:
    """Raise ValueError naming the first rule `config` breaks; return it unchanged when it keeps them all."""
    if not isinstance(config, dict) or not isinstance(config.get("method"), str):
        raise ValueError("A speculative_config is a dict with a 'method' (e.g. 'draft_model', 'ngram').")
    if config["method"] == "custom_class" and "." not in str(config.get("model") or ""):
        raise ValueError("method 'custom_class' takes the proposer's class path in 'model', e.g. "
                         "'spec_adapt.tools.vllm.SuffixProposer'.")
    top = config.get("num_speculative_tokens")
    if not _whole(top) or top < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {top!r}.")
    table = config.get("num_speculative_tokens_per_batch_size")
    if table is not None:
        check_schedule(table, top)
    return config


def check_schedule(table, top: int) -> None:
    """A per-batch-size table [[start_bs, end_bs, K], ...]: ranges from 1, inclusive, contiguous; 0 <= K <= top."""
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


def _whole(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class LookupProposer:
    """vLLM `custom_class` proposer: prompt lookup (the longest n-gram match of each request's context, from
    `prompt_lookup_max` down to `prompt_lookup_min` tokens, defaults 3 and 1)."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        table = getattr(spec, "num_speculative_tokens_per_batch_size", None)
        if table is not None:
            check_schedule([list(e) for e in table], self.k)
        self.table = [tuple(int(x) for x in e) for e in table] if table else None
        # vLLM sets prompt_lookup_max/min to 0 for custom_class: 0 or absent means the defaults, 3 and 1.
        self.max_ngram = int(getattr(spec, "prompt_lookup_max", None) or 3)
        self.min_ngram = int(getattr(spec, "prompt_lookup_min", None) or 1)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt_lookup_min/max must satisfy 1 <= min <= max, got {self.min_ngram}, "
                             f"{self.max_ngram}.")
        self.max_model_len = int(vllm_config.model_config.max_model_len)

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the proposer reads the requests' own tokens."""

    def width(self, batch: int) -> int:
        """Draft tokens per request at this running batch size (the table's K, else num_speculative_tokens)."""
        if self.table is None:
            return self.k
        for start, end, k in self.table:
            if start <= batch <= end:
                return k
        return self.table[-1][2]          # past the table's last range (it starts at 1 and has no gaps)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        """Drafts per request; a request that sampled nothing this step (still in prefill) gets none, and none
        runs past max_model_len."""
        active = [i for i, sampled in enumerate(sampled_token_ids) if len(sampled)]
        width = self.width(len(active))
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for i in active:
            length = int(num_tokens_no_spec[i])
            room = min(width, self.max_model_len - length)
            if room > 0:
                drafts[i] = self._draft(i, torch.as_tensor(token_ids_cpu[i, :length]).long(), room)
        return drafts

    def _draft(self, row: int, context: torch.Tensor, width: int) -> list[int]:
        return lookup_continuation(context, width, self.max_ngram, self.min_ngram).tolist()


class SuffixProposer(LookupProposer):
    """vLLM `custom_class` proposer: spec_adapt's suffix index, shared by every request the server has seen (the
    repeated text of agents and templated traffic), each request's own tokens indexed as it goes."""

    def __init__(self, vllm_config, min_share: float = 0.3, depth: int = 8):
        super().__init__(vllm_config)
        self.index, self.min_share = SuffixIndex(depth), min_share
        self.rows: dict[int, tuple] = {}    # batch row -> (its request's first tokens, tokens of it indexed)

    def _draft(self, row: int, context: torch.Tensor, width: int) -> list[int]:
        tokens = context.tolist()
        head, indexed = self.rows.get(row, ((), 0))
        if tuple(tokens[: len(head)]) != head or indexed > len(tokens):     # another request holds this row now
            head, indexed = (), 0
        self.index.add(tokens, start=indexed)
        self.rows[row] = (tuple(tokens[:16]), len(tokens))
        return self.index.continuation(tokens, width, self.min_share)
