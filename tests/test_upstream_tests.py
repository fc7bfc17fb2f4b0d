"""benchmarks/upstream_tests.py's classification of one junit testcase (its outcome categories)."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))        # the script imports _smoke
    try:
        spec = importlib.util.spec_from_file_location("upstream_tests_tool", ROOT / "benchmarks" / "upstream_tests.py")
        spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def case(tag: str, message: str, text: str) -> ElementTree.Element:
    node = ElementTree.Element("testcase", classname="tests.models.llama.test_modeling_llama.LlamaModelTest",
                               name="test_assisted_decoding_sample")
    ElementTree.SubElement(node, tag, message=message).text = text
    return node


IN_SPEC_ADAPT = 'File "/work/main/spec_adapt/api.py", line 504, in _check_generation_config'


@pytest.mark.parametrize("message, text, outcome", [
    ("ValueError: output_attentions / output_hidden_states are not available with speculation.", IN_SPEC_ADAPT,
     "refused"),
    ("NotImplementedError: not served", IN_SPEC_ADAPT, "refused"),
    # spec_adapt's own ValueError subclass, which junit names by its module path
    ("spec_adapt.model_kinds.UnsupportedCacheError: spec_adapt cannot roll back the ['minimax_m3_sparse'] layers",
     IN_SPEC_ADAPT, "refused"),
    # a ValueError raised outside spec_adapt (a model's own check) is a crash
    ("ValueError: Image features and image tokens do not match", 'File "modeling_x.py", line 3', "crash"),
    ("RuntimeError: shape mismatch", IN_SPEC_ADAPT, "crash"),
    ("spec_adapt.serving.engine.EngineError: the engine stopped", IN_SPEC_ADAPT, "crash"),
    # pytest's report ends with the raising frame: a model's own ValueError under spec_adapt's call is a crash
    ("ValueError: Image features and image tokens do not match",
     "spec_adapt/loop.py:150: in run\n    out = model(**inputs)\n"
     "E       ValueError: Image features and image tokens do not match\n\n"
     "/usr/lib/python3.11/site-packages/transformers/models/x/modeling_x.py:1750: ValueError", "crash"),
    ("ValueError: spec_adapt does not know these generate inputs",
     "tests/generation/test_utils.py:739: in test\n"
     "E       ValueError: spec_adapt does not know these generate inputs\n\n"
     "../sa/spec_adapt/api.py:70: ValueError", "refused"),
    ("spec_adapt.model_kinds.UnsupportedCacheError: cannot roll back",
     "E       spec_adapt.model_kinds.UnsupportedCacheError: cannot roll back\n\n"
     "/work/main/spec_adapt/model_kinds.py:66: UnsupportedCacheError", "refused"),
])
def test_errors_raised_in_spec_adapt_as_refusals_are_refused(tool, message, text, outcome):
    assert tool.classify(case("error", message, text)) == (outcome, message)


def test_assertions_differ_and_skips_and_passes(tool):
    assert tool.classify(case("failure", "AssertionError: 2 != 4", "x"))[0] == "differs"
    skipped = ElementTree.Element("testcase")
    ElementTree.SubElement(skipped, "skipped", message="stateful")
    assert tool.classify(skipped) == ("skipped", "")
    assert tool.classify(ElementTree.Element("testcase")) == ("pass", "")
