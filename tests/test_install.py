"""Installing spec_adapt into a stack that already holds the newest torch and transformers in its declared range
changes neither: pip's own resolver, asked for a dry run of this project, plans no install of either.

The venv here holds the two as installed distributions (their metadata, which is all pip's resolver reads of an
installed package), so the check costs seconds and no gigabytes of CUDA wheels. `make test-ends` runs the same test
against a venv with the real releases installed (SPEC_ADAPT_STACK_PYTHON names its interpreter). The other
dependencies are held at the versions CI tests (constraints.txt), so a new upstream release cannot flip the result.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from spec_adapt import compat

ROOT = Path(__file__).resolve().parents[1]
HELD = ("torch", "transformers")
TORCH_BUILDS = ("triton", "bitsandbytes")      # pinned to match one torch build: each torch release picks its own


def makefile_versions() -> dict[str, str]:
    """The versions the Makefile installs for the ends of the ranges (its *_OLDEST and *_NEWEST variables)."""
    text = (ROOT / "Makefile").read_text()
    return dict(re.findall(r"^((?:TORCH|TRANSFORMERS)_(?:OLDEST|NEWEST)) := (\S+)$", text, re.M))


def newest() -> dict[str, str]:
    return {name: compat.TESTED_ENDS[name][1] for name in HELD}


def test_the_makefile_installs_the_ends_compat_names():
    versions = makefile_versions()
    for name in HELD:
        oldest, latest = compat.TESTED_ENDS[name]
        assert versions[f"{name.upper()}_OLDEST"] == oldest
        assert versions[f"{name.upper()}_NEWEST"] == latest


def fake_installed(site: Path, name: str, version: str) -> None:
    """An installed distribution as pip sees one: a dist-info folder with its metadata and record."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def stack_with_newest(tmp_path: Path) -> Path:
    """A venv holding the newest tested torch and transformers; returns its interpreter."""
    given = os.environ.get("SPEC_ADAPT_STACK_PYTHON")
    if given:
        return Path(given)
    folder = tmp_path / "stack"
    venv.EnvBuilder(with_pip=True).create(folder)
    python = folder / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    for name, version in newest().items():
        fake_installed(site, name, version)
    return python


def pip_environment() -> dict[str, str]:
    """pip without this machine's configuration files or PIP_* settings that would cap or redirect what it may pick
    (a site-wide constraint file, local indexes); certificates and proxies stay."""
    keep = {"PIP_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_INDEX_URL"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def others_pinned(tmp_path: Path) -> Path:
    """constraints.txt without torch, transformers and what is built for one torch release: the rest of the stack at
    the versions CI tests."""
    lines = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")
             and re.split(r"[=<>!~ ]", line)[0].lower() not in HELD + TORCH_BUILDS]
    path = tmp_path / "others.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def planned_installs(python: Path, tmp_path: Path) -> dict[str, str]:
    """{name: version} of what `pip install --dry-run` of this project would install into python's environment."""
    report = tmp_path / "report.json"
    done = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report,
                           "-c", others_pinned(tmp_path), str(ROOT)],
                          env=pip_environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    planned = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in planned}


def installed_version(python: Path, name: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({name!r}))"
    return subprocess.check_output([python, "-c", code], text=True, env=pip_environment()).strip()


def test_installing_never_replaces_the_newest_torch_or_transformers(tmp_path):
    python = stack_with_newest(tmp_path)
    for name, version in newest().items():
        assert installed_version(python, name) == version, f"the stack must hold {name} {version}"
    planned = planned_installs(python, tmp_path)
    assert "spec-adapt" in planned or "spec_adapt" in planned, planned
    touched = {name: planned[name] for name in HELD if name in planned}
    assert not touched, (f"installing spec_adapt would replace {touched} in a stack holding {newest()}: "
                         "widen the ranges in pyproject.toml")


@pytest.mark.parametrize("name", HELD)
def test_the_declared_range_admits_both_tested_ends(name):
    """The ranges pyproject.toml declares contain the versions the suites ran on, and carry no upper bound a
    tested break does not name (a comment on the same line)."""
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    line = next(line for line in text.splitlines() if re.match(rf'\s*"{name}[<>=!~ ]', line))
    requirement = Requirement(line.split('"')[1])
    for version in compat.TESTED_ENDS[name]:
        assert requirement.specifier.contains(version), f"{requirement} excludes the tested {name} {version}"
    upper = [spec for spec in requirement.specifier if spec.operator in ("<", "<=", "==", "~=")]
    assert not upper or "#" in line, f"{requirement}: an upper bound needs the break it avoids named beside it"
