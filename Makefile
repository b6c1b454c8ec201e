# The two set-up commands of the README:
#   make up    — create .venv, install, run the whole marketplace on this machine
#   make test  — install what the suite needs and run all of it
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=

.PHONY: up test install lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

up: install
	$(BIN)/gpumarket up $(ARGS)

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy

test: install lint typecheck
	$(BIN)/python -m pytest $(ARGS)

bench: install
	$(BIN)/python bench/bench_protocol.py
	$(BIN)/python bench/bench_bus.py
	$(BIN)/python bench/bench_relay.py
	$(BIN)/python bench/bench_relay_capacity.py
	$(BIN)/python bench/bench_pipeline.py
	$(BIN)/python bench/bench_agent.py
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_placement.py
	$(BIN)/python bench/bench_billing.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
