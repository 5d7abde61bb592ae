"""mpcache's wire contract: the one home of what the server and the connector share.

Both sides import this package; it imports neither of them, nor any web framework
(``make lint`` enforces it with import-linter; see docs/design.md s.1):

- ``schemas``     every HTTP request and reply body (pydantic; the OpenAPI source)
- ``endpoints``   every HTTP operation: method, path, models, problems (routes, clients)
- ``errors``      the domain error tree: problem types, titles and statuses
- ``tokens``      the compact token form (base64 of little-endian int32)
- ``chunking``    the chunk-size rule (smallest multiple of the alignment >= minimum)
- ``dtypes``      tensor dtype names a descriptor may use
- ``fdpass``      the registration socket's memfd handshake, seals and limits
- ``shm_naming``  the pool's segment names, stale judgement, free space
- ``cuda_ipc``    Note [mpcache CUDA IPC invariants] and the producer's descriptor
- ``kernels``     small C kernels, compiled once per source (block copies, token packing)

Importing it does nothing (no threads, files, sockets or CUDA).
"""

__version__ = "0.1.0"
"""The one place the version is written (pyproject reads it; server and connector report it)."""

DEFAULT_PORT = 8733
"""The server's default TCP port, which the connector's default URL points at. It
collides with none of vLLM (8000), LMCache (5555 ZMQ, 8080 HTTP), Triton (8000-8002),
Prometheus (9090), Grafana (3000), Redis (6379) or Ray (6379, 8265)."""

__all__ = ["DEFAULT_PORT", "__version__"]
