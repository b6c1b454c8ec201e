# The two set-up commands of the README:
#   make up    — create .venv, install, run the whole marketplace on this machine
#   make test  — install what the suite needs and run all of it
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=
# The console's browser tests drive Debian's Chromium through Playwright (never Playwright's download).
CHROMIUM ?= $(or $(GPUMARKET_TEST_CHROMIUM),/usr/bin/chromium)

.PHONY: up test install learn chromium docker lint typecheck bench cluster clean

# Each set-up step is one line on the terminal ("  ..  " while it runs, "  ok  " once done); what venv and
# pip print goes to INSTALL_LOG, whose end is shown when a step fails.
INSTALL_LOG ?= .gpumarket/install.log
define step
	@mkdir -p $(dir $(INSTALL_LOG)) && chmod 700 $(dir $(INSTALL_LOG))
	@printf '  ..  %s (log: %s)' "$(1)" "$(INSTALL_LOG)"
	@{ $(2); } >>$(INSTALL_LOG) 2>&1 || { printf '\r  !!  \n' ; echo "make: $(1) failed; the end of $(INSTALL_LOG):" >&2; \
	  tail -n 20 $(INSTALL_LOG) >&2; exit 1; }
	@printf '\r  ok  \n'
endef

$(BIN)/python:
	$(call step,virtual environment $(VENV),$(PYTHON) -m venv $(VENV) && $(VENV)/bin/python -m pip install --upgrade pip)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(call step,install gpumarket and its dependencies into $(VENV) (minutes the first time),$(BIN)/python -m pip install -e '.[test]')
	@touch $@

install: $(VENV)/.installed

# The learned placer's training (issue 26): gymnasium, Stable-Baselines3 and PyTorch, the `learn` extra. The
# marketplace never needs it (a shipped policy runs on numpy); the suite trains tiny policies, so `make test` has it.
# PyTorch's CPU build first (~190 MB; PyPI's Linux wheel is the CUDA build, ~5 GB with its libraries, and no test uses
# a GPU): from PyTorch's CPU index, or a local copy of that wheel that pip's find-links name. --retries 0: where that
# index cannot be reached, pip says so once and takes the local copy. TORCH_CPU= skips it (then pip picks a torch).
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
$(VENV)/.learn-installed: $(VENV)/.installed pyproject.toml
	$(call step,install the learn extra (PyTorch's CPU build; ~200 MB the first time),\
	  $(if $(TORCH_CPU),$(BIN)/python -m pip install --retries 0 --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH_CPU)' && )\
	  $(BIN)/python -m pip install -e '.[learn]')
	@touch $@

learn: $(VENV)/.learn-installed

# Installs Debian's chromium (the console's browser tests) and nodejs (the money formatter's
# agreement test runs money.js in Node) when missing and we are root (apt-get update only if the
# package index does not know them yet). Otherwise says how; those tests fail without them.
chromium:
	@if [ -x "$(CHROMIUM)" ] && command -v node >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium and nodejs for the console's tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y chromium nodejs \
		|| { DEBIAN_FRONTEND=noninteractive apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium nodejs; }; \
	else \
		echo "make: $(CHROMIUM) or node is missing: install Debian's chromium and nodejs (sudo apt-get install chromium nodejs)" \
		     "or point GPUMARKET_TEST_CHROMIUM at a Chromium; the console's tests fail without them" >&2; \
	fi

