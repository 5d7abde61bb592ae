"""The connector inside real vLLM 0.33: factory, real Scheduler, real server."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from connector.errors import StartupError
from tests.connector.conftest import require_vllm
from tests.connector.fakes import FakeServer
from tests.support import ROOT, server_process


def _wait(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


# --------------------------------------------------------------- import hygiene


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_has_no_side_effects() -> None:
    proc = _run(
        "import sys, threading\n"
        "import connector\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert connector.resolve_chunk_size(96, 256) == 288\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_pure_parts_work_without_vllm() -> None:
    proc = _run(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import connector\n"
        "from connector import parse_extra_config, required_alignment\n"
        "assert required_alignment([32, 48]) == 96\n"
        "assert parse_extra_config({}).heartbeat_interval_s == 10.0\n"
        "try:\n"
        "    connector.MPCacheConnector\n"
        "except ModuleNotFoundError as exc:\n"
        "    print('needs', exc.name)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "needs vllm"


# ------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server_64() -> Iterator[str]:
    with server_process("--chunk-size", "64") as (url, _proc):
        yield url


@pytest.fixture
def built() -> Iterator[list[Any]]:
    """Connectors a test builds; shut down afterwards."""
    made: list[Any] = []
    yield made
    for c in made:
        c.shutdown()


def _factory(config: Any, role: str, kv_cache_config: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    return KVConnectorFactory.create_connector(
        config, KVConnectorRole[role.upper()], kv_cache_config
    )


# -------------------------------------------------------------------- factory


@pytest.mark.vllm
@pytest.mark.slow
def test_factory_builds_both_roles(tiny_model_dir: Path, server_64: str, built: list[Any]) -> None:
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        SupportsHMA,
    )

    from connector import MPCacheConnector
    from tests.connector.vllm_support import make_kv_cache_config, make_vllm_config

    extra = {"mpcache.server_urls": server_64, "lmcache.mp.heartbeat_interval": "30"}
    config = make_vllm_config(tiny_model_dir, extra)
    # SupportsHMA keeps vLLM's hybrid allocator on.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kvcc = make_kv_cache_config(num_blocks=32)
    for role in ("scheduler", "worker"):
        conn = _factory(config, role, kvcc)
        built.append(conn)
        assert type(conn) is MPCacheConnector
        assert isinstance(conn, KVConnectorBase_V1) and isinstance(conn, SupportsHMA)
        assert conn.chunk_size == 64
        assert conn.requires_kv_delivery is False
        assert conn.mp_config.heartbeat_interval_s == 30.0
    sched, worker = built
    assert sched.scheduler_adapter is not None and sched.worker_adapter is None
    assert worker.worker_adapter is not None and worker.scheduler_adapter is None
    assert sched.scheduler_adapter.namespace == worker.worker_adapter.namespace


@pytest.mark.vllm
def test_bad_extra_config_fails_startup_naming_the_key(tiny_model_dir: Path) -> None:
    require_vllm()
    from connector.errors import ConfigError
    from tests.connector.vllm_support import make_kv_cache_config, make_vllm_config

    config = make_vllm_config(tiny_model_dir, {"lmcache.mp.heartbeat_interval": "often"})
    with pytest.raises(ConfigError, match=r"lmcache\.mp\.heartbeat_interval"):
        _factory(config, "scheduler", make_kv_cache_config(num_blocks=8))


@pytest.mark.vllm
@pytest.mark.slow
def test_multi_server_agree_and_disagree(tiny_model_dir: Path, built: list[Any]) -> None:
    require_vllm()
    from tests.connector.vllm_support import make_kv_cache_config, make_vllm_config

    kvcc = make_kv_cache_config(num_blocks=8)
    with (
        server_process("--chunk-size", "64") as (a, _),
        server_process("--chunk-size", "50") as (b, _),
        server_process("--chunk-size", "100") as (c, _),
    ):
        agree = make_vllm_config(tiny_model_dir, {"mpcache.server_urls": [a, b]})
        conn = _factory(agree, "scheduler", kvcc)
        built.append(conn)
        assert conn.chunk_size == 64  # 50 rounds up to 64 for alignment 16

        disagree = make_vllm_config(
            tiny_model_dir, {"mpcache.server_urls": f"{a},{c}", "mpcache.startup_timeout": 2}
        )
        with pytest.raises(StartupError) as info:
            _factory(disagree, "scheduler", kvcc)
    text = str(info.value)
    assert f"{a} -> chunk size 64" in text
    assert f"{c} -> chunk size 112" in text


# ---------------------------------------------------------- scheduler in the loop


def _run_two_requests(tiny_model_dir: Path, extra: dict[str, Any], built: list[Any]) -> Any:
    """Request A computes a 150-token prompt; B repeats it. Returns the driver."""
    from tests.connector.vllm_support import (
        LAYERS,
        CpuWorker,
        kv_value,
        make_kv_cache_config,
        make_request,
        make_scheduler,
        make_vllm_config,
    )

    num_blocks = 64
    config = make_vllm_config(tiny_model_dir, extra, max_num_batched_tokens=96)
    kvcc = make_kv_cache_config(num_blocks)
    scheduler = make_scheduler(config, kvcc)
    built.append(scheduler.connector)
    worker_conn = _factory(config, "worker", kvcc)
    built.append(worker_conn)
    worker = CpuWorker(worker_conn, scheduler, num_blocks)

    prompt = [(i * 37 + 11) % 997 for i in range(150)]
    scheduler.add_request(make_request("A", prompt))
    for _ in range(10):  # chunked prefill of 96 tokens per step
        worker.step()
        if not scheduler.requests:
            break
    assert not scheduler.requests, "request A did not finish"
    for t in worker.kv.values():  # forget everything A left in vLLM's blocks
        t.zero_()

    scheduler.add_request(make_request("B", prompt))
    out, _ = worker.step()  # lookup hit: blocks allocated, load runs this step
    assert out.scheduled_new_reqs == []
    blocks_b = worker.blocks_of("B")
    loaded = {
        layer: [worker.slot(layer, blocks_b, p).clone() for p in range(128)] for layer in LAYERS
    }
    out, _ = worker.step()  # B is scheduled with the loaded tokens computed
    (new,) = out.scheduled_new_reqs
    return worker, new, prompt, loaded, kv_value


@pytest.mark.vllm
def test_scheduler_in_the_loop_fake_server(
    tiny_model_dir: Path, built: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control flow with vLLM's real Scheduler against the in-memory server."""
    require_vllm()
    from connector import MPCacheConnector

    fake = FakeServer("http://fake:1", min_chunk_size=64)
    monkeypatch.setattr(MPCacheConnector, "transport_factory", lambda url: fake.transport())
    monkeypatch.setattr(MPCacheConnector, "async_transport_factory", lambda url: fake.transport())
    _worker, new, _prompt, _loaded, _ = _run_two_requests(
        tiny_model_dir, {"mpcache.server_urls": fake.url}, built
    )
    assert new.req_id == "B"
    assert new.num_computed_tokens == 128  # two whole chunks came from the cache
    paths = fake.paths()
    assert paths.count("POST /cache/retrieve") == 1
    assert paths.count("POST /cache/store") == 2  # one batched call per step with work
    _wait(lambda: fake.ended == ["A"])  # A's session ended off vLLM's thread


@pytest.mark.vllm
@pytest.mark.slow
def test_scheduler_in_the_loop_real_server(
    tiny_model_dir: Path, server_64: str, built: list[Any]
) -> None:
    """A real Scheduler, a CPU worker and a real server: B loads A's exact bytes."""
    require_vllm()
    _worker, new, prompt, loaded, kv_value = _run_two_requests(
        tiny_model_dir, {"mpcache.server_urls": server_64}, built
    )
    assert new.req_id == "B"
    assert new.num_computed_tokens == 128
    for li, layer in enumerate(loaded):
        for p in range(128):
            expected = kv_value(prompt[p], p, li)
            assert bool((loaded[layer][p] == expected).all()), (layer, p)
