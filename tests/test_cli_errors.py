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
    assert err.startswith("spec-adapt: error: ") and "--max-batch" in err and err.count("\n") == 1


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("")
    assert run_main(["export-vllm", "--policy", str(saved_policy(tmp_path)), "--out", str(out / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spec-adapt: error: ") and str(out / "config.json") in err and err.count("\n") == 1


def test_an_option_check_of_a_command_has_the_same_form(capsys):
    """An argument type's refusal and a command's own check of options read together (here bench's batch sizes
    against its prompts) end the same way, before any model loads."""
    with pytest.raises(SystemExit, match="--num-prompts: takes a whole number of at least 1") as exited:
        with torch.enable_grad():
            main(["bench", "--num-prompts", "0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == ("spec-adapt: error: argument --num-prompts: takes a whole number of at least 1, "
                                       "got '0'\n")
    assert run_main(["bench", "--num-prompts", "2", "--batch-sizes", "1", "4"]) == 2
    assert capsys.readouterr().err == ("spec-adapt: error: argument --batch-sizes: takes batch sizes of at most "
                                       "--num-prompts (2), got 4\n")


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


# Every subcommand's every numeric option against the values that break numbers: each refused value is one line
# naming the option, exit status 2, no traceback, no hang, and no command started (so no model loads); each value
# the option takes reaches the command. The cases are derived from TABLE and NAMES.

BIG = str(10**12)
PROBES = ("0", "-1", "nan", "inf", BIG, "abc")
EVERY = frozenset(PROBES)
AT_LEAST_1 = EVERY - {BIG}            # a count of prompts, repeats, requests: a larger one only runs longer
FROM_0 = EVERY - {"0"}                # a draft length: 0 is plain decoding
ABOVE_0 = EVERY - {BIG}               # a finite number above 0 with no upper bound (MB, temperature, a lab rate)
SEED = EVERY - {"0", BIG}
# subcommand -> (the arguments it cannot run without, {an option with {} for the value: the probes it refuses})
TABLE = {
    "bench": ([], {"--num-prompts={}": AT_LEAST_1, "--rows={}": AT_LEAST_1, "--batch-sizes={}": EVERY,
                   "--new-tokens={}": EVERY, "--repeats={}": AT_LEAST_1, "--draft-layers={}": AT_LEAST_1,
                   "--target-memory={}": AT_LEAST_1, "--bound={}": EVERY}),
    "profile": ([], {"--draft-layers={}": AT_LEAST_1, "--batch-sizes={}": EVERY, "--lengths={}": FROM_0,
                     "--lags={}": EVERY, "--context={}": EVERY, "--repeats={}": AT_LEAST_1}),
    "lab": (["--latency", "latency.json"],
            {"--num-prompts={}": AT_LEAST_1, "--new-tokens={}": EVERY, "--cycles={}": EVERY, "--max-batch={}": EVERY,
             "--schedules=static:{}": EVERY, "--schedules=batches:{}": EVERY, "--schedules=poisson:{}": ABOVE_0,
             "--schedules=curve:{}": ABOVE_0}),
    # --rates and --duration: at most a million expected arrivals (rate x seconds) with the other's default
    "serve-bench": ([], {"--draft-layers={}": AT_LEAST_1, "--num-prompts={}": AT_LEAST_1, "--rates={}": EVERY,
                         "--duration={}": EVERY, "--max-batch={}": EVERY, "--memory-budget={}": ABOVE_0,
                         "--phases={}:30": EVERY, "--phases=1:{}": EVERY, "--new-tokens={}": EVERY,
                         "--seed={}": SEED}),
    "export-vllm": (["--policy", "policy.json"], {"--max-batch={}": EVERY}),
    "soak": ([], {"--requests={}": AT_LEAST_1, "--max-batch={}": EVERY, "--window={}": AT_LEAST_1,
                  "--check-every={}": AT_LEAST_1, "--seed={}": SEED}),
    "eval": ([], {"--num-prompts={}": AT_LEAST_1, "--new-tokens={}": EVERY, "--batch-size={}": EVERY,
                  "--temperature={}": ABOVE_0}),
    "serve": (["--model", "m"], {"--port={}": FROM_0, "--max-batch={}": EVERY, "--max-waiting={}": AT_LEAST_1,
                                 "--max-tokens={}": EVERY, "--max-body-bytes={}": AT_LEAST_1,
                                 "--shutdown-timeout={}": ABOVE_0}),
    "demo": ([], {}),
}
# the options that take a name: (refused, taken)
NAMES = {
    "demo": {"--model={}": (["bogus", "", "qwen2.5-coder-0.5b"], ["smollm2-135m", "SmolLM2-135M-Instruct"])},
    "export-vllm": {"--method={}": (["bogus", "", "Draft_Model"], ["draft_model", "ngram", "eagle", "custom_class"])},
    "lab": {"--schedules={}": (["bogus:1", "static", "poisson", "", "static:1.5", "static:"],
                               ["curve", "batches:3", "poisson:0.5", "static:65536"])},
}
COMMANDS = ("demo", "bench", "profile_cmd", "lab_cmd", "serve_bench_cmd", "export_vllm_cmd", "soak_cmd", "eval_cmd")


def cases(refused: bool):
    for command, (needed, options) in TABLE.items():
        for option, bad in options.items():
            for probe in PROBES:
                if (probe in bad) == refused:
                    yield pytest.param([command, *needed, option.format(probe)], id=f"{command} {option.format(probe)}")
    for command, options in NAMES.items():
        for option, (bad, good) in options.items():
            for name in bad if refused else good:
                yield pytest.param([command, *TABLE[command][0], option.format(name)],
                                   id=f"{command} {option.format(name)}")


class Reached(BaseException):
    """A command started: every option was taken. BaseException: `main` turns no such thing into a user error."""


class Hung(BaseException):
    """The case ran past its time (a TimeoutError would be an OSError, which `main` reports as a user error)."""


@pytest.fixture
def guarded(monkeypatch, tmp_path):
    """Runs `main(argv)` with every command and model loader replaced by `Reached`, under a 20 s alarm; returns
    the exit status, or "reached"."""
    import signal

    from spec_adapt.tools import cli, models

    def reached(*args, **kwargs):
        raise Reached(args)

    for name in COMMANDS:
        monkeypatch.setattr(cli, name, reached)
    monkeypatch.setattr(cli.serve, "serve_cmd", reached)
    monkeypatch.setattr(models, "load_model", reached)
    monkeypatch.setattr(models, "load_draft", reached)
    monkeypatch.chdir(tmp_path)

    def hung(signum, frame):
        raise Hung()

    previous = signal.signal(signal.SIGALRM, hung)

    def attempt(argv):
        signal.setitimer(signal.ITIMER_REAL, 20)
        try:
            return run_main(argv)
        except Reached:
            return "reached"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    yield attempt
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("argv", list(cases(refused=True)))
def test_a_value_an_option_refuses_is_one_line_before_any_command(guarded, capsys, argv):
    assert guarded(argv) == 2
    captured = capsys.readouterr()
    option = argv[-1].split("=")[0]
    assert captured.err.startswith(f"spec-adapt: error: argument {option}") or (
        option in ("--rates", "--duration") and captured.err.startswith("spec-adapt: error: argument --rates/--duration"))
    assert " takes " in captured.err and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("argv", list(cases(refused=False)))
def test_a_value_an_option_takes_reaches_the_command(guarded, capsys, argv):
    assert guarded(argv) == "reached", capsys.readouterr().err


def test_the_table_names_every_option_that_parses_a_value(monkeypatch):
    """Every option with an argument type, in every subcommand, has its row in TABLE or NAMES, and every subcommand
    has its entry: a new numeric option cannot go unprobed."""
    from spec_adapt.tools import cli

    built = []

    def parse_args(self, args=None, namespace=None):
        built.append(self)
        raise Reached()

    monkeypatch.setattr(cli.Parser, "parse_args", parse_args)
    with pytest.raises(Reached):
        main(["soak"])
    subcommands = next(a for a in built[0]._actions if a.dest == "command").choices
    assert set(subcommands) == set(TABLE)
    for command, parser in subcommands.items():
        typed = {o for action in parser._actions if action.type is not None for o in action.option_strings}
        tabled = {key.split("=")[0] for key in [*TABLE[command][1], *NAMES.get(command, {})]}
        assert typed == tabled, command


@pytest.mark.parametrize("command", ["profile", "bench", "serve-bench"])
def test_draft_layers_past_the_target_are_one_line_once_it_loads(monkeypatch, capsys, command):
    """--draft-layers is checked against the target's layer count when the target has loaded, before any draft is
    built from it."""
    from conftest import tiny_model

    from spec_adapt.tools import cli, models

    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: (tiny_model("llama"), None))
    monkeypatch.setattr(models, "truncated_copy", lambda *args: pytest.fail("a draft was built"))
    assert run_main([command, "--draft-layers", "3"]) == 2
    assert capsys.readouterr().err == ("spec-adapt: error: argument --draft-layers: takes at most the target's 2 "
                                       "layers, got 3\n")


def test_draft_layers_within_the_target_are_taken(monkeypatch):
    from conftest import tiny_model

    from spec_adapt.tools import models, profiling

    def profile(model, draft, *args):
        raise Reached(draft)

    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: (tiny_model("llama"), None))
    monkeypatch.setattr(profiling, "profile", profile)
    with pytest.raises(Reached) as reached, torch.enable_grad():
        main(["profile", "--draft-layers", "2"])
    assert reached.value.args[0].config.num_hidden_layers == 2


def test_batch_sizes_above_the_prompts_a_workload_gave_are_one_line(monkeypatch, capsys):
    """A workload can hold fewer prompts than --num-prompts asks for: the batch sizes are checked again against
    the prompts it gave, before anything is timed."""
    from spec_adapt.recipes import workloads
    from spec_adapt.tools import bench, models

    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(workloads, "load", lambda name, n: name)
    monkeypatch.setattr(workloads, "with_inputs", lambda ds, tok: {"input_text": ["a", "b"]})
    monkeypatch.setattr(bench, "run_bench", lambda *args, **kwargs: pytest.fail("timed"))
    assert run_main(["bench", "--prompts", "two.jsonl", "--batch-sizes", "1", "4"]) == 2
    assert capsys.readouterr().err == ("spec-adapt: error: argument --batch-sizes: takes batch sizes of at most the 2 "
                                       "prompts two.jsonl gave, got 4\n")


def test_schedules_that_would_never_end_are_refused_where_they_are_built():
    """The lab's and serve-bench's own schedule code refuses what would loop forever or draw without end, for
    callers other than the command line."""
    import math
    import signal

    from spec_adapt import FixedLength
    from spec_adapt.tools import lab, serve_bench
    from spec_adapt.tools.profiling import LatencyTable

    def hung(signum, frame):
        raise Hung()

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        table = LatencyTable(step={1: {0: 0.01, 1: 0.012}})
        requests = lab.synthetic_requests(2, 8, 0.5)
        for schedule, max_batch in ((lab.Static(0), None), (lab.Batches(0), None),
                                    (lab.RateCurve([(60.0, 0.5), (60.0, 20.0)]), -1),
                                    (lab.RateCurve([(60.0, 0.5), (60.0, 20.0)]), 0)):
            with pytest.raises(ValueError, match="batch limit"):
                lab.simulate(FixedLength(1), requests, table, schedule, max_batch=max_batch, draft_cost=False)
        for rate in (0.0, -2.0, math.inf, math.nan):
            with pytest.raises(ValueError, match="finite positive rate"):
                lab.Poisson(rate)
        for rate, duration in ((-1.0, 30.0), (0.0, 30.0), (1.0, math.inf), (1.0, math.nan), (math.nan, 30.0)):
            with pytest.raises(ValueError, match="finite positive rate"):
                serve_bench.schedule(rate, duration, 3)
        for text in ("1:inf", "nan:30", "inf:30", "1:nan"):
            with pytest.raises(ValueError, match="finite positive rate"):
                serve_bench.parse_phases(text)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_refused_schedule_ends_the_process_at_once(tmp_path):
    done = subprocess.run([sys.executable, "-m", "spec_adapt.tools.cli", "lab", "--latency", "latency.json",
                           "--schedules", "static:0"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("spec-adapt: error: argument --schedules: static: takes a batch size from 1 to 65536, "
                           "got '0'\n")
