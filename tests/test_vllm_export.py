"""A learned Adaptive exported as vLLM's speculative_config, checked against vLLM's documented rules."""

from __future__ import annotations

import json

import pytest
import torch

import spec_adapt
from spec_adapt import Adaptive, PromptLookupDrafter
from spec_adapt.tools.vllm import check_speculative_config, speculative_config

from conftest import PAD, cached_model, ragged_batch


def learned() -> Adaptive:
    policy = Adaptive(max_gamma=5)
    for seed in range(3):
        ids, mask = ragged_batch(2, seed=seed)
        cached_model("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD,
                                       custom_generate=spec_adapt.generate, drafter=PromptLookupDrafter(2, 1),
                                       assistant_policy=policy)
    return policy


@pytest.mark.parametrize("max_batch", [1, 100, 256])
def test_export_covers_every_batch_size_and_keeps_the_rules(max_batch):
    config = speculative_config(learned(), "ngram", max_batch=max_batch, prompt_lookup_max=3)
    table = config["num_speculative_tokens_per_batch_size"]
    assert table[0][0] == 1 and table[-1][1] == max_batch
    assert all(a[1] + 1 == b[0] for a, b in zip(table, table[1:]))
    assert all(0 <= k <= config["num_speculative_tokens"] for _, _, k in table)
    assert config["method"] == "ngram" and config["prompt_lookup_max"] == 3
    assert json.loads(json.dumps(config)) == config                      # plain JSON, as --speculative-config takes


@pytest.mark.parametrize("table, problem", [
    ([[2, 64, 3]], "start at 1"),
    ([[1, 64, 3], [66, 128, 1]], "without gaps"),
    ([[1, 64, 3], [60, 128, 1]], "without gaps"),
    ([[1, 64, 4]], "K must lie"),
    ([[1, 64, -1]], "K must lie"),
    ([[1, 64]], "start_bs, end_bs, K"),
    ([[1, 64, 2.5]], "start_bs, end_bs, K"),
    ([], "non-empty"),
])
def test_check_refuses_what_vllm_documents_as_invalid(table, problem):
    with pytest.raises(ValueError, match=problem):
        check_speculative_config({"method": "draft_model", "num_speculative_tokens": 3,
                                  "num_speculative_tokens_per_batch_size": table})


def test_the_documented_example_passes():
    example = {"method": "eagle", "model": "m", "num_speculative_tokens": 3,
               "num_speculative_tokens_per_batch_size": [[1, 64, 3], [65, 128, 1], [129, 512, 0]]}
    assert check_speculative_config(example) is example


def test_cli_writes_the_config(tmp_path):
    from spec_adapt.tools.cli import main

    path = tmp_path / "adaptive.json"
    learned().save(path)
    with torch.enable_grad():          # the CLI switches autograd off for its process; give it back after
        main(["export-vllm", "--policy", str(path), "--method", "draft_model", "--model", "drafts/qwen-0.5b",
              "--out", str(tmp_path / "config.json")])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model"] == "drafts/qwen-0.5b" and check_speculative_config(config) == config
