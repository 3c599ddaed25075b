"""Run configuration: keyword-only dataclasses, the one place each setting and default lives.

``diloco.runtime.schema`` turns them into flags and files; the component dataclasses live with
their components (``SyncerConfig`` in ``diloco.syncer.config``, ...) and the ones every process
of a run shares live here (``diloco.config.common``).
"""

from diloco.config.common import ClientSecurityConfig, RecipeConfig, ServerSecurityConfig
from diloco.runtime.schema import (
    ConfigError,
    add_options,
    field_docs,
    flat_values,
    from_dict,
    from_namespace,
    option,
    options,
    to_dict,
)
from diloco.wire.protocol import ProtocolConfig

__all__ = [
    "ClientSecurityConfig",
    "ConfigError",
    "ServerSecurityConfig",
    "ProtocolConfig",
    "RecipeConfig",
    "add_options",
    "field_docs",
    "from_dict",
    "flat_values",
    "from_namespace",
    "option",
    "options",
    "to_dict",
]
