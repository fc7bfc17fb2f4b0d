"""Every script in benchmarks/ runs its `--smoke` mode (tiny random-weight models, the smallest sizes, written to a
temporary folder) as its own process and exits 0: a script that loses its smoke mode, or whose code path breaks,
fails here."""

from __future__ import annotations

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
