# Sparrow: `make run` sets up and generates text with the built-in model; `make test` runs the suite.
# Everything is installed into $(VENV); its commands are $(VENV)/bin/sparrow, $(VENV)/bin/python.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Once upon a time

.PHONY: setup setup-dev run test test-fast lint check-install bench serve clean wheelhouse

# What running needs: the package and its dependencies, no test or plotting tools.
setup: $(VENV)/.installed
# What the tests need on top: pytest, the openai client, schemathesis, matplotlib, triton, ...
setup-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	# torch is pinned to the CPU build on disk; a looser pin pulls gigabytes of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

run: setup
	$(VENV)/bin/sparrow generate --prompt "$(PROMPT)" --max-tokens 32
	@echo
	@echo "Sparrow is installed in $(VENV): run $(VENV)/bin/sparrow --help, or 'source $(VENV)/bin/activate' first."

# Two passes: the suite on two workers (one file per worker at a time, so a module's shared engine
# is built once), then the tests marked `serial` alone: they pip-install plugins into the
# environment or time a signal. TEST_WORKERS=0 runs the first pass in one process.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, as in many
# containers): otherwise each pytest process compiles and rewrites every test module again (~8 s of
# CPU each), and every Python process the tests start compiles Sparrow's modules again.
TEST_WORKERS ?= 2
test: setup-dev
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider --durations=10 -m serial

# ruff on every Python file; mypy on the kernel's contract (scripts/typecheck.py says which packages).
lint: setup-dev
	$(PY) -m ruff check framework hookspecs plugins examples tests scripts
	$(PY) scripts/typecheck.py

test-fast: setup-dev
	$(PY) -m pytest -q -x -m "not slow"

# A non-editable install into a fresh virtual environment imports every package.
check-install:
	rm -rf /tmp/sparrow-install-check
	$(PYTHON) -m venv /tmp/sparrow-install-check
	/tmp/sparrow-install-check/bin/python -m pip install -q torch==2.13.0
	/tmp/sparrow-install-check/bin/python -m pip install -q .
	cd /tmp && /tmp/sparrow-install-check/bin/python -c "import sparrow, sparrow.hookspecs, sparrow_schedulers, sparrow_cpu, sparrow_cuda; from sparrow.plugins import get_registry; r = get_registry(); print('installed:', sorted(r.platforms), sorted(r.schedulers))"

bench: setup
	$(VENV)/bin/sparrow bench throughput --compare-hf

serve: setup
	$(VENV)/bin/sparrow serve

wheelhouse:
	$(PYTHON) scripts/build_wheelhouse.py --python-version 3.12 --dest .whl

clean:
	rm -rf $(VENV) build dist *.egg-info