# Installs Debian's docker.io (the engine the container tests drive), busybox-static (the test
# image's rootfs), python3-torch (the torch test image's rootfs: a gloo all-reduce across
# containers), wireguard-go and wireguard-tools (wg), openssh-client (ssh-keygen, which the SSH key
# tests compare fingerprints with), openssh-server and rsync (bench_scp's baseline sshd and its rsync copies; rsync
# also goes into the demo image), curl and jq (the README walkthrough runs the README's commands),
# docker-registry and apache2-utils (a private registry with htpasswd auth: tests/test_registry_pull.py)
# when missing and we are root; the suite starts dockerd itself when none answers.
# Otherwise says how; those tests fail without them.
DOCKER_PACKAGES := docker.io busybox-static openssh-client openssh-server rsync curl jq docker-registry apache2-utils
# Without their recommends: python3-torch's are a compiler and headers, wireguard-tools' a kernel for its module.
CLUSTER_PACKAGES := python3-torch wireguard-go wireguard-tools
docker:
	@if command -v dockerd >/dev/null && [ -x /bin/busybox ] && command -v ssh-keygen >/dev/null \
		&& [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null \
		&& command -v curl >/dev/null && command -v jq >/dev/null \
		&& command -v docker-registry >/dev/null && command -v htpasswd >/dev/null \
		&& command -v wireguard-go >/dev/null && command -v wg >/dev/null \
		&& dpkg-query -W -f='$${db:Status-Abbrev}' python3-torch 2>/dev/null | grep -q '^.i'; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's $(DOCKER_PACKAGES) $(CLUSTER_PACKAGES) for the container, torch, WireGuard, SSH and README tests"; \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y $(DOCKER_PACKAGES) \
		  && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(CLUSTER_PACKAGES); } \
		|| { DEBIAN_FRONTEND=noninteractive apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(DOCKER_PACKAGES) \
		     && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(CLUSTER_PACKAGES); }; \
	else \
		echo "make: dockerd, /bin/busybox, python3-torch, wireguard-go, wg, ssh-keygen, sshd, rsync, curl, jq, docker-registry or htpasswd is missing:" \
		     "install Debian's $(DOCKER_PACKAGES) $(CLUSTER_PACKAGES) (sudo apt-get install $(DOCKER_PACKAGES) $(CLUSTER_PACKAGES));" \
		     "the container, torch image, WireGuard, SSH key and README walkthrough tests fail without them" >&2; \
	fi

up: install
	@$(BIN)/gpumarket up $(ARGS)

# The production topology as separate processes on this machine (PostgreSQL and Redis must run):
# migration job, two masters, two relays with the geo DNS, Celery worker and beat, four agents;
# checks one rental end to end and stops. ARGS="--agents 8" and the like go to `gpumarket topology`.
cluster: install
	$(BIN)/gpumarket topology --fresh --check $(ARGS)

# ruff, and the layer contracts of pyproject.toml ([tool.importlinter]: DESIGN.md's layers, no cycles).
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

# The suite on TEST_WORKERS pytest-xdist workers: tests that share an expensive fixture (the fault cluster, a
# module's `gpumarket up`) run on one worker (ONE_WORKER_SCOPES in tests/conftest.py); the 30 slowest are listed.
# Byte code is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, set on some CI machines): each
# worker otherwise rewrites the assertions of every test module again, ~10 s of CPU per worker and run.
TEST_WORKERS ?= 4
test: install learn chromium docker lint typecheck
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=30 $(ARGS)

# Every benchmark, then bench/report.py: each bench records its headline figures beside their baselines
# from the same run in bench/results.json (bench/_common.py: record), and the report turns that file into
# docs/performance.md. The full run takes 30–45 minutes on 2 cores (placement's quality table alone
# ~7 min, billing and offers a few minutes each); QUICK=1 runs every bench at a small size (~5 min);
# BENCHES="protocol bus" runs only those. A bench that fails does not stop the others; the target fails
# at the end. The workloads bench needs a Docker engine (make docker) and root.
BENCHES ?= protocol jsonbody streams tunnel bus relay relay_capacity pipeline agent ingest placement power price learned clusters offers billing workloads services webports verification volumes scp
QUICK ?=
# Small sizes for the benches that have no --quick of their own.
QUICK_ARGS_relay := --agents 10 --messages 100
QUICK_ARGS_relay_capacity := --agents 200 --measure 2 --bulk-mib 8
QUICK_ARGS_ingest := --hosts 200 --seconds 5
QUICK_ARGS_offers := --gpus 10000 --repeat 20
bench_args = $(if $(QUICK),$(or $(QUICK_ARGS_$(1)),--quick))

bench: install
	@failed=""; \
	$(foreach name,$(BENCHES),echo "== bench/bench_$(name).py $(call bench_args,$(name))"; \
	  $(BIN)/python bench/bench_$(name).py $(call bench_args,$(name)) || failed="$$failed $(name)"; ) \
	$(BIN)/python bench/report.py; \
	if [ -n "$$failed" ]; then echo "make bench: failed:$$failed" >&2; exit 1; fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info .gpumarket-cluster
