"""transformers' own assisted-generation and prompt-lookup tests, run through spec_adapt on its tiny model testers.

    python benchmarks/upstream_tests.py --transformers-src /tmp/tf --batch 1 3 --out upstream-5.24.json
    python benchmarks/upstream_tests.py --smoke     # no checkout: one tiny assisted-decoding test at batch 2

A manual tool (not part of CI: it needs a transformers source checkout, which CI does not have). `--transformers-src`
is a checkout of the installed transformers release (its `tests/` folder; the release's tag, e.g. v5.24.0); the
tests need what transformers' own test extras install (`parameterized`, `pytest`). For each batch size it runs

    pytest <src>/tests/models -k "assisted_decoding or prompt_lookup" -p no:cacheprovider

with a plugin (written next to the JSON) that calls `spec_adapt.enable` on every model the tests build, so their
`assistant_model=` and `prompt_lookup_num_tokens=` calls speculate through spec_adapt (their plain greedy reference
stays stock's), raises the batch the testers' `prepare_config_and_inputs_for_generate(batch_size=1)` asks for to the
batch size run, and stops a test after `--timeout` seconds. The outcome of each architecture (a folder of
tests/models) is its worst test's:

- pass: every test that ran passed (skipped tests are transformers' own skips);
- differs: a test's assertion failed (output or outputs' structure other than stock's);
- refused: spec_adapt refused the call by name (a ValueError or NotImplementedError, spec_adapt's own subclasses
  such as UnsupportedCacheError included, raised in spec_adapt's code; a model's own ValueError under spec_adapt's
  call is a crash);
- crash: any other error, a timeout included.

Prints a table and writes the counts, each architecture's outcome and its first failure's message as JSON.
`--smoke` runs the same plugin, pytest call and summary over a stand-in checkout (a temporary tests/models/tiny with
one test in transformers' style) and skips transformers' own tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

import _smoke

PLUGIN = '''"""pytest plugin: transformers' generation tests through spec_adapt (benchmarks/upstream_tests.py)."""
import os
import signal

import pytest

import spec_adapt
from transformers.generation.utils import GenerationMixin

BATCH = int(os.environ.get("SPEC_ADAPT_UPSTREAM_BATCH", "1"))
TIMEOUT = int(os.environ.get("SPEC_ADAPT_UPSTREAM_TIMEOUT", "300"))
_stock = GenerationMixin.generate


def _generate(self, *args, **kwargs):
    # A model's first call enables it (its generate becomes spec_adapt's); an enabled model's generate calls stock's
    # through this class attribute, which then runs stock's.
    if "generate" in self.__dict__:
        return _stock(self, *args, **kwargs)
    spec_adapt.enable(self)
    return self.generate(*args, **kwargs)


GenerationMixin.generate = _generate


def _raised(prepare):
    def prepare_with_batch(self, batch_size=2):
        return prepare(self, batch_size=BATCH if batch_size == 1 else batch_size)
    return prepare_with_batch


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    cls = getattr(item, "cls", None)
    prepare = getattr(cls, "prepare_config_and_inputs_for_generate", None)
    if BATCH != 1 and prepare is not None and not getattr(prepare, "raised", False):
        wrapped = _raised(prepare)
        wrapped.raised = True
        cls.prepare_config_and_inputs_for_generate = wrapped


