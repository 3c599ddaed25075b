"""The ``diloco`` command line: one sub-command per job, the only room that parses flags.

Each sub-command lives in its own module of this package and registers itself through a
``register(subparsers)`` function, so this file only wires them together. The flags of the
configurable commands are generated from their configuration dataclasses
(``diloco.config``); nothing below this package imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (sub-command, module that provides ``register(subparsers)``)
_COMMANDS: list[tuple[str, str]] = [
    ("selfcheck", "diloco.cli.selfcheck"),
    ("syncer", "diloco.cli.syncer"),
    ("learner", "diloco.cli.learner"),
    ("run", "diloco.cli.run"),
    ("launch", "diloco.cli.launch"),
    ("dp-worker", "diloco.cli.dp_worker"),
    ("bench", "diloco.cli.bench"),
    ("simulate", "diloco.cli.simulate"),
    ("plan", "diloco.cli.plan"),
    ("learner-token", "diloco.cli.learner_token"),
    ("export", "diloco.cli.export"),
    ("status", "diloco.cli.status"),
    ("report", "diloco.cli.report"),
]


class ShowDefaults(argparse.HelpFormatter):
    """Help that ends every flag's text with its default, unless the text names it already
    or there is none to name (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default in ("", []):
            return text
        if default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser that reports a bad argument in one line, with where to look (the
    usage block argparse prints by default buries the message under dozens of flags), and
    shows every flag's default in ``--help`` (:class:`ShowDefaults`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", ShowDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="diloco",
        description="Decoupled DiLoCo: resilient, asynchronous, low-communication training.",
    )
    parser.add_argument("--version", action="version", version=f"diloco {_version()}")
    _add_commands(parser)
    return parser


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every sub-command's parser, by its name (what ``diloco NAME --help`` shows)."""
    return dict(_add_commands(OneLineErrors(prog="diloco")).choices)


def _add_commands(parser: argparse.ArgumentParser):
    """Register every sub-command on ``parser``; returns argparse's sub-parsers action."""
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module in _COMMANDS:
        importlib.import_module(module).register(subparsers)
    return subparsers


def _version() -> str:
    from diloco import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
