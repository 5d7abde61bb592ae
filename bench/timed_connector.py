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
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import IO, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from connector.mp_connector import MPCacheConnector

__all__ = ["RECORDS_ENV", "STEP_CALLS", "TimedMPCacheConnector"]

RECORDS_ENV = "MPCACHE_STEP_RECORDS"

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


def _count(meta: object, field: str) -> int:
    plan = getattr(meta, "plan", None)
    return len(getattr(plan, field, ()) or ())


class TimedMPCacheConnector(MPCacheConnector):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._step_calls: dict[str, list[float]] = {}
        self._step_ms = 0.0
        self._step_plan = (0, 0)
        self._depth = 0
        self._records: IO[str] | None = None
        super().__init__(*args, **kwargs)
        path = os.environ.get(RECORDS_ENV)
        if path and self.role == KVConnectorRole.WORKER:
            self._records = open(path, "a", buffering=1)  # noqa: SIM115 (closed in shutdown)

    def _end_step(self) -> None:
        loads, stores = self._step_plan
        record = {
            "ms": self._step_ms,
            "calls": self._step_calls,
            "loads": loads,
            "stores": stores,
            "t": time.time(),
        }
        self._step_calls, self._step_ms, self._step_plan = {}, 0.0, (0, 0)
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
        begin = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            ms = (time.perf_counter() - begin) * 1e3
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
