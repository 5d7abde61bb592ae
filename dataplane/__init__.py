"""Data plane: the shared-memory cache pool, registered KV caches, copy kernels."""
