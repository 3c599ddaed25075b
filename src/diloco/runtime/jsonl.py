"""The one reader of the JSON-lines files a run leaves (the event tape, progress files,
``metrics.jsonl``)."""

from __future__ import annotations

import json
import os


def read_jsonl(path: str | os.PathLike, *, missing_ok: bool = True) -> list[dict]:
    """Every complete record of a JSON-lines file, in order.

    A line that is not a JSON object (a line cut short by a kill or a crash) is skipped. A
    missing or unreadable file gives ``[]`` when ``missing_ok``, else raises ``OSError``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        if missing_ok:
            return []
        raise
    return parse_lines(lines)


def parse_lines(lines) -> list[dict]:
    """The JSON objects among ``lines`` (text or bytes), in order; anything else is skipped."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
