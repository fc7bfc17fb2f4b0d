"""The demo's own path (`spec-adapt demo`), on a tiny model in place of the real pair: where the CPU computes bf16
natively it times a bf16 copy of the target beside the float32 one, each judged against stock on its own copy."""

from __future__ import annotations

import copy

import pytest
import torch

from spec_adapt.tools import cli

from conftest import cached_model
from tiny_tokenizers import char_tokenizer


@pytest.fixture
def tiny_demo(monkeypatch):
    from spec_adapt.tools import models

    plan = dict(draft=None, configs=["target", "lookup:fixed2"], batch_sizes=[1], prompts=1, new_tokens=4,
                repeats=1, code="humaneval")
    monkeypatch.setattr(cli, "DEMOS", {"smollm2-135m": plan})
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"     # ShareGPT's prompts are chats
    # A fresh model per load, as the real loader gives: the demo converts its bfloat16 phase's copy in place.
    monkeypatch.setattr(models, "load_model", lambda name, dtype=None: (copy.deepcopy(cached_model("llama")), tok))
    monkeypatch.setattr(models, "load_tokenizer", lambda name: tok)


@pytest.mark.parametrize("native", [True, False])
def test_the_demo_adds_bf16_rows_where_bf16_is_native(tiny_demo, monkeypatch, capsys, native):
    monkeypatch.setattr(cli, "bf16_capability",
                        lambda device: (torch.bfloat16 if native else torch.float32, "forced by the test"))
    with torch.enable_grad():
        cli.main(["demo", "--model", "smollm2-135m", "--no-prepare"])
    printed = capsys.readouterr().out
    assert ("target@bf16" in printed) is native and ("lookup:fixed2@bf16" in printed) is native
    checks = [line for line in printed.splitlines() if " B=1: " in line]
    assert checks and not any("DIFFERENT" in line for line in checks)
    assert any("lookup:fixed2@bf16" in line for line in checks) is native
    assert next(cached_model("llama").parameters()).dtype == torch.float32     # the copy, never the target itself


def test_the_demo_holds_one_target_at_a_time(tiny_demo, monkeypatch, capsys):
    """The eager target, the prepared target and its bfloat16 copy each run their rows in a phase of their own: a
    target is loaded only once the previous one is gone, so the demo needs the memory of one target (and the draft)."""
    import copy
    import gc
    import weakref

    from spec_adapt.tools import models

    loaded, tok = [], models.load_model("smollm2-135m")[1]

    def load(name, dtype=None):
        gc.collect()
        alive = [ref() for ref in loaded if ref() is not None]
        assert not alive, f"{len(alive)} target(s) still in memory when the next one loads"
        model = copy.deepcopy(cached_model("llama"))
        loaded.append(weakref.ref(model))
        return model, tok

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(cli, "bf16_capability", lambda device: (torch.bfloat16, "forced by the test"))
    with torch.enable_grad():
        cli.main(["demo", "--model", "smollm2-135m"])
    printed = capsys.readouterr().out
    assert len(loaded) == 3          # the eager, prepared and bfloat16 phases' targets, each loaded once
    for config in ("target-eager", "target@bf16", "lookup:fixed2@bf16"):
        assert config in printed
    checks = [line for line in printed.splitlines() if " B=1: " in line]
    assert checks and not any("DIFFERENT" in line for line in checks)
    for workload in ("HumanEval", "ShareGPT"):     # each configuration ran in one phase only: one row per table
        table = printed.split(f"--- {workload} ---")[1].strip().split("\n\n")[0].splitlines()
        rows = [line.split()[0] for line in table if line.split() and line.split()[0] in
                ("target", "target-eager", "lookup:fixed2", "target@bf16", "lookup:fixed2@bf16")]
        assert sorted(rows) == sorted({*rows}) and len(rows) == 5, table
    assert "Peak resident memory: " in printed
