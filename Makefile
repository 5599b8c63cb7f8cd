# The two entry points of the project (see README.md). Both set up the environment first.
# the environment: VENV, else TPP_VENV (as scripts/setup_env.sh reads it), else ./.venv
VENV ?= $(or $(TPP_VENV),$(CURDIR)/.venv)
export TPP_VENV := $(VENV)
export PATH := $(VENV)/bin:$(PATH)

.PHONY: env demo test bench format
env:
	@bash scripts/setup_env.sh

demo: env
	@"$(VENV)/bin/tpp-demo"

test: env
	@"$(VENV)/bin/python" -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder tests --durations=30

bench: env
	@"$(VENV)/bin/python" -m benchmarks.bench_model

format: env
	@"$(VENV)/bin/ruff" format .
	@"$(VENV)/bin/ruff" check .
