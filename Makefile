# Two commands on a fresh machine:
#   make demo   set everything up and run the main job on the built-in default
#   make test   set everything up and run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.setup-stamp
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_ACCELERATOR ?= cpu
# pip installs with --no-compile: Python writes each module's .pyc when a process first imports it, instead
# of pip byte-compiling all of torch and transformers up front (about 40 s of setup on 2 cores, mostly for
# modules nothing imports). A PYTHONDONTWRITEBYTECODE inherited from the caller would then make every
# process compile its imports anew (import torch, deepspeed, transformers: 4.5 s -> 8.4 s), so make
# does not pass it on.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo lint ops test test-steps test-gpu clean

setup: $(STAMP)

# Re-run the install only when the project's own install files change.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --no-compile --upgrade pip
	$(PIP) install --quiet --no-compile -c constraints.txt torch==2.13.0
	$(PIP) install --quiet --no-compile -c constraints.txt -e '.[dev]'
	$(BIN)/zerobridge --version
	touch $(STAMP)

# The tiny GPT on 2 CPU processes: ZeRO stages 0-3 on the native engine, torch
# FSDP2 and DeepSpeed, compared step by step (exit 1 if any run disagrees).
demo: setup
	$(BIN)/zerobridge compare

# ruff (lint and import order) and mypy (strict on spec/, translate/, runtime/; checked elsewhere).
lint: setup
	$(BIN)/ruff check zerobridge tests bench examples
	$(BIN)/mypy

# DeepSpeed's C++ ops the suite's DeepSpeed runs load (the CPU comm op, FusedAdam, CPU Adam) compiled into
# TORCH_EXTENSIONS_DIR: 140 s on 2 cores, paid here beside the lint instead of inside the first test that
# needs each. Where an op cannot be built, its tests skip and say why, so this never fails the run.
OPS := shm_comm fused_adam cpu_adam
ops: setup
	@mkdir -p .cache; $(BIN)/zerobridge build-ops $(OPS) > .cache/build-ops.log 2>&1; \
	grep -E '^(shm_comm|fused_adam|cpu_adam|cpu_adagrad) ' .cache/build-ops.log || tail -5 .cache/build-ops.log

# Lint, the suite, then a short comparison as a CI gate would run it; says how long it all took
# (setup and lint included). Every pytest run prints its slowest tests and the time per module (tests/conftest.py).
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory test-steps; code=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s wall, setup and lint included (exit $$code)"; exit $$code

# The suite runs on TEST_WORKERS processes, whole modules each (--dist loadfile: a module's process group and
# fixtures stay in one process). Alone, one process leaves a core idle for most of the run (single-process
# unit tests, imports, a launch waiting on its ranks): on 2 cores, 1,000-1,124 s of pytest became 714 s.
TEST_WORKERS ?= 2
test-steps: setup
	$(MAKE) --no-print-directory -j2 lint ops
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests
	$(BIN)/zerobridge compare --stages 0 3 --steps 3

# The tests that need CUDA/NCCL (streams, pinned reads, device binding, NCCL parity), one rank per GPU;
# all skipped on a machine without one. pip resolves the torch pin to its CUDA build there.
test-gpu: setup
	ZEROBRIDGE_TEST_DEVICE=cuda $(BIN)/python -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .cache build dist
