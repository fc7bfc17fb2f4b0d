"""Every script in benchmarks/ runs its `--smoke` mode (tiny random-weight models, the smallest sizes, written to a
temporary folder) as its own process and exits 0: a script that loses its smoke mode, or whose code path breaks,
fails here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))   # _smoke.py: shared
TIMEOUT_S = 90


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 20


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_smoke_mode_runs(script, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEC_ADAPT_POLICY_DIR="off", MPLBACKEND="Agg")
    run = subprocess.run([sys.executable, str(script), "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"{script.name} --smoke exited {run.returncode}:\n{run.stdout[-2000:]}\n" \
                                f"{run.stderr[-4000:]}"


def test_the_early_exit_benchmarks_shape_only_cost_model(monkeypatch):
    """benchmarks/early_exit.py's shape-only cost model: the LM head in decoder layers, and where pruning pays."""
    from transformers import LlamaConfig, Qwen2Config

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))      # the script imports _smoke
    spec = importlib.util.spec_from_file_location("early_exit_benchmark", ROOT / "benchmarks" / "early_exit.py")
    spec.loader.exec_module(script := importlib.util.module_from_spec(spec))
    head_cost_in_layers, predicted_gain = script.head_cost_in_layers, script.predicted_gain

    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                       num_key_value_heads=3, num_hidden_layers=30)
    qwen = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                       num_key_value_heads=2, num_hidden_layers=28)
    llama7b = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                          num_key_value_heads=32, num_hidden_layers=32)
    assert 6 < head_cost_in_layers(smol) < 10
    assert 4 < head_cost_in_layers(qwen) < 7
    assert head_cost_in_layers(llama7b) < 1
    # 7B, checkpoint at layer 16, width 6, rows keep 2 positions on average: pruning pays; SmolLM2 at layer 15 not.
    assert predicted_gain(llama7b, 6, 2.0, 16) > 0
    assert predicted_gain(smol, 6, 4.0, 15) < 0
