"""Every ``diloco COMMAND --flag`` that README.md and docs/*.md show exists in that command's
parser (built in-process from ``diloco.cli``): a renamed or removed flag cannot stay in the
docs (issue 49: ``--start-timeout`` cited, ``diloco plan --link`` alone exiting 2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diloco.cli import command_parsers

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
COMMAND = re.compile(r"\bdiloco(?:\.cli)? ([a-z][a-z-]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]+)")
SCRIPT = re.compile(r"\s[\w./-]+\.py\b")
"""A script ``diloco launch`` starts: the flags after it are the script's."""

OTHER_TOOLS = {"--nproc-per-node", "--max-restarts", "--standalone", "--logdir", "--upgrade"}
"""Flags of torchrun, tensorboard and pip, should a line show them after a diloco command
(the allowlist)."""
INTERNAL = {"dp-worker"}
"""Commands only ``diloco run`` starts (their flags are its configuration files')."""
UNDOCUMENTED = {"--help", "--config", "--output"}
"""Flags every command has, said once in docs/cli.md (``--output`` is shown as ``-o``)."""


def flag_mentions() -> list[tuple[str, str, str]]:
    """``(doc, command, flag)`` for every flag in a code span or block whose line (lines
    continued with a backslash are one; a span is one) names ``diloco COMMAND`` (or
    ``python -m diloco.cli COMMAND``) before it, and no script (``train.py``) between them."""
    found = []
    for doc in DOCS:
        for match in CODE.finditer(doc.read_text()):
            code = match.group(1) or match.group(2)
            for line in code.replace("\\\n", " ").splitlines():  # (continued lines: one)
                commands = list(COMMAND.finditer(line))
                for flag in FLAG.finditer(line):
                    before = [c for c in commands if c.end() <= flag.start()]
                    if before and not SCRIPT.search(line, before[-1].end(), flag.start()):
                        found.append((doc.name, before[-1].group(1), flag.group(1)))
    return found


def parser_flags() -> dict[str, set[str]]:
    flags = {}
    for name, parser in command_parsers().items():
        flags[name] = {
            s for action in parser._actions for s in action.option_strings if s.startswith("--")
        }
    return flags


def test_the_docs_mention_many_flags():
    assert len(flag_mentions()) > 100  # (the scan itself works)


def test_every_flag_the_docs_show_exists_in_its_commands_parser():
    flags = parser_flags()
    wrong = sorted(
        {
            f"{doc}: diloco {command} {flag}"
            for doc, command, flag in flag_mentions()
            if command in flags
            and flag not in flags[command]
            and flag not in OTHER_TOOLS
            and flag not in ("--help", "--version")
        }
    )
    assert not wrong, "flags the docs show that the command does not have:\n" + "\n".join(wrong)


def test_every_flag_of_a_users_command_is_in_some_doc():
    """The other way round: no flag a user can give is in no doc at all (``--no-x`` counts
    as ``--x``)."""
    text = " ".join(doc.read_text() for doc in DOCS)
    said = {m.group(1).replace("--no-", "--") for m in FLAG.finditer(text)} | set(
        FLAG.findall(text)
    )
    missing = sorted(
        f"diloco {command} {flag}"
        for command, flags in parser_flags().items()
        if command not in INTERNAL
        for flag in flags
        if flag not in said and flag.replace("--no-", "--") not in said and flag not in UNDOCUMENTED
    )
    assert not missing, "flags in no doc:\n" + "\n".join(missing)


@pytest.mark.parametrize("command", ["syncer", "learner", "run", "status", "plan", "export"])
def test_every_command_the_docs_show_exists(command):
    assert command in command_parsers()
