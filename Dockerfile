# mpcache server image, CPU torch: for vLLM on CPU, or GPU vLLM whose KV caches stay
# in CPU memory. For CUDA IPC with GPU workers use Dockerfile.gpu (vLLM's CUDA torch).
#
#   docker build -t mpcache .
#   docker run --rm --ipc=host --user "$(id -u vllm-user)" mpcache   # docs/operating.md "Containers"
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    MPCACHE_HOST=0.0.0.0 \
    MPCACHE_ADDRESS_FILE=/tmp/mpcache.address

WORKDIR /srv/mpcache

# 1. The tested pins (requirements/server.txt), before any code, so an edit to the code
#    reuses this layer. torch first, from the CPU wheel index, at the pinned version.
COPY requirements/server.txt requirements/server.txt
RUN pip install --index-url https://download.pytorch.org/whl/cpu \
        "$(grep -E '^torch==' requirements/server.txt)" \
 && pip install -r requirements/server.txt

# 2. The code, without dependencies (installed above).
COPY pyproject.toml README.md LICENSE ./
COPY contract ./contract
COPY dataplane ./dataplane
COPY app ./app
COPY connector ./connector
RUN pip install --no-deps . && rm -rf build

# 3. The streaming block kernel (dataplane/blockcopy.py) and the chunk-key loop
#    (contract/keychain.py), built now with a compiler
#    that does not stay in the image; the server loads it from XDG_CACHE_HOME.
ENV XDG_CACHE_HOME=/opt/mpcache/cache
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && python -c "from dataplane import blockcopy; print(blockcopy.load().path)" \
 && python -c "from contract import keychain; print(keychain.load().path)" \
 && chmod -R a+rX /opt/mpcache \
 && apt-get purge -y --auto-remove gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Any uid works: the server must run as the uid of the vLLM processes whose shm
# segments (mode 0600) it maps, so pass `--user` (Kubernetes: runAsUser). The default
# is an unprivileged one. /tmp holds the address file.
USER 65534:65534
EXPOSE 8733

# Reads the URL the server actually listens on (MPCACHE_ADDRESS_FILE), so --port and
# --host given to the container do not make it "unhealthy".
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["mpcache", "health", "--timeout-s", "3"]

ENTRYPOINT ["mpcache", "server"]
