# One virtual environment for everything; created on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or run: make PY=python3 ...)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	bash scripts/demo.sh $(BIN)
	@echo; echo "search the demo index in a browser (the page and its API at http://127.0.0.1:8000/):"
	@echo "  $(BIN)/clip-mini serve --index indexes/shapes"

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py
	$(BIN)/python benchmarks/lib/results_md.py   # RESULTS.md and the README's table from the new JSONs

clean:
	rm -rf runs data/shapes indexes hits.png
