"""``MPCacheConnector`` with every worker-side call vLLM makes on its step timed.

Loaded by vLLM (``kv_connector_module_path: bench.timed_connector``,
``kv_connector: TimedMPCacheConnector``) in ``bench/step_bench.py``'s engine; it
imports vLLM, so only the e2e venv's python imports it.

The subclass wraps each method in ``STEP_CALLS`` (vLLM 0.32's model runner:
``gpu_model_runner.py`` calls ``handle_preemptions`` before the step's
``bind_connector_metadata``; ``kv_connector_model_runner_mixin.py`` calls the rest
of the cycle through ``clear_connector_metadata``; every attention layer calls
``has_connector_metadata``, ``wait_for_layer_load`` and ``save_kv_layer``
(``kv_transfer_utils.py``); vLLM 0.33 makes the same calls;
tests/connector/test_timed_connector.py checks the list against the installed vLLM).
It wraps whatever the parent class resolves each name to, so the same module times
today's synchronous connector and a later asynchronous one without a change. Calls
a wrapped method makes to another (the base ``get_transfer_results`` calls
``get_finished``) count once, in the outer call.

A step is one cycle ending in ``clear_connector_metadata``: it holds every timed
call since the previous step's clear (``handle_preemptions`` comes before the bind).
At each clear the worker appends one JSON line to the file named by
``MPCACHE_STEP_RECORDS`` (nothing is written when it is unset)::

    {"ms": 12.3, "calls": {"wait_for_save": [1, 12.1], ...}, "loads": 0, "stores": 2,
     "t": 1796198400.5}

``ms``: the step's summed time inside the timed calls; ``calls``: per method, the
number of calls and their summed ms; ``loads`` / ``stores``: the operations in the
step's plan (``MPCacheConnectorMetadata.plan``, 0 if the metadata has no such plan);
``t``: the wall clock (``time.time``) at the step's clear. The line is written
after the clear's own time is taken, so writing it is not counted. Only the worker
role records: the scheduler-role instance runs in the engine core, where vLLM calls
``get_kv_connector_stats`` too.

With ``MPCACHE_STEP_CPU=1`` as well, each record also has ``"stalled_ms"``: the part
of ``ms`` the host took (``host_stall_ms``, summed over the step's calls). A call's
thread then reads its CPU time and context switches before and after the call, and
outside its timed span: about 3 us of syscalls on each side, on vLLM's thread, which
``ms`` does not count but the step's wall time does.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from collections.abc import Callable
from typing import IO, Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from connector.mp_connector import MPCacheConnector

__all__ = [
    "CPU_ENV",
    "RECORDS_ENV",
    "STEP_CALLS",
    "ThreadClock",
    "TimedMPCacheConnector",
    "host_stall_ms",
]

RECORDS_ENV = "MPCACHE_STEP_RECORDS"
CPU_ENV = "MPCACHE_STEP_CPU"

STEP_CALLS = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "has_connector_metadata",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)
"""The worker-side methods vLLM 0.32 calls on an engine step (module docstring)."""


class ThreadClock(NamedTuple):
    """The calling thread's CPU time (s) and context switches, voluntary or not."""

    cpu_s: float
    switches: int

    @classmethod
    def read(cls) -> ThreadClock:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return cls(time.thread_time(), usage.ru_nvcsw + usage.ru_nivcsw)


def host_stall_ms(wall_s: float, before: ThreadClock, after: ThreadClock) -> float:
    """Of a call's ``wall_s``, the ms its thread lost to the host, not to the call.

    A thread that made no context switch during the call neither waited (a lock, the
    GIL, a socket: each puts it to sleep) nor was preempted by another thread of
    this machine: it held its CPU throughout. Wall time past its CPU time then went
    where the guest kernel does not bill the thread: the hypervisor ran something
    else on the virtual CPU (steal), or interrupts were handled. A thread that
    switched may have waited on the connector, so none of its time is called a
    stall (0.0). ``before`` is read before the call's clock starts and ``after``
    once it stops, so the CPU time they span covers the wall time measured.
    """
    if after.switches != before.switches:
        return 0.0
    return max(0.0, wall_s - (after.cpu_s - before.cpu_s)) * 1e3


def _count(meta: object, field: str) -> int:
    plan = getattr(meta, "plan", None)
    return len(getattr(plan, field, ()) or ())


class TimedMPCacheConnector(MPCacheConnector):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._step_calls: dict[str, list[float]] = {}
        self._step_ms = 0.0
        self._step_stalled_ms = 0.0
        self._step_plan = (0, 0)
        self._depth = 0
        self._records: IO[str] | None = None
        self._cpu = False
        super().__init__(*args, **kwargs)
        path = os.environ.get(RECORDS_ENV)
        if path and self.role == KVConnectorRole.WORKER:
            self._records = open(path, "a", buffering=1)  # noqa: SIM115 (closed in shutdown)
            self._cpu = os.environ.get(CPU_ENV) == "1"

    def _end_step(self) -> None:
        loads, stores = self._step_plan
        record: dict[str, Any] = {
            "ms": self._step_ms,
            "calls": self._step_calls,
            "loads": loads,
            "stores": stores,
            "t": time.time(),
        }
        if self._cpu:
            record["stalled_ms"] = self._step_stalled_ms
        self._step_calls, self._step_ms, self._step_plan = {}, 0.0, (0, 0)
        self._step_stalled_ms = 0.0
        if self._records is not None:
            self._records.write(json.dumps(record) + "\n")

    def shutdown(self) -> None:
        super().shutdown()
        if self._records is not None:
            self._records.close()
            self._records = None


def _timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(self: TimedMPCacheConnector, *args: Any, **kwargs: Any) -> Any:
        if self._records is None or self._depth:
            return method(self, *args, **kwargs)
        if name == "bind_connector_metadata" and args:
            self._step_plan = (_count(args[0], "loads"), _count(args[0], "stores"))
        self._depth += 1
        before = ThreadClock.read() if self._cpu else None
        begin = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            wall_s = time.perf_counter() - begin
            if before is not None:
                self._step_stalled_ms += host_stall_ms(wall_s, before, ThreadClock.read())
            ms = wall_s * 1e3
            self._depth -= 1
            self._step_ms += ms
            entry = self._step_calls.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += ms
            if name == "clear_connector_metadata":
                self._end_step()

    return timed


for _name in STEP_CALLS:
    setattr(TimedMPCacheConnector, _name, _timed(_name, getattr(MPCacheConnector, _name)))
