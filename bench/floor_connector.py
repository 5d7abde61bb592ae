"""``MPCacheConnector`` whose loads copy nothing: what a hit costs beside the copy.

Loaded by vLLM (``kv_connector_module_path: bench.floor_connector``,
``kv_connector: FloorMPCacheConnector``) in ``bench/ttft_bench.py --floor``'s engine;
it imports vLLM, so only the e2e venv's python imports it (and the vllm tests).

Everything is the shipped connector's (lookups, the landing wait, stores, the load
lane and its ledger, vLLM's asynchronous-load steps) except the retrieve call of the
worker's load lane: ``instant_retrieve`` answers it at once, every request loaded in
full, and the server is not called, so vLLM's blocks keep whatever they held. Its
TTFT on a hit is the floor that vLLM's asynchronous-load protocol and the connector
set before any byte moves; the shipped connector's hit over it is what the copy
adds. Its outputs are wrong by design (the KV was never loaded): the bench does not
compare them.
"""

from __future__ import annotations

from typing import Any

from connector.mp_connector import MPCacheConnector
from contract.schemas import RetrieveRequest, RetrieveResponse, RetrieveResult

__all__ = ["FloorMPCacheConnector", "instant_retrieve"]


def instant_retrieve(body: RetrieveRequest, **_: Any) -> RetrieveResponse:
    """A retrieve reply that loaded every item in full, at once."""
    return RetrieveResponse(
        results=[
            RetrieveResult(
                request_id=item.request_id,
                loaded_tokens=item.end_token - item.start_token,
                failed_block_ids=[],
            )
            for item in body.requests
        ]
    )


class FloorMPCacheConnector(MPCacheConnector):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.worker_adapter is not None:
            # The one call replaced: the load lane's retrieve (connector.worker._load).
            self.worker_adapter._transfers.retrieve = instant_retrieve  # type: ignore[method-assign]
