"""Errors a user of the `spec-adapt` command can cause (a file that is not what the option takes, a value out of
range): one line `spec-adapt: error: ...` on stderr and exit status 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from spec_adapt import Adaptive
from spec_adapt.tools.cli import main


def run_main(argv):
    """main(argv) in this process: (exit status, stderr lines)."""
    with torch.enable_grad():          # the CLI switches autograd off for its process; give it back after
        with pytest.raises(SystemExit) as exited:
            main(argv)
    return exited.value.code


def saved_policy(folder):
    path = folder / "adaptive.json"
    Adaptive(max_gamma=4).save(path)
    return path


@pytest.mark.parametrize("content", ["", '{"config": {"max_gamma"', "[1, 2]", '{"steps": 3}', '{"config": [1]}',
                                     '{"config": {"max_gamma": "many"}}'])
def test_a_policy_file_that_is_not_one_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "policy.json"
    path.write_text(content)
    assert run_main(["export-vllm", "--policy", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-adapt: error: ") and str(path) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_missing_policy_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "nowhere.json"
    assert run_main(["export-vllm", "--policy", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-adapt: error: ") and str(path) in err and err.count("\n") == 1


def test_a_value_out_of_range_is_one_line(tmp_path, capsys):
    assert run_main(["export-vllm", "--policy", str(saved_policy(tmp_path)), "--max-batch", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-adapt: error: ") and "max_batch" in err and err.count("\n") == 1


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("")
    assert run_main(["export-vllm", "--policy", str(saved_policy(tmp_path)), "--out", str(out / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-adapt: error: ") and str(out / "config.json") in err and err.count("\n") == 1


def test_an_option_check_of_a_command_has_the_same_form(capsys):
    """Checks a command makes itself (here bench's numbers, before any model loads) end the same way."""
    with pytest.raises(SystemExit, match="--num-prompts must be at least 1") as exited:
        with torch.enable_grad():
            main(["bench", "--num-prompts", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == "spec-adapt: error: --num-prompts must be at least 1, got 0\n"


def test_the_command_exits_2_without_a_traceback(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text("[1, 2]")
    done = subprocess.run([sys.executable, "-m", "spec_adapt.tools.cli", "export-vllm", "--policy", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("spec-adapt: error: ") and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""


def test_a_good_file_still_exports(tmp_path, capsys):
    with torch.enable_grad():
        main(["export-vllm", "--policy", str(saved_policy(tmp_path)), "--method", "ngram"])
    assert json.loads(capsys.readouterr().out)["method"] == "ngram"


def test_spec_adapt_traceback_shows_the_error_itself(tmp_path, monkeypatch):
    path = tmp_path / "policy.json"
    path.write_text("[1, 2]")
    monkeypatch.setenv("SPEC_ADAPT_TRACEBACK", "1")
    with torch.enable_grad(), pytest.raises(ValueError, match="is not an Adaptive state"):
        main(["export-vllm", "--policy", str(path)])
