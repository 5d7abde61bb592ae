"""deploy/ and the Dockerfiles: they parse, and keep the invariants the README states.

Docker cannot build here, so the images are checked statically: what would make
them wrong (torch not at the tested pin, code copied before the dependency layer, a
health check blind to --port, a package left out) is visible in the files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.settings import DEFAULT_PORT, Settings
from tests.support import ROOT

DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DASHBOARD = DEPLOY / "grafana" / "mpcache-dashboard.json"


def _pin(name: str) -> str:
    for line in (ROOT / "requirements" / "server.txt").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line
    raise AssertionError(f"{name} is not pinned in requirements/server.txt")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _index(steps: list[tuple[str, str]], predicate: Any) -> int:
    return next(i for i, step in enumerate(steps) if predicate(step))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dependencies_are_installed_before_the_code_is_copied(name: str) -> None:
    steps = _instructions(ROOT / name)
    deps = _index(steps, lambda s: s[0] == "RUN" and "requirements/server.txt" in s[1])
    code = _index(steps, lambda s: s[0] == "COPY" and s[1].split()[0] in ("app", "."))
    assert deps < code
    copied = {s[1].split()[0] for s in steps if s[0] == "COPY"}
    # Every package pyproject installs is copied (contract/ was once left out).
    assert {"app", "dataplane", "connector", "contract"} <= copied
    install = _index(steps, lambda s: s[0] == "RUN" and "--no-deps ." in s[1])
    assert install > code


def test_cpu_image_installs_the_tested_torch_from_the_cpu_index() -> None:
    run = next(s[1] for s in _instructions(ROOT / "Dockerfile") if s[0] == "RUN")
    assert "download.pytorch.org/whl/cpu" in run
    # The pin is read from requirements/server.txt, so it cannot drift from the tests'.
    assert "grep -E '^torch==' requirements/server.txt" in run
    assert "pip install -r requirements/server.txt" in run
    assert _pin("torch") == "torch==2.13.0"


def test_gpu_image_is_vllms_at_a_pinned_tag() -> None:
    steps = _instructions(ROOT / "Dockerfile.gpu")
    image = next(s[1] for s in steps if s[0] == "ARG" and s[1].startswith("VLLM_IMAGE="))
    assert re.fullmatch(r"VLLM_IMAGE=vllm/vllm-openai:v\d+\.\d+\.\d+", image)
    assert image.endswith("v" + re.search(r"vllm==([\d.]+)", _bootstrap()).group(1))  # type: ignore[union-attr]
    assert ("FROM", "${VLLM_IMAGE}") in steps


def _bootstrap() -> str:
    return (ROOT / "scripts" / "bootstrap_venv.sh").read_text()


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_healthcheck_follows_the_server_wherever_it_listens(name: str) -> None:
    steps = _instructions(ROOT / name)
    check = next(s[1] for s in steps if s[0] == "HEALTHCHECK")
    assert '"mpcache", "health"' in check and "MPCACHE_PORT" not in check
    env = " ".join(s[1] for s in steps if s[0] == "ENV")
    assert "MPCACHE_ADDRESS_FILE=" in env  # the server writes its real URL there
    assert ("EXPOSE", str(DEFAULT_PORT)) in steps
    assert ("ENTRYPOINT", '["mpcache", "server"]') in steps


SOCKET_DIR = "/run/mpcache"
SOCKET = f"{SOCKET_DIR}/register.sock"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_kubernetes_examples() -> None:
    assert {p.name for p in K8S} == {"vllm-with-mpcache.yaml", "mpcache-daemonset.yaml"}
    for path in K8S:
        (workload,) = _documents(path)
        pod = workload["spec"]["template"]["spec"]
        (server,) = [c for c in pod["containers"] if c["name"] == "mpcache"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert server[probe]["httpGet"] == {"path": "/health", "port": DEFAULT_PORT}
        assert "runAsUser" in pod["securityContext"], path.name  # one uid for the pod
        # The registration socket sits in a directory every container of the pod sees.
        assert server["args"][server["args"].index("--register-socket") + 1] == SOCKET
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts[SOCKET_DIR] == "mpcache-run", (path.name, container["name"])
        if pod.get("hostIPC"):
            continue
        # Sidecar: one memory-backed /dev/shm shared by both containers.
        (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory"
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/dev/shm"] == "dshm", container["name"]
            assert "runAsUser" not in container.get("securityContext", {})


def test_compose_shares_ipc_and_user() -> None:
    (compose,) = _documents(DEPLOY / "compose.yaml")
    server, vllm = compose["services"]["mpcache"], compose["services"]["vllm"]
    assert vllm["ipc"] == "service:mpcache" and server["ipc"] == "shareable"
    assert server["user"] == vllm["user"]
    assert "shm_size" in server
    socket = server["command"][server["command"].index("--register-socket") + 1]
    assert socket == SOCKET
    for service in (server, vllm):
        assert f"mpcache-run:{SOCKET_DIR}" in service["volumes"]
    url = json.loads(vllm["command"][-1])["kv_connector_extra_config"]["mpcache.server_urls"]
    assert url == f"http://mpcache:{DEFAULT_PORT}"


def test_dashboard_uses_only_metrics_the_server_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bmpcache_[a-z_]+", e)}
    with TestClient(create_app(Settings())) as client:
        client.post("/negotiate", json={"required_alignment": 96})
        client.get("/health")
        client.post("/cache/end", json={"request_ids": ["r"]})
        text = client.get("/metrics").text
    exported = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    } | {  # labelled families show no sample before their first observation
        "mpcache_copied_bytes_total",
        "mpcache_transfer_timeouts_total",
    }
    assert used and used <= exported, used - exported
    assert {p["id"] for p in dashboard["panels"]} == set(range(1, len(dashboard["panels"]) + 1))
