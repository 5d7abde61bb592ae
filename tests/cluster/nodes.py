"""One vLLM instance's view of an mpcache server, through the connector's public
adapters (``SchedulerAdapter`` + ``WorkerAdapter``), as two nodes' engines would use
their own servers.

The KV caches are registered by ``WorkerAdapter.register_kv_caches`` only, in
``Instance.__init__``: if the registration wire format changes, this is the one
place the cluster tests depend on it.
"""

from __future__ import annotations

import torch

from connector.alignment import layout_from_groups
from connector.config import ConnectorConfig
from connector.scheduler import SchedulerAdapter
from connector.worker import WorkerAdapter
from tests.connector.fakes import AttnSpec, FakeBlocks, FakeRequest, Group, NewReq, StepOutput, ask
from tests.support import quick_connector_config

NUM_BLOCKS = 32
BLOCK_SIZE = 16
NAMESPACE = "tiny@cluster/ws1"
LAYERS = ("l0", "l1")


def _config(url: str) -> ConnectorConfig:
    config: ConnectorConfig = quick_connector_config(url)
    return config


class Instance:
    """A vLLM instance (scheduler and one worker, rank 0 of 1) with its own KV cache."""

    def __init__(self, url: str, instance_id: str) -> None:
        layout = layout_from_groups([Group(AttnSpec(BLOCK_SIZE), list(LAYERS))])
        common = {"model": "tiny", "instance_id": instance_id, "namespace": NAMESPACE}
        self.scheduler = SchedulerAdapter(_config(url), layout, world_size=1, **common)  # type: ignore[arg-type]
        try:
            self.worker = WorkerAdapter(
                _config(url),
                layout,
                rank=0,
                world_size=1,
                num_blocks=NUM_BLOCKS,
                **common,  # type: ignore[arg-type]
            )
        except BaseException:
            self.scheduler.shutdown()
            raise
        self.kv = {name: torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 2, 8) for name in LAYERS}
        try:
            self.worker.register_kv_caches(self.kv)
        except BaseException:
            self.close()
            raise
        self._steps = 0

    @property
    def chunk_size(self) -> int:
        return self.scheduler.chunk_size

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()

    def store(self, request_id: str, prompt: list[int], blocks: list[int], seed: float) -> None:
        """Compute (fill with a pattern) ``prompt``'s blocks, store its whole chunks."""
        request = FakeRequest(request_id, list(prompt))
        ask(self.scheduler, request, 0)
        self.scheduler.update_state_after_alloc(request, FakeBlocks((blocks,)), 0)
        for j, b in enumerate(blocks):
            for i, name in enumerate(LAYERS):
                self.kv[name][b].copy_(
                    torch.arange(2 * BLOCK_SIZE * 2 * 8, dtype=torch.float32).reshape(
                        2, BLOCK_SIZE, 2, 8
                    )
                    + seed * 1000
                    + j * 10
                    + i
                )
        plan = self.scheduler.build_connector_meta(
            StepOutput(
                [NewReq(request_id, (blocks,), 0)], num_scheduled_tokens={request_id: len(prompt)}
            )
        )
        self.worker.save(plan)
        assert self.worker.flush(10.0)  # its lane has sent it
        self.scheduler.request_finished(request)
        self.scheduler.transfers_finished({request.request_id})  # vLLM's finished_sending

    def hit_tokens(self, request_id: str, prompt: list[int]) -> int:
        hits, _ = ask(self.scheduler, FakeRequest(request_id, list(prompt)), 0)
        return hits

    def load(self, request_id: str, prompt: list[int], blocks: list[int]) -> tuple[int, bool]:
        """Look ``prompt`` up and load its hits into ``blocks``: (hit tokens, loaded ok)."""
        request = FakeRequest(request_id, list(prompt))
        hits, _ = ask(self.scheduler, request, 0)
        if not hits:
            return 0, True
        self.scheduler.update_state_after_alloc(request, FakeBlocks((blocks,)), hits)
        plan = self.scheduler.build_connector_meta(StepOutput())
        self.worker.start_load(plan)
        assert self.worker.flush(10.0)  # its lane has sent it
        done, _ = self.worker.take_transfer_results()
        errors = self.worker.take_load_errors()
        self.scheduler.request_finished(request)
        self.scheduler.transfers_finished({request.request_id})  # vLLM's finished_sending
        return hits, request_id in done and not errors

    def block(self, block_id: int) -> dict[str, torch.Tensor]:
        return {name: self.kv[name][block_id].clone() for name in LAYERS}
