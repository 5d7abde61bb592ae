"""The scheduler's lookup area: shared memory its lookups' token ids go through.

A burst of new requests sends the server every prompt's ids (1 MiB for 64 prompts
of 4k tokens), and through HTTP that is much of the burst's time
(bench/scheduler_burst_bench.py runs a burst both ways). When the server is on this
host, the scheduler instead writes the ids into a memfd it registered with the
server once (``app.lookup_areas``) and sends only a mark per request
(``contract.frames.lookup_frame_marks``).

The memfd is sealed against shrinking and growing, passed over the server's
registration socket, and lives as long as that connection (``RegistrationChannel``):
a server restart forgets it, and the next lookup that names it is refused (404).
When to register, retry and give an area up is the lookup path's
(``connector.lookups``); only its lookup thread writes the area, one batch at a
time (a batch's marks are all sent before its reply comes, and the next batch
starts after it).
"""

from __future__ import annotations

import fcntl
import mmap
import os

from connector.client import ControlClient
from connector.errors import SegmentError
from connector.shm import SEALS, RegistrationChannel
from contract.fdpass import F_ADD_SEALS
from contract.schemas import LookupAreaRequest

__all__ = ["AREA_BYTES", "LookupArea"]

AREA_BYTES = 4 << 20
"""The area's size: 1M token ids, a burst of 256 new 4k-token requests (a larger
batch sends its ids in the body). Reserved up front (``posix_fallocate``), so a
write never faults for want of memory."""


class LookupArea:
    """A sealed memfd mapped for writing, and its registration with one server."""

    def __init__(self, nbytes: int = AREA_BYTES) -> None:
        self.nbytes = nbytes
        try:
            fd = os.memfd_create("mpcache-lookup-area", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise SegmentError(f"lookup area: memfd_create failed: {exc}") from exc
        try:
            os.posix_fallocate(fd, 0, nbytes)
            fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise SegmentError(f"lookup area of {nbytes} bytes: {exc}") from exc
        self.fd = fd
        self.area_id: str | None = None
        self._channel: RegistrationChannel | None = None

    def register(self, client: ControlClient) -> str:
        """Register with the server behind ``client`` (once): the area's id there.
        ``SegmentError`` or ``ServerError`` when it cannot be."""
        if self._channel is not None:
            raise RuntimeError("a lookup area is registered once")
        self._channel = RegistrationChannel(client.timeout_s)
        info = client.registration_info()
        (ticket,) = self._channel.handshake(info.socket_path, [self.fd])
        reply = client.register_lookup_area(LookupAreaRequest(ticket=ticket))
        self.area_id = reply.area_id
        return reply.area_id

    def write(self, offset: int, data: bytes) -> None:
        self._map[offset : offset + len(data)] = data

    def close(self) -> None:
        """Close the socket connection (the server drops the area with it) and the
        memory. Idempotent."""
        self.area_id = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.fd >= 0:
            self._map.close()
            os.close(self.fd)
            self.fd = -1
