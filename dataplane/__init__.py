"""Data plane: the shared-memory cache pool, registered KV caches, copy kernels.

Pure maths is kept apart from I/O:

- ``layout``       chunk layout of a registration (regions, slots, signature); pure
- ``segments``     the server's POSIX shm segments: ownership, pre-fault, stale sweep
- ``pool``         the L1 cache: pages in one owned segment, LRU, pins, leases
- ``fdgate``       the registration socket: sealed memfds in, one-time tickets out
- ``descriptors``  validate tensor descriptors, then build zero-copy views
- ``cuda_ipc``     GPU tensors by CUDA IPC (Note [mpcache CUDA IPC invariants])
- ``registry``     registrations keyed by (instance_id, rank)
- ``plans``        how each registered tensor is seen for copying (built at registration)
- ``transfer``     the gather/scatter copies of a chunk and the lanes that run them
- ``blockcopy``, ``streaming``, ``libc``  the C kernel, glibc's streaming stores, libc

It imports only ``contract`` (names, schemas, errors); the cache operations that
use it live above it, in ``app.service``.

Importing this package does nothing (no threads, segments or CUDA).
"""
