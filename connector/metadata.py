"""What the scheduler adapter hands to the workers each step (pure, picklable).

vLLM ships the step's connector metadata from the scheduler process to every worker;
these frozen dataclasses are its payload (``connector.vllm`` wraps a ``StepPlan`` in
vLLM's ``KVConnectorMetadata``). Tokens travel as base64 little-endian int32
(``tokens_b64``, ``contract.tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contract.schemas import NULL_BLOCK_ID, TransferItem
from contract.wire_text import wire_text

__all__ = ["StepPlan", "TransferOp"]


@dataclass(frozen=True)
class TransferOp:
    """One request's chunks ``[start_token, end_token)`` to store or load: whole
    chunks, then with ``unit_tokens`` whole units past them (a stored prompt's tail,
    or a load that ends inside a chunk).

    ``block_ids[i]`` lists the request's blocks from token 0 for the ``i``-th
    *cacheable* KV cache group (the registration's groups, in ascending vLLM group
    id); scratch and transfer-disabled groups are not sent. Entries equal to
    ``NULL_BLOCK_ID`` are not touched by the server.
    """

    request_id: str
    start_token: int
    end_token: int
    tokens_b64: str
    block_ids: list[list[int]]
    cache_salt: str | None = None
    unit_tokens: int | None = None

    def to_item(self, namespace: str) -> TransferItem:
        return TransferItem(
            request_id=wire_text(self.request_id),
            namespace=namespace,
            cache_salt=self.cache_salt,
            tokens_b64=self.tokens_b64,
            start_token=self.start_token,
            end_token=self.end_token,
            block_ids=self.block_ids,
            unit_tokens=self.unit_tokens,
        )

    def nonnull_block_ids(self) -> set[int]:
        """Every block the server may write for this op (all groups)."""
        return {b for ids in self.block_ids for b in ids if b != NULL_BLOCK_ID}

    def touched_block_ids(self, spans: Sequence[int]) -> set[int]:
        """Non-null blocks covering ``[start_token, end_token)`` (for load failures)."""
        out: set[int] = set()
        for group_blocks, span in zip(self.block_ids, spans, strict=False):
            if not group_blocks or span < 1:
                continue
            first = self.start_token // span
            last = -(-self.end_token // span)
            out.update(b for b in group_blocks[first:last] if b != NULL_BLOCK_ID)
        return out


@dataclass(frozen=True)
class StepPlan:
    """One engine step's cache work: loads before use, stores after the forward.

    ``failed_loads`` are requests vLLM waits on (an accepted asynchronous load) whose
    load could not be planned: every worker reports them finished and failed, so
    vLLM recomputes them instead of waiting for ever. ``preempted`` are requests
    vLLM preempted this step (their blocks may be rewritten by its forward): every
    worker revokes their stores not yet sent and waits for one being sent.
    """

    loads: tuple[TransferOp, ...] = ()
    stores: tuple[TransferOp, ...] = ()
    failed_loads: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.failed_loads or self.preempted)
