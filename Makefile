# Two commands on a fresh machine with Python 3.10+:
#   make run    set up .venv, then one training run of the default model on the embedded corpus
#   make test   set up .venv, then lint and the test suite
# torch is installed first and pinned on purpose: on the dev/CI machines `torch==2.13.0` is a
# local CPU build, while an unpinned `torch` pulls several GB of CUDA wheels. On a GPU box,
# install the CUDA build you want first (or pass TORCH=...); pyproject's range keeps it.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run sweep test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m sweeper

sweep: setup
	$(BIN)/python -m sweeper +sweep=lr_bs

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# most of the suite's wall time is waiting on Ray start-ups and subprocesses: three
# workers overlap it on two cores
test: setup lint
	$(BIN)/python -m pytest -n 3 --dist worksteal

bench: setup
	$(BIN)/python bench/bench_train.py

clean:
	rm -rf $(VENV) outputs multirun mlflow.db mlruns
