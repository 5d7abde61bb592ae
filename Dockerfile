# mpcache server image. CPU-only torch keeps it small; for CUDA IPC with GPU workers,
# build FROM a CUDA runtime image and install the matching CUDA torch instead.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    MPCACHE_HOST=0.0.0.0 \
    MPCACHE_PORT=8000

RUN useradd --create-home --uid 10001 mpcache
WORKDIR /srv/mpcache

# Dependencies first, for layer caching. torch is pinned to the CPU wheel index.
COPY pyproject.toml README.md ./
COPY app ./app
COPY dataplane ./dataplane
COPY connector ./connector
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install .

USER mpcache
EXPOSE 8000

# The cache pool lives in /dev/shm. Docker's default is 64 MiB: run with
# --shm-size=<pool size + headroom> (or --ipc=host to share vLLM's /dev/shm, which
# is also what lets workers outside the container map their KV caches).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"MPCACHE_PORT\", \"8000\")}/health', timeout=2)" || exit 1

ENTRYPOINT ["mpcache", "server"]
