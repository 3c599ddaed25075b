"""Keyword arguments the public API renamed or moved: a call that still uses one fails with
one ``TypeError`` line that names the new spelling (not a cryptic error from deeper down).

Every rename is recorded in docs/upgrading.md; ``tests/test_public_api.py`` pins the API.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

Hint = Callable[[object], str]
"""The new spelling of a renamed argument, given the value the caller passed."""


def refuse_renamed(owner: str, given: Mapping[str, object], renamed: Mapping[str, Hint]) -> None:
    """Raise ``TypeError`` if ``given`` (a call's keyword arguments) holds a name of
    ``renamed``: ``"OWNER(NAME=VALUE): HINT"``, the first such name in ``renamed``'s order.

    >>> refuse_renamed("f", {"fragments": 8}, {"fragments": lambda v: f"use num_fragments={v}"})
    Traceback (most recent call last):
    TypeError: f(fragments=8): use num_fragments=8
    """
    for name, hint in renamed.items():
        if name in given:
            value = given[name]
            raise TypeError(f"{owner}({name}={value!r}): {hint(value)}")


def renamed_keywords(**renamed: Hint):
    """A class decorator: the class's constructor refuses the ``renamed`` keyword arguments
    with ``refuse_renamed`` before it runs (its signature is left as it is)."""

    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            refuse_renamed(cls.__name__, kwargs, renamed)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return decorate


def h_is_the_syncers(value: object) -> str:
    """The hint for a learner's ``sync_every``."""
    return (
        "H is the syncer's (diloco syncer --sync-every, "
        f"SyncerConfig(protocol=ProtocolConfig(sync_every={value!r}))); a learner takes it "
        "from the syncer when it joins"
    )


def moved_to_protocol(field: str) -> Hint:
    """The hint for a syncer's setting of P or H, now ``ProtocolConfig``'s ``field``."""
    return lambda value: f"now SyncerConfig(protocol=ProtocolConfig({field}={value!r}))"


def fragment_ids_not_p(value: object) -> str:
    """The hint for a syncer's ``fragments`` given as a number (it was P)."""
    return (
        "fragments= is now the shard's fragment ids; P is "
        f"SyncerConfig(protocol=ProtocolConfig(num_fragments={value!r}))"
    )


def p_is_num_fragments(value: object) -> str:
    """The hint for a learner's or a protocol's ``fragments`` (P)."""
    return f"P is now num_fragments={value!r}"
