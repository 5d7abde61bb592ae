"""Page-table population of mapped memory (``dataplane.prefault``).

The server's first write through a fresh mapping faults page by page; populated
mappings take none, and populating never changes what the pages hold.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
from collections.abc import Iterator

import pytest
import torch

from contract.shm_naming import segment_name
from dataplane.descriptors import MemfdMapping
from dataplane.fdgate import SealedMemory, map_sealed
from dataplane.pool import Pool
from dataplane.prefault import populate
from tests.dataplane.support import kernel_populates, sealed_memfd
from tests.support import wait_until

SIZE = 4 << 20
PAGES = SIZE // mmap.PAGESIZE


pytestmark = pytest.mark.skipif(
    not kernel_populates(), reason="this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)"
)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _faults_of_a_write(base: torch.Tensor) -> int:
    before = _minor_faults()
    base.fill_(7)
    return _minor_faults() - before


@pytest.fixture
def memories() -> Iterator[list[SealedMemory]]:
    """Two sealed memfds of ``SIZE`` mapped by the server; the first holds 0..255."""
    fds = [sealed_memfd(SIZE) for _ in range(2)]
    with mmap.mmap(fds[0], SIZE) as worker:
        worker[:256] = bytes(range(256))
    mapped = [map_sealed(fd) for fd in fds]
    for fd in fds:
        os.close(fd)
    yield mapped
    for memory in mapped:
        memory.close()


def test_a_populated_mapping_takes_no_faults_and_keeps_its_bytes(
    memories: list[SealedMemory],
) -> None:
    populated, fresh = (torch.frombuffer(m.buffer, dtype=torch.uint8) for m in memories)
    assert populate(populated.data_ptr(), SIZE)
    assert bytes(populated[:256].tolist()) == bytes(range(256))
    assert _faults_of_a_write(fresh) >= PAGES // 2  # the control: a fresh mapping faults
    assert _faults_of_a_write(populated) < PAGES // 16


def test_a_stopped_populate_leaves_the_pages_to_fault(memories: list[SealedMemory]) -> None:
    base = torch.frombuffer(memories[0].buffer, dtype=torch.uint8)
    stop = threading.Event()
    stop.set()
    assert populate(base.data_ptr(), SIZE, stop) is False
    assert _faults_of_a_write(base) >= PAGES // 2


def test_a_registration_mapping_populates_in_the_background_until_closed(
    memories: list[SealedMemory],
) -> None:
    mapping = MemfdMapping(1, {"a": memories[0]})
    base = mapping.bases["a"]
    mapping.start_prefault()
    wait_until(lambda: not mapping.prefault.running, what="the prefault thread's end")
    assert _faults_of_a_write(base) < PAGES // 16
    mapping.close()
    assert memories[0].closed and not mapping.bases


def test_the_pool_populates_its_pages_in_the_background() -> None:
    pool = Pool.create(segment_name("pool"), SIZE, 64 << 10)
    try:
        base = torch.frombuffer(pool.segment.buffer, dtype=torch.uint8)
        pool.start_prefault()
        wait_until(lambda: not pool.prefault.running, what="the pool's prefault thread's end")
        assert _faults_of_a_write(base) < PAGES // 16
        del base
    finally:
        pool.close()
    assert not pool.prefault.running and pool.segment.closed
