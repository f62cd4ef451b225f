# The two commands: `make up` runs the whole mesh, `make test` runs the whole test suite.
# Both set up the virtual environment first (Python 3.11, pip and gcc are all they need).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# The 30 slowest tests are listed after every run: where the CI minutes go.
PYTEST_ARGS ?= --durations=30

.PHONY: up test setup lint protos protos-check deploy-gen deploy-check bench-serving clean

setup: $(VENV)/.installed

# torch is pinned and installed first: an unpinned resolve would pull multi-GB CUDA wheels.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[services,test,dev,bench,deploy]'
	touch $@

up: setup
	$(PY) -m services.mesh $(ARGS)

# The suite runs with its real outside parts (Chromium, Prometheus, a Docker engine with compose and
# swarm): scripts/with_system.sh installs and starts them as root on Debian, and stops the engine after.
test: setup protos-check lint deploy-check
	scripts/with_system.sh $(PY) -m pytest $(PYTEST_ARGS)

# ruff lint and format check on all hand-written code (generated protos are excluded in pyproject).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

protos:
	$(PY) scripts/gen_protos.py

protos-check: setup
	$(PY) scripts/gen_protos.py --check

# The deployment files rendered from services/mesh/topology.py: compose, the swarm stack, the chart's args.
deploy-gen: setup
	$(PY) scripts/gen_deploy.py

# Offline: every values set of the Helm chart rendered (Helm's Go SDK), schema-validated and
# cross-checked, the generated files up to date, every deployment's commands parsed (docs/deploy.md).
deploy-check: setup
	$(PY) scripts/deploy_check.py
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_deploy.py

bench-serving: setup
	$(PY) -m bench.serving $(ARGS)

clean:
	rm -rf run .pytest_cache
