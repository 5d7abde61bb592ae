"""Suite-wide test setup.

Servers built by tests get a small cache pool and a fixed copy thread count so each
app start stays cheap; this also reaches server subprocesses, which inherit the
environment.
"""

from __future__ import annotations

import os

os.environ.setdefault("MPCACHE_POOL_SIZE", "4MiB")
# Two copy lanes: every copy test runs the parallel path, and no app start spends
# time measuring the copy thread count.
os.environ.setdefault("MPCACHE_COPY_THREADS", "2")
