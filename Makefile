# The two commands of the README. Both build .venv first if it is missing or out of date.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rollhpc-stamp
PYTEST_ARGS ?=
# two pytest-xdist workers: much of the suite waits on Slurm and timeouts, and a second worker fills those waits
# (tests/conftest.py says how modules are grouped); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

.PHONY: run test lint venv bench clean

$(STAMP): requirements/cpu.txt requirements/test.txt pyproject.toml tools/setup_venv.sh
	bash tools/setup_venv.sh $(VENV)

venv: $(STAMP)

## command 1: the quickstart job on this machine (a tiny policy, CPU, local mpiexec)
run: $(STAMP)
	$(VENV)/bin/rollhpc train quickstart --overwrite

## command 2: the whole test suite (real MPI processes), after the formatter's and the linter's checks
test: $(STAMP) lint
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

## ruff (configured in pyproject.toml): the code as its formatter writes it (100 columns), and its linter's checks;
## `$(VENV)/bin/ruff format rollhpc tests tools bench` rewrites what the first check refuses
LINTED := rollhpc tests tools bench
lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/ruff check $(LINTED)

## the whole test suite on a busy machine: HOGS busy-loop processes (default 2) beside it, ended with it (tools/cpu_hogs.py)
.PHONY: test-loaded
HOGS ?= 2
test-loaded: $(STAMP)
	$(PY) tools/cpu_hogs.py -n $(HOGS) -- $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

## benchmarks (install the comparison baselines, e.g. Ray, into the venv first)
bench: $(STAMP)
	bash tools/setup_venv.sh $(VENV) --bench
	$(PY) bench/dispatch.py
	$(PY) bench/rollout_longtail.py
	$(PY) bench/rlvr_vs_trl.py
	$(PY) bench/recovery.py
	$(PY) bench/convert_memory.py

clean:
	rm -rf runs .pytest_cache
