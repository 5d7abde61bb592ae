#!/usr/bin/env bash
# Make sure `redis-server` (Debian's package, Redis 7.0) is there for the tests that
# start one (tests/cluster, on free 127.0.0.1 ports; they start and stop it themselves).
#
# Under CI (`CI` set) a missing redis-server is installed with apt-get, and a failed
# install fails the run. Elsewhere nothing is installed: one line says how, and the
# Redis tests skip.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
if [ -n "${CI:-}" ]; then
    echo "ensure_redis: installing redis-server (apt-get)" >&2
    sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends redis-server >&2
    command -v redis-server >/dev/null 2>&1 || { echo "ensure_redis: redis-server still missing after apt-get" >&2; exit 1; }
    exit 0
fi
echo "make test: redis-server is not installed, so tests/cluster will skip; install it with: apt-get update && apt-get install -y redis-server" >&2
