# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
# torch is installed first and pinned: an unpinned torch pulls GBs of CUDA packages.
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
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install $(TORCH)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gogh demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

bench: $(STAMP)
	$(BIN)/python benchmarks/placement_scaling.py

clean:
	rm -rf $(VENV) .gogh .pytest_cache
