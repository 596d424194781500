# tierstore: `make demo` and `make test` work on a fresh clone; both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU torch first, pinned: an open `torch` requirement would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
# The integrations' tests need lightning and torchtitan. torchtitan 0.3.0 caps datasets (its
# data loaders) below 4.8, hence fsspec, s3fs and gcsfs at 2026.2.0, under which the S3 plugin's
# streaming write holds more than its contract allows; its checkpointer needs none of that, so
# it is installed without its dependencies, plus the two its checkpointer imports
# (docs/integrations.md).
TORCHTITAN := torchtitan==0.3.0
TITAN_DEPS := torch_checkpointing==0.1.1 tyro==1.0.17 spmd_types==0.2.3
PYTEST_ARGS ?=
# The suite on three worker processes (pytest-xdist), whole files to a worker so a file's
# fixtures (its S3 and GCS servers) start once; TEST_WORKERS=0 runs it in one process. CI has 2
# cores, but much of the suite waits on child processes, servers and grace periods: on this
# 2-core VM two workers kept about 1.5 cores busy (20 min 38 s with a 300 s test since cut to
# 4 s; 20 min 50 s without it but beside a soak), three took 17 min 36 s alone (2026-12-05,
# 1,836 tests, every one passing).
TEST_WORKERS ?= 3

.PHONY: demo test bench bench-full bench-smoke bench-perf bench-scale soak lint wheels clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH) numpy
	$(BIN)/python -m pip install -q $(TORCH) -e '.[test,lightning,export]' $(foreach b,$(wildcard backends/*/pyproject.toml),-e $(dir $(b)))
	$(BIN)/python -m pip install -q --no-deps $(TORCHTITAN)
	$(BIN)/python -m pip install -q $(TORCH) $(TITAN_DEPS)
	@touch $@

demo: $(STAMP)
	$(BIN)/python examples/train.py

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Benchmarks (docs/benchmarks.md). s3torchconnector and torch_checkpointing (a peer of the
# perf suite) are optional: the report says so if they did not install; installing them with
# the pinned torch keeps pip from pulling another build.
define bench_deps
	$(BIN)/python -m pip install -q -e '.[bench]'
	-$(BIN)/python -m pip install -q s3torchconnector $(TORCH)
	-$(BIN)/python -m pip install -q torch_checkpointing $(TORCH)
endef

bench: $(STAMP)
	$(bench_deps)
	$(BIN)/python -m benchmarks --profile quick

bench-full: $(STAMP)
	$(bench_deps)
	$(BIN)/python -m benchmarks --profile full

# Every suite end to end at tiny sizes (a few minutes): proves the jobs run. Its report goes
# to bench-scratch/, never over docs/benchmarks.md.
bench-smoke: $(STAMP)
	$(bench_deps)
	$(BIN)/python -m benchmarks --profile smoke --doc bench-scratch/smoke/benchmarks.md

# The perf suite alone: the raw encoding's saves and verified loads and the CheckpointManager's
# staging paid once, spliced into docs/benchmarks.md where they stand (under Stall, Save and
# Load); `make bench` runs this suite with the others.
bench-perf: $(STAMP)
	$(bench_deps)
	$(BIN)/python -m benchmarks --profile quick --only perf --splice

# The scale simulator (docs/scale.md): requests and bytes of each phase of a checkpoint against
# the number of ranks W, up to 4,096 simulated ranks on a local directory and 1,024 on the moto
# S3 server, tables spliced into docs/scale.md. SCALE_PROFILE=full goes to 16,384 ranks.
SCALE_PROFILE ?= quick
bench-scale: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks.scale --profile $(SCALE_PROFILE)

# The crash-consistency soak: thousands of fresh hypothesis examples, with every crash,
# power-loss and fault test (docs/crash-consistency.md). TIERSTORE_CRASH_EXAMPLES sets how many.
soak: $(STAMP)
	TIERSTORE_CRASH_PROFILE=soak $(BIN)/python -m pytest tests/crash -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/python -m pip install -q mypy ruff import-linter
	$(BIN)/ruff check tierstore tests backends examples benchmarks conftest.py
	$(BIN)/ruff format --check tierstore tests backends examples benchmarks conftest.py
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/mypy --strict --ignore-missing-imports backends/s3/tierstore_s3 backends/gcs/tierstore_gcs

# The three distributions (tierstore, tierstore-s3, tierstore-gcs), wheel and sdist, into dist/:
# no package index holds a release yet. `build` makes each wheel from its sdist, so what a
# stale build/ folder holds never gets in. It needs no torch: only `build` goes into .venv
# (created if missing), not into what make test installs.
wheels:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q build
	rm -rf dist
	$(foreach d,. backends/s3 backends/gcs,$(BIN)/python -m build -q --outdir dist $(d) &&) true
	@ls dist/*.whl

clean:
	rm -rf demo-run bench-scratch .pytest_cache .hypothesis
