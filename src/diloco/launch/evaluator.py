"""The evaluator: an observer of the syncer that scores the global model on held-out text.

It joins as an *observer* (it never uploads and never counts towards quorum or liveness),
receives every merged fragment like a learner does, and on request writes the latest
fragments into its own copy of the model and measures the held-out loss.

It reads the lineage of the versions it holds (``diloco.syncer.lineage``) as a learner does
(``learner.settling.another_lineage``): a syncer that joins with another lineage, or behind
the versions held (a state directory rolled back), serves another history, so the values
held of its fragments are dropped and keyframes asked for; an old value is never evaluated
in place of the new history's, nor a new delta added onto it. ``evaluated_lineages`` says
which lineages the last evaluation's values belong to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from diloco.algorithm.fragments import balanced_fragments
from diloco.learner.listener import LinkListener
from diloco.learner.settling import another_lineage
from diloco.learner.shards import open_link


class Evaluator(LinkListener):
    """Keeps the latest global fragments from ``address`` and evaluates them with ``recipe``."""

    def __init__(
        self,
        recipe,
        address: str | Sequence[str],
        *,
        seed: int,
        num_fragments: int,
        link_options=None,
    ):
        """``address``: the syncer, or every shard of a sharded syncer (list or "a,b"): the
        evaluator reads the global model from all of them (one observer link per shard)."""
        self.recipe = recipe
        self.model = recipe.build_model(seed)
        self.scores: dict[str, float] = {}
        """The recipe's other held-out measures at the last :meth:`evaluate` (e.g. accuracy)."""
        self.named = dict(self.model.named_parameters())
        self.layout = balanced_fragments(self.model.named_parameters(), num_fragments)
        self._latest: dict[int, tuple[int, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._need_keyframe: set[int] = set()
        self.versions = [-1] * num_fragments
        self.lineages: dict[str, str] = {}
        """The lineage each syncer (shard) address serves, as its last join said."""
        self.evaluated_lineages: list[str] = []
        """The lineages of the values the last :meth:`evaluate` used (sorted)."""
        self._lineage_of: dict[int, str] = {}
        self.link = open_link(
            address,
            "evaluator",
            self.layout,
            self,
            observer=True,
            **(link_options or {}),
        )

    def on_rejoin(
        self,
        address,
        syncer_id,
        versions,
        fragments,
        committed=(),
        logged_from=(),
        lineage="",
        fates=None,
    ) -> None:
        """A syncer (shard) joined: of another lineage than the one held from it, or behind
        the versions held, its fragments' values held are dropped and keyframes asked for
        (called before the subscription that follows, which asks with ``have_versions``)."""
        held = self.have_versions()
        with self._lock:
            if another_lineage(self.lineages.get(address), lineage, held, versions, fragments):
                for p in fragments:
                    self._latest.pop(p, None)
                    self._need_keyframe.add(p)
                    self.versions[p] = -1
            if lineage:
                self.lineages[address] = lineage
                self._lineage_of.update(dict.fromkeys(fragments, lineage))

    def on_fragment(
        self, fragment: int, version: int, value: torch.Tensor, _contributors=(), base=-1
    ) -> None:
        """Keep the newest global value: a keyframe as it is, a delta on top of the value it
        starts from (exactly as the syncer adds it); a delta that does not fit is dropped and
        a keyframe asked for."""
        with self._lock:
            old = self._latest.get(fragment)
            if base < 0:
                self._need_keyframe.discard(fragment)
                if old is None or old[0] < version:
                    self._latest[fragment] = (version, value)
                return
            if old is not None and old[0] == base:
                self._latest[fragment] = (version, old[1] + value)
                return
            self._latest.pop(fragment, None)
            self._need_keyframe.add(fragment)  # resubscribe with -1: a keyframe comes
        self.link.reconnect()

    def have_versions(self) -> list[int]:
        with self._lock:
            return [
                -1 if p in self._need_keyframe else self._latest.get(p, (v,))[0]
                for p, v in enumerate(self.versions)
            ]

    def wait_for_versions(self, versions: list[int], timeout: float) -> bool:
        """Block (bounded) until every fragment has reached at least ``versions``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(h >= v for h, v in zip(self.have_versions(), versions, strict=True)):
                return True
            time.sleep(0.05)
        return False

    def evaluate(self) -> tuple[float, list[int]]:
        """Held-out loss of the newest global model received, and the versions it used (the
        recipe's other measures go to ``self.scores``)."""
        with self._lock:
            latest = dict(self._latest)
            self.evaluated_lineages = sorted({self._lineage_of.get(p, "") for p in latest} - {""})
        for p, (version, value) in latest.items():
            if version > self.versions[p]:
                self.layout.scatter(p, value, self.named)
                self.versions[p] = version
        self.scores = self.recipe.scores(self.model)
        return self.recipe.evaluate(self.model), list(self.versions)

    def close(self) -> None:
        self.link.close()
