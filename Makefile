# `make demo` and `make test` work on a fresh machine: they create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo finetune-demo extras lint test test-quick bench docs clean

$(VENV)/.runtime: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# tensorboard and torch (CPU): viewing a run's curves, loading an export in transformers (docs/finetune.md)
$(VENV)/.extras: requirements-extras.txt requirements.txt $(VENV)/.runtime
	$(PY) -m pip install -q -r requirements-extras.txt
	touch $@

$(VENV)/.dev: requirements-dev.txt $(VENV)/.extras
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

extras: $(VENV)/.extras

demo: $(VENV)/.runtime
	bash scripts/demo.sh

finetune-demo: $(VENV)/.runtime
	bash scripts/finetune_demo.sh

# pytest-xdist workers, a module at a time (tests/conftest.py: work_unit); `pytest FILE` alone still runs
# in one process. Quick: one per core. Full: four, whose extra two fill the time processes wait (tests/README.md)
XDIST := -n 2

# jemalloc where the host has it (Debian's libjemalloc2; .ci/run installs it): MindSpore's graph compiler spends about
# a sixth of its CPU in glibc's malloc (docs/dryrun.md: tools/dryrun.py preloads it by itself)
JEMALLOC := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib/aarch64-linux-gnu/libjemalloc.so.2))
PRELOAD := $(if $(JEMALLOC),LD_PRELOAD="$(JEMALLOC) $$LD_PRELOAD")

# the formatter and the linter first (pyproject.toml [tool.ruff]): a second each
LINT := $(VENV)/bin/ruff format --check --quiet . && $(VENV)/bin/ruff check --quiet .

test: $(VENV)/.dev  # target under 15 minutes on a 2-core host (measured times: tests/README.md)
	$(LINT)
	$(PRELOAD) MINDSCALE_TEST_DURATIONS=output/test-durations.json $(PY) -m pytest -q -n 4 --durations=15 tests bench/test_bench.py

test-quick: $(VENV)/.dev  # no processes: unit and model tests (target under 2 minutes; tests/README.md)
	$(LINT)
	$(PRELOAD) $(PY) -m pytest -q $(XDIST) -m "not integration" tests

lint: $(VENV)/.dev  # `ruff format .` rewrites what --check refuses
	$(LINT)

bench: $(VENV)/.dev
	$(PY) bench/run_all.py

docs: $(VENV)/.runtime
	$(PY) scripts/update_docs.py

clean:
	rm -rf output .pytest_cache
