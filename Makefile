# tierstore: `make demo` and `make test` work on a fresh clone; both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU torch first, pinned: an open `torch` requirement would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test bench soak lint clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH) numpy
	$(BIN)/python -m pip install -q -e '.[test]' $(foreach b,$(wildcard backends/*/pyproject.toml),-e $(dir $(b)))
	@touch $@

demo: $(STAMP)
	$(BIN)/python examples/train.py

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/python -m pip install -q mypy ruff
	$(BIN)/ruff check tierstore tests backends examples conftest.py
	$(BIN)/mypy
	$(BIN)/mypy --strict --ignore-missing-imports backends/s3/tierstore_s3 backends/gcs/tierstore_gcs

clean:
	rm -rf demo-run bench-scratch .pytest_cache .hypothesis
