"""A target sharded over processes by transformers' tensor and pipeline parallelism (torchrun, 2 ranks, gloo on the
CPU): every rank's spec_adapt output equals stock greedy generate, whatever each rank's policy would answer and
whichever rank's drafter fails, and a decision that fails on the leading rank fails every rank (no hang)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spec_adapt.distributed import Solo, ranks_of
from spec_adapt.ledger import KVLedger

from conftest import ragged_batch, tiny_model

RUN = Path(__file__).parent / "distributed" / "sharded_run.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-models")
    for arch in ("llama", "qwen2"):
        tiny_model(arch, seed=4).save_pretrained(root / arch)
        tiny_model(arch, seed=5, layers=1).save_pretrained(root / f"{arch}-draft")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("plan", ["tp", "pp"])
def test_sharded_target_speculates_identically_on_every_rank(models, tmp_path, plan):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(RUN), str(models), plan, str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    errors = "\n".join(line for line in done.stderr.splitlines() if "rror" in line or "terminate" in line)
    assert done.returncode == 0, (errors[-4000:] or done.stderr[-3000:])
    ranks = json.loads((tmp_path / f"{plan}.json").read_text())
    assert len(ranks) == 2
    for name, first in ranks[0].items():
        if "stock sharded" in name:           # transformers' own behaviour, reported, not ours to assert
            continue
        second = ranks[1][name]
        assert first["identical"] and second["identical"], name
        if "output" in first:
            assert first["sharded"] and first["output"] == second["output"], name
    for arch in ("llama", "qwen2"):
        assert ranks[0][f"{arch} twin draft model"]["accepted"] > 0          # the draft model really drafted
        assert "rank 0" in ranks[0][f"{arch} drafter fails on rank 0"]["fallback"]
        assert ranks[1][f"{arch} drafter fails on rank 0"]["fallback"] == ranks[0][f"{arch} drafter fails on rank 0"][
            "fallback"]                                                     # every rank reports the leader's
        assert ranks[0][f"{arch} drafter fails on rank 1"]["fallback"] is None   # rank 1 never runs the drafter


def test_an_unsharded_model_decides_alone():
    assert isinstance(ranks_of(tiny_model("llama")), Solo) and not ranks_of(tiny_model("llama")).sharded


def test_full_masks_equal_the_two_dimensional_path():
    """What a pipeline stage gets from the ledger (a 4-D causal mask over the slots, holes masked) computes the same
    logits as the 2-D mask transformers expands itself."""
    model = tiny_model("llama")
    ids, mask = ragged_batch(3, seed=2)
    more = torch.randint(3, 90, (3, 4))
    outputs = []
    with torch.no_grad():
        for full in (False, True):
            ledger = KVLedger(model)
            ledger._full_masks = full
            first = ledger.prefill(ids, mask)
            second = ledger.forward(more, torch.tensor([4, 2, 3]))           # columns past a row's count: holes
            ledger.rollback(ledger.n_cached - torch.tensor([2, 0, 1]))
            third = ledger.forward(more[:, :2], torch.tensor([2, 2, 2]))
            outputs.append((first, second, third))
    (a1, a2, a3), (b1, b2, b3) = outputs
    torch.testing.assert_close(a1, b1, rtol=1e-5, atol=1e-5)
    for row, n in enumerate([4, 2, 3]):
        torch.testing.assert_close(a2[row, :n], b2[row, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a3, b3, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["scripted", "tree", "draft model"])
def test_a_target_offloaded_by_accelerate_speculates_identically(tmp_path, case):
    """A target larger than its memory cap: accelerate keeps part of it in memory and streams the rest from disk at
    every forward (device_map="auto", max_memory, offload_folder). spec_adapt equals stock generate on it."""
    import spec_adapt
    from spec_adapt import FixedLength, FixedTree, ModelDrafter, ScriptedDrafter
    from transformers import AutoModelForCausalLM

    plain = tiny_model("llama", seed=4, layers=4)
    plain.save_pretrained(tmp_path / "model")
    cap = sum(p.numel() * p.element_size() for p in plain.parameters()) // 3
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="auto", max_memory={"cpu": cap},
                                                  offload_folder=str(tmp_path / "offload"), dtype=torch.float32)
    assert "disk" in set(target.hf_device_map.values())
    ids, mask = ragged_batch(3, seed=1)
    stock = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                 eos_token_id=None)
    reference = target.generate(**stock)
    pad = (mask == 0).sum(1).tolist()

    def truth(row, context, gamma):
        right = reference[row, pad[row]:].tolist()[len(context): len(context) + gamma]
        return [right, [(t + 1) % 96 for t in right]] if case == "tree" else right[: gamma - row % 2]

    drafter, policy = {"scripted": (ScriptedDrafter(truth), FixedLength(3)),
                       "tree": (ScriptedDrafter(truth), FixedTree(6, 3)),
                       "draft model": (ModelDrafter(plain), FixedLength(4))}[case]
    stats = spec_adapt.SpecStats()
    out = target.generate(**stock, custom_generate=spec_adapt.generate, drafter=drafter, assistant_policy=policy,
                          spec_stats=stats)
    assert torch.equal(out, reference) and stats.accepted > 0
