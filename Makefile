# The two commands of the README: `make demo` (the main job) and `make test` (the test suite).
PYTHON ?= python3

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install -e ".[test]"

demo: install
	$(PYTHON) -m fa_backend demo

test: install
	$(PYTHON) -m pytest tests -q -n 2

bench:
	$(PYTHON) -m fa_backend bench --memory --json bench.json
