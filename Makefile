# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
# torch is installed first and pinned to the version the shipped models and tests were made with
# (which build, CPU or CUDA, is pip's index's choice). PYTHON must be 3.11 or newer:
# `make PYTHON=python3.11 test` where python3 is older.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gogh-flows needs Python 3.11 or newer; $(PYTHON) is " + sys.version.split()[0] + ": run make PYTHON=python3.11 (or a newer one)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install $(TORCH)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gogh demo

# two pytest processes: the multi-host tests (processes started with the Dask CLIs, waiting out
# the faults they test) one after another in one of them, every other test in either
# (docs/performance.md, "Test suite and demo")
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 -n 2 --dist loadgroup

bench: $(STAMP)
	$(BIN)/python benchmarks/placement_scaling.py

clean:
	rm -rf $(VENV) .gogh .pytest_cache
