# Set-up and the two everyday commands. Each target installs only what is missing:
#   make app    the browser app on http://127.0.0.1:7860 (a tiny random-weight demo when no checkpoint is given;
#               pass options with ARGS, e.g. make app ARGS="--checkpoint /path/to/MiniMax-H3")
#   make test   lint + the whole test suite (installs Debian's chromium for the browser test when it is absent,
#               and Ray Serve for the tests of `app.py --ray`)
#   make gpu    adds FlashAttention-4 (requirements-gpu.txt) to the venv, for Hopper and newer GPUs
#   make ray    adds Ray Serve (requirements-ray.txt) to the venv, for `python app.py --ray ADDRESS` and `ray start`
#   make lock   recompiles the four lock files from pyproject.toml (keeps every existing pin; bump one with
#               make lock UV_FLAGS="--upgrade-package NAME", all with UV_FLAGS=--upgrade)
#   make clean  removes the venv
# The venv is .venv (VENV=...). Its installs are keyed on the lock files: a lock that has not changed since the
# last install is not installed again.

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
UV_FLAGS ?=
# Test processes of `make test` (pytest-xdist), each taking a whole test file at a time.
TEST_PROCESSES ?= 2
BIN := $(VENV)/bin
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps
LOCK_FLAGS := --universal --python-version 3.11 --fork-strategy fewest --generate-hashes --quiet $(UV_FLAGS)

.PHONY: app test gpu ray lock clean browser

app: $(VENV)/.installed-app
	$(BIN)/python app.py $(ARGS)

# The Ray Serve tests (tests/test_ray_serve.py, a local Ray cluster) are part of the suite: Ray comes in with it.
# Our packages' bytecode is written once first: the suite starts dozens of Python processes (apps, CLIs, fork
# servers), and where PYTHONDONTWRITEBYTECODE is set each of them compiled our modules again (~0.3 s of CPU each).
test: $(VENV)/.installed-dev $(VENV)/.installed-ray browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m compileall -q h3engine ui kernels benchmarks
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --durations=30

gpu: $(VENV)/.installed-gpu

ray: $(VENV)/.installed-ray

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "h3engine needs Python 3.11 or newer; this is " + sys.version.split()[0] + " (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)

# Each lock installs with --no-deps: the lock names every package, so nothing outside it can come in.
$(VENV)/.installed-app: requirements.txt | $(BIN)/python
	$(PIP_INSTALL) -r requirements.txt
	@touch $@

$(VENV)/.installed-dev: requirements-dev.txt | $(BIN)/python
	$(PIP_INSTALL) -r requirements-dev.txt
	@touch $@ $(VENV)/.installed-app

$(VENV)/.installed-gpu: requirements-gpu.txt | $(BIN)/python
	$(PIP_INSTALL) -r requirements-gpu.txt
	@touch $@ $(VENV)/.installed-app

$(VENV)/.installed-ray: requirements-ray.txt | $(BIN)/python
	$(PIP_INSTALL) -r requirements-ray.txt
	@touch $@ $(VENV)/.installed-app

browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "Installing Debian's chromium for the browser test"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }

lock: $(VENV)/.installed-dev
	$(BIN)/uv pip compile pyproject.toml $(LOCK_FLAGS) -o requirements.txt
	$(BIN)/uv pip compile pyproject.toml --extra dev -c requirements.txt $(LOCK_FLAGS) -o requirements-dev.txt
	$(BIN)/uv pip compile pyproject.toml --extra gpu -c requirements.txt $(LOCK_FLAGS) -o requirements-gpu.txt
	$(BIN)/uv pip compile pyproject.toml --extra ray -c requirements-dev.txt $(LOCK_FLAGS) -o requirements-ray.txt

clean:
	rm -rf $(VENV)
