"""What several commands share at the edge: configuration files and security flags."""

from __future__ import annotations

import json
from pathlib import Path

from diloco.config import ConfigError, from_dict


def load_config_file(path: str, cls: type):
    """Read configuration ``cls`` from JSON file ``path``; ``ConfigError`` names what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config {path}: not JSON ({exc})") from None
    return from_dict(cls, data)
