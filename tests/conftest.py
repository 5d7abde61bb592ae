"""Suite-wide test setup.

Servers built by tests get a small cache pool so each app start stays cheap; this
also reaches server subprocesses, which inherit the environment.
"""

from __future__ import annotations

import os

os.environ.setdefault("MPCACHE_POOL_SIZE", "4MiB")
