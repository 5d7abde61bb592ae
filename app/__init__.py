"""mpcache server: control plane (FastAPI) over the shared-memory data plane.

Importing this package does nothing: the app is built by ``app.main.create_app``
and its runtime state by the app's lifespan.
"""

from contract import __version__

__all__ = ["__version__"]
