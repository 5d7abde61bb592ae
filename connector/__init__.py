"""mpcache's vLLM connector.

``from connector import MPCacheConnector`` gives the class vLLM loads
(``"kv_connector_module_path": "connector"``). Importing this package has no side
effects and does not import vLLM: the connector class is resolved lazily on first
access, so the pure parts (alignment maths, config parsing) work without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connector.alignment import (
    GroupLayout,
    KVLayout,
    check_chunk_size,
    effective_token_span,
    layout_from_groups,
    required_alignment,
    resolve_chunk_size,
)
from connector.config import ConnectorConfig, parse_extra_config
from connector.errors import ConnectorError

if TYPE_CHECKING:
    from connector.mp_connector import MPCacheConnector, MPCacheConnectorMetadata

__all__ = [
    "ConnectorConfig",
    "ConnectorError",
    "GroupLayout",
    "KVLayout",
    "MPCacheConnector",
    "MPCacheConnectorMetadata",
    "check_chunk_size",
    "effective_token_span",
    "layout_from_groups",
    "parse_extra_config",
    "required_alignment",
    "resolve_chunk_size",
]

_LAZY = {"MPCacheConnector", "MPCacheConnectorMetadata"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from connector import mp_connector

        return getattr(mp_connector, name)
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
