# Two commands a newcomer needs: `make train` runs the default job, `make test` runs the tests
# (unit and integration; `make test-e2e` runs the end-to-end tier). Each creates .venv on first
# use and installs everything this project needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Exact versions of every package of the CPU environment; `make lock` regenerates it.
LOCK := constraints-cpu.txt
EXTRAS := cpu,test,sglang-contract
TORCH_VERSION := $(shell sed -n 's/^torch==\([0-9.]*\).*/\1/p' $(LOCK))
# The one pinned SGLang release (rl/rollout/sglang_version.py), for the contract tests.
SGLANG_VERSION := $(shell sed -n 's/^SGLANG_VERSION = "\(.*\)"$$/\1/p' rl/rollout/sglang_version.py)
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

.PHONY: venv train test test-unit test-e2e rehearse lint lock bench-transfer gpu-wheels clean

$(STAMP): pyproject.toml rl/rollout/sglang_version.py $(LOCK)
	@command -v ip >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq iproute2; } || true
	@[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] \
		|| { apt-get update -qq && apt-get install -y -qq libibverbs1; } \
		|| echo "warning: could not install libibverbs1 (needed by transfer=mooncake_*)"
	[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q -c $(LOCK) torch
	$(BIN)/pip install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	# SGLang's own code for the contract tests (tests/support/sglang_release.py), without its GPU
	# dependencies: the extra above holds what its CPU-importable modules need.
	$(BIN)/pip install -q --no-deps "sglang==$(SGLANG_VERSION)"
	touch $(STAMP)

# Resolve pyproject.toml afresh in a scratch venv and write the exact versions to $(LOCK).
lock:
	rm -rf .lock-venv && $(PY) -m venv .lock-venv
	.lock-venv/bin/pip install -q --upgrade pip
	.lock-venv/bin/pip install -q torch==$(TORCH_VERSION)
	.lock-venv/bin/pip install -q ".[$(EXTRAS)]"
	{ echo "# make lock: the CPU environment the tests passed with. torch without its local label"; \
	  echo "# (+cpu), so the build this machine's index serves fits; sglang==$(SGLANG_VERSION) is"; \
	  echo "# installed --no-deps on top (see the Makefile)."; \
	  .lock-venv/bin/pip freeze --exclude-editable | grep -v '^rl-datapath' | sed 's/^\(torch==[^+]*\)+.*/\1/'; } > $(LOCK)
	rm -rf .lock-venv build *.egg-info

venv: $(STAMP)

train: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-$$( [ -n "$$WANDB_API_KEY" ] && echo online || echo offline )} \
		$(BIN)/python train.py $(ARGS)

# The test tiers are folders: tests/unit (no Ray, no processes; under a minute),
# tests/integration (real Ray, engines, master, gloo; short runs), tests/e2e (learning curves,
# the data x weight path matrices, long fault and resume runs, the two-node rehearsal);
# tests/support holds what they share. After the tests: the 15 slowest, then wall and CPU time
# per test file (tests/support/cpu_time.py). The line before pytest separates the install and
# lint above it from the test time (pytest's last line).
PYTEST := $(BIN)/python -m pytest -q --durations=15 -p tests.support.cpu_time

test: $(STAMP) lint
	@echo "[make test] installed and linted at $$(date +%T); the unit and integration tests start now"
	$(PYTEST) tests/unit tests/integration $(ARGS)

# Learning curves, the data x weight path matrices, long fault and resume runs, and the
# two-node rehearsal, which must run here (root and iproute2; REHEARSE_REQUIRED turns its
# skip into a failure).
test-e2e: $(STAMP)
	@echo "[make test-e2e] installed at $$(date +%T); the end-to-end tests start now"
	REHEARSE_REQUIRED=1 $(PYTEST) tests/e2e $(ARGS)

# The two-node quickstart rehearsed in two network namespaces (root; docs/quickstart-two-node.md),
# alone: part of `make test-e2e`.
rehearse: $(STAMP)
	REHEARSE_REQUIRED=1 $(BIN)/python -m pytest -q --durations=5 -m two_node tests/e2e/test_two_node.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

# The unit tier alone: under a minute, no process started.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

# Wheels that scripts/gpu_check.sh installs on a GPU machine without network (pure Python,
# at this environment's versions).
gpu-wheels: $(STAMP)
	$(BIN)/pip wheel -q -c $(LOCK) -w .gpu-wheels hydra-core omegaconf pytest pytest-timeout

bench-transfer: $(STAMP)
	$(BIN)/python benchmarks/transfer_bench.py $(ARGS)

clean:
	rm -rf outputs multirun wandb .pytest_cache
