# Every target builds the venv first if it is missing (scripts/bootstrap_venv.sh).
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: venv serve test lint openapi bench clean

venv:
	@bash scripts/bootstrap_venv.sh

serve: venv
	$(PY) -m app server --host $(HOST) --port $(PORT)

# The whole suite: lint, types, tests. .ci/run calls exactly this.
test: venv lint
	MPCACHE_REQUIRE_VLLM=$${MPCACHE_REQUIRE_VLLM:-1} $(PY) -m pytest -q

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

openapi: venv
	$(PY) scripts/gen_openapi.py

# Ratios against a baseline measured in the same run (see README "Benchmarks").
bench: venv
	$(PY) bench/negotiate_bench.py
	$(PY) bench/dataplane_bench.py
	$(PY) bench/connector_bench.py

clean:
	rm -f $(VENV)