def _time_out(signum, frame):
    raise TimeoutError(f"test ran past {TIMEOUT} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    signal.signal(signal.SIGALRM, _time_out)
    signal.alarm(TIMEOUT)
    try:
        yield
    finally:
        signal.alarm(0)
'''

ORDER = ["crash", "differs", "refused", "pass", "skipped"]    # worst first

SMOKE_TEST = '''"""A stand-in for transformers' assisted-decoding tests (benchmarks/upstream_tests.py --smoke)."""
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class TinyModelTest(unittest.TestCase):
    def prepare_config_and_inputs_for_generate(self, batch_size=2):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
        return config, torch.randint(3, 64, (batch_size, 7))

    def test_assisted_decoding_matches_greedy_search(self):
        config, ids = self.prepare_config_and_inputs_for_generate(batch_size=1)
        model, draft = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        greedy = model.generate(ids, **kwargs)
        self.assertTrue(torch.equal(model.generate(ids, assistant_model=draft, **kwargs), greedy))
'''


def _refusal(message: str) -> bool:
    """Whether a failure's message names a ValueError or NotImplementedError: the built-in ones, or spec_adapt's own
    subclasses, which junit names by module path (`spec_adapt.model_kinds.UnsupportedCacheError: ...`)."""
    if "ValueError" in message or "NotImplementedError" in message:
        return True
    module, _, name = message.split(":", 1)[0].strip().rpartition(".")
    if not module.startswith("spec_adapt"):
        return False
    try:
        error = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(error, type) and issubclass(error, (ValueError, NotImplementedError))


def _raised_in_spec_adapt(text: str) -> bool:
    """Whether the failure was raised in spec_adapt's code: pytest's report ends with the raising frame
    (`path/spec_adapt/api.py:70: ValueError`); a report without that line counts if spec_adapt is anywhere in it. A
    model's own error under spec_adapt's call (a check in its forward) is not spec_adapt refusing."""
    for line in reversed(text.strip().splitlines()):
        raised = re.match(r"(\S+):\d+: [\w.]+$", line.strip())
        if raised:
            return "spec_adapt/" in raised.group(1).replace("\\", "/")
    return "spec_adapt" in text


def classify(case) -> tuple[str, str]:
    """(outcome, message) of one junit testcase."""
    for tag in ("error", "failure"):
        node = case.find(tag)
        if node is not None:
            message = (node.get("message") or "").strip()
            text = node.text or ""
            if tag == "failure" and message.startswith(("AssertionError", "assert")):
                return "differs", message
            refused = _refusal(message) and _raised_in_spec_adapt(text)
            return ("refused" if refused else "crash"), message
    if case.find("skipped") is not None:
        return "skipped", ""
    return "pass", ""


def architecture(case) -> str:
    """The tests/models folder a testcase comes from (`tests.models.llama.test_modeling_llama.LlamaModelTest`)."""
    parts = (case.get("classname") or "").split(".")
    return parts[parts.index("models") + 1] if "models" in parts else parts[0]


def summarize(junit: Path) -> dict:
    per_arch: dict[str, dict] = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, message = classify(case)
        entry = per_arch.setdefault(architecture(case), {"outcome": "skipped", "tests": {}, "error": ""})
        entry["tests"][case.get("name")] = outcome
        if ORDER.index(outcome) < ORDER.index(entry["outcome"]):
            entry["outcome"], entry["error"] = outcome, message[:500]
    counts = Counter(entry["outcome"] for entry in per_arch.values())
    tests = Counter(outcome for entry in per_arch.values() for outcome in entry["tests"].values())
    return {"counts": {name: counts.get(name, 0) for name in ORDER},
            "test_counts": {name: tests.get(name, 0) for name in ORDER}, "architectures": per_arch}


def run(src: Path, batch: int, timeout: int, workdir: Path, select: str, extra: list[str]) -> dict:
    (workdir / "spec_adapt_upstream.py").write_text(PLUGIN)
    junit = workdir / f"junit-batch{batch}.xml"
    env = dict(os.environ, SPEC_ADAPT_UPSTREAM_BATCH=str(batch), SPEC_ADAPT_UPSTREAM_TIMEOUT=str(timeout),
               PYTHONPATH=os.pathsep.join([str(workdir), str(src), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", "tests/models", "-k", select, "-p", "spec_adapt_upstream",
               "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={junit}", *extra]
    print(f"batch {batch}: {' '.join(command)}  (in {src})", flush=True)
    subprocess.run(command, cwd=src, env=env)
    return summarize(junit)


def stand_in(folder: Path) -> Path:
    """A folder shaped like a transformers checkout: tests/models/tiny with SMOKE_TEST."""
    test = folder / "tests" / "models" / "tiny" / "test_modeling_tiny.py"
    test.parent.mkdir(parents=True)
    test.write_text(SMOKE_TEST)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers-src", type=Path, help="a transformers checkout (with tests/)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("-k", dest="select", default="assisted_decoding or prompt_lookup")
    parser.add_argument("--out", type=Path, default=None, help="JSON of counts and per-architecture outcomes")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    _smoke.add(parser)
    args = _smoke.apply(parser.parse_args(), batch=[2], timeout=120)
    if args.smoke:
        print("smoke: transformers' own tests skipped (they need a checkout); a stand-in test runs instead")
        args.transformers_src = stand_in(Path(_smoke.folder("transformers")))
    elif args.transformers_src is None:
        parser.error("--transformers-src is required (or --smoke)")
    src = args.transformers_src.resolve()
    if not (src / "tests" / "models").is_dir():
        raise SystemExit(f"{src} has no tests/models: pass a transformers source checkout")
    import spec_adapt  # noqa: F401 (fail early if it is not importable)
    import transformers

    report = {"transformers": transformers.__version__, "select": args.select, "timeout_s": args.timeout,
              "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for batch in args.batch:
            report["batches"][str(batch)] = run(src, batch, args.timeout, workdir, args.select, args.pytest_args)
    print(f"\ntransformers {report['transformers']}: architectures by outcome ({args.select!r})")
    print("batch  " + "  ".join(f"{name:>8}" for name in ORDER))
    for batch, result in report["batches"].items():
        print(f"{batch:>5}  " + "  ".join(f"{result['counts'][name]:>8}" for name in ORDER))
    for batch, result in report["batches"].items():
        for name, entry in sorted(result["architectures"].items()):
            if entry["outcome"] in ("crash", "differs", "refused"):
                print(f"  batch {batch} {entry['outcome']:>8} {name}: {entry['error'][:160]}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1, sort_keys=True))
        print(f"wrote {args.out}")
    if args.smoke and any(result["counts"]["pass"] != 1 for result in report["batches"].values()):
        raise SystemExit("smoke: the stand-in test did not pass through spec_adapt")


if __name__ == "__main__":
    main()
