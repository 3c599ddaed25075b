"""What several commands share at the edge: configured sub-commands and configuration files."""

from __future__ import annotations

import sys
from collections.abc import Callable

from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.common import LOG_LEVEL_ENV, LoggingConfig
from diloco.runtime.config_files import read_config_file
from diloco.wire.comms import COMMS_FIELDS


def load_config_file(path: str, cls: type):
    """Read configuration ``cls`` from JSON or TOML file ``path``
    (``diloco.runtime.config_files``); ``ConfigError`` names what is wrong."""
    return read_config_file(path, cls)


def config_from_args(cls: type, args, load: Callable[[str], object] | None = None):
    """Configuration ``cls`` from a configured command's parsed flags: ``--config FILE`` read
    by ``load`` (default :func:`load_config_file`) gives the values the flags given override.
    ``--comms`` given as a flag names H and the codecs anew: the file's values of those
    (written resolved) give way unless they are given as flags too."""
    base = (
        (load or (lambda path: load_config_file(path, cls)))(args.config) if args.config else None
    )
    unset = COMMS_FIELDS if hasattr(args, "comms") else ()
    return from_namespace(cls, args, base=base, unset=unset)


def configure_logging(level: str | None) -> None:
    """Print the library's log records at ``level`` and above on stderr (None: the level
    this process inherited from the command that started it, else ``LoggingConfig``'s
    default), and hand the level down to the processes this one starts."""
    import logging
    import os

    level = level or os.environ.get(LOG_LEVEL_ENV) or LoggingConfig.log_level
    os.environ[LOG_LEVEL_ENV] = level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    library = logging.getLogger("diloco")
    library.handlers[:] = [handler]
    library.setLevel(level.upper())
    library.propagate = False


def configured_command(
    subparsers,
    name: str,
    cls: type,
    runner: Callable[[], Callable],
    *,
    help: str,  # noqa: A002 - argparse's own name
    description: str | None = None,
    load: Callable[[str], object] | None = None,
) -> None:
    """A sub-command whose settings are the configuration dataclass ``cls``: every option a
    flag, and ``--config FILE`` for a JSON file that the flags given beside it override.

    ``runner()`` returns the function that runs the command with the configuration (imported
    when the command runs, so ``diloco --help`` stays light); ``load`` reads the file
    (default :func:`load_config_file`). A bad file or flag value exits 2 with a message.
    """
    p = subparsers.add_parser(name, help=help, description=description or help)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="read the settings from this JSON or .toml file (flags override)",
    )
    add_options(p, cls, sparse=True)
    add_options(p, LoggingConfig, sparse=True)

    def main(args) -> int:
        configure_logging(getattr(args, "log_level", None))
        try:
            config = config_from_args(cls, args, load)
        except (ConfigError, OSError, ValueError) as exc:
            print(f"diloco {name}: {exc}", file=sys.stderr)
            return 2
        return runner()(config)

    p.set_defaults(func=main)
