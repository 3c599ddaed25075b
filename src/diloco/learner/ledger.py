"""A learner's ledger: the deltas of each fragment on their way to the global model.

An entry is created when the learner queues a fragment's undelivered progress and leaves
the ledger exactly once: when the version that merges it is applied (it was accepted and
admitted before that version), or when it was not accepted (refused, failed, withdrawn
before it was sent, lost with a restarted syncer): then its steps and tokens are
undelivered again and go out with the next delta. So every trained step is sent, and
merged, exactly once (docs/algorithm.md, "Learner side"). Not thread-safe: the training
thread owns it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class DeltaInFlight:
    """One delta of a fragment on its way to the syncer, from queued until merged back.

    ``delta`` is the fp32 delta as queued; once the syncer accepted it, the decoded wire value
    it actually received (the quantization residual stays in the learner's undelivered
    progress and goes out next time). ``admitted`` is the fragment's version at the syncer
    when it accepted the delta (the commit making ``admitted + 1`` merges it); ``None`` while
    the upload's fate is unknown.
    """

    job_id: int
    delta: torch.Tensor
    steps: int
    tokens: int
    local_step: int
    admitted: int | None = None
    upload_id: int = 0
    """Its id on the wire (kept across resends; the syncer's receipts use it)."""
    syncer_id: str = ""
    """The syncer instance that accepted it ("" before an answer)."""
    base_version: int = -1
    """The version of the fragment it was computed against (what it is sent with)."""
    excluded: bool = False
    """The syncer said it left this delta out of its round's merge (the direction check):
    when the version after ``admitted`` is applied it leaves the ledger as dropped, not
    merged (the arithmetic of applying is the same)."""
    found: bool = False
    """Put back at a restore's first join (``Settler.keep_in_flight``): an upload of an
    earlier life, in a round still open, that carried this entry's checkpointed progress;
    when it settles merged, left out or unknown, the journal says that progress was found
    delivered (not kept in a checkpoint: a later life counts it carried)."""


class Ledger:
    """Per fragment, the ``DeltaInFlight`` entries in the order they were queued."""

    def __init__(self) -> None:
        self._entries: dict[int, list[DeltaInFlight]] = {}
        self._next_id = 0

    def add(
        self,
        fragment: int,
        delta: torch.Tensor,
        steps: int,
        tokens: int,
        local_step: int,
        upload_id: int = 0,
    ) -> DeltaInFlight:
        """A new entry (not yet answered) with a fresh job id."""
        self._next_id += 1
        entry = DeltaInFlight(self._next_id, delta, steps, tokens, local_step, upload_id=upload_id)
        self._entries.setdefault(fragment, []).append(entry)
        return entry

    def of(self, fragment: int) -> list[DeltaInFlight]:
        return list(self._entries.get(fragment, ()))

    def find(self, fragment: int, job_id: int) -> DeltaInFlight | None:
        return next((e for e in self._entries.get(fragment, ()) if e.job_id == job_id), None)

    def find_upload(self, upload_id: int) -> DeltaInFlight | None:
        """The entry sent with ``upload_id`` (of any fragment), if it is still on the ledger."""
        return next((e for _, e in self._items() if upload_id and e.upload_id == upload_id), None)

    def remove(self, fragment: int, entry: DeltaInFlight) -> None:
        self._entries[fragment].remove(entry)

    def on_its_way(self, fragment: int) -> torch.Tensor | None:
        """The sum of the fragment's deltas on their way (``None`` if there are none)."""
        entries = self._entries.get(fragment)
        if not entries:
            return None
        total = entries[0].delta.clone()
        for e in entries[1:]:
            total.add_(e.delta)
        return total

    def take_merged(self, fragment: int, version: int) -> list[DeltaInFlight]:
        """Remove and return the accepted entries that ``version`` merged (admitted before)."""
        entries = self._entries.get(fragment, [])
        merged = [e for e in entries if e.admitted is not None and e.admitted < version]
        if merged:
            self._entries[fragment] = [e for e in entries if e not in merged]
        return merged

    def unanswered(self, fragment: int | None = None) -> list[DeltaInFlight]:
        """Entries without an answer yet, of one fragment or of all."""
        return [e for _, e in self._items(fragment) if e.admitted is None]

    def in_flight(self) -> dict[int, int]:
        """Entries per fragment, fragments without any left out."""
        return {p: len(es) for p, es in self._entries.items() if es}

    def _items(self, fragment: int | None = None) -> Iterator[tuple[int, DeltaInFlight]]:
        frags = self._entries if fragment is None else {fragment: self._entries.get(fragment, [])}
        for p, entries in frags.items():
            for e in entries:
                yield p, e

    def items(self) -> Iterator[tuple[int, DeltaInFlight]]:
        """Every ``(fragment, entry)``, fragments in ascending order."""
        for p in sorted(self._entries):
            for e in list(self._entries[p]):
                yield p, e

    # ------------------------------------------------------------- checkpoint
    def state(self) -> list[dict]:
        """The entries as plain data for a checkpoint (``admitted`` -2: no answer yet)."""
        return [
            {
                "fragment": p,
                "delta": e.delta.clone(),
                "steps": e.steps,
                "tokens": e.tokens,
                "local_step": e.local_step,
                "admitted": -2 if e.admitted is None else e.admitted,
                "upload_id": e.upload_id,
                "excluded": e.excluded,
                "syncer_id": e.syncer_id,
                "base_version": e.base_version,
            }
            for p, e in self.items()
        ]

    def load(self, items: list[dict], numels: list[int]) -> None:
        """Replace the entries with a checkpoint's (``ValueError`` if one does not fit)."""
        self._entries = {}
        for item in items:
            p = int(item["fragment"])
            if not 0 <= p < len(numels) or item["delta"].numel() != numels[p]:
                raise ValueError(f"learner state: ledger entry of fragment {p} does not fit")
            entry = self.add(
                p,
                item["delta"].clone(),
                int(item["steps"]),
                int(item["tokens"]),
                int(item["local_step"]),
                int(item.get("upload_id", 0)),
            )
            entry.excluded = bool(item.get("excluded", False))
            entry.syncer_id = str(item.get("syncer_id", ""))
            entry.base_version = int(item.get("base_version", -1))
            admitted = int(item["admitted"])
            entry.admitted = None if admitted < -1 else admitted
