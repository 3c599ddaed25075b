"""The exactly-once audit: from a syncer's event tape and its learners' upload journals, prove
that every trained step reached the global model at most once, and exactly once where the
learner lived to tell (a pure function, :func:`audit`).

What it reads:

* the **tape** (``diloco.syncer.store``): every ``round`` record names, per learner, the
  upload ids the commit merged (``uploads``) and left out (``excluded_uploads``); ``dropped``
  records name uploads a round left out without committing; a ``recovered`` record written
  by a restarted syncer carries the commit logs of versions its predecessor persisted but
  never taped (``commits``);
* each learner's **journal** (``diloco.learner.journal``): the life and steps of every
  upload id, written before the upload left;
* each learner's **final accounting** (``final.json`` of its last life, when it stopped
  cleanly): steps trained, unsent at exit, dropped on purpose;
* optionally the **versions on disk** at the end and the times the syncer was **down**.

What it asserts (each failure is one line in ``Audit.problems``):

1. no (fragment, version) is committed twice, and every version from 1 to the last is on
   some record (a commit the tape cannot account for is a problem);
2. the versions on disk are the tape's last commits;
3. no upload id is merged (or left out) twice, and each one is in its learner's journal with
   the same steps;
4. per learner life that stopped cleanly, per fragment: steps merged + left out (tape) +
   carried + unsent + dropped + unknown (its own accounting; an unknown delta the tape
   merged counts once, on the tape) = steps trained: **exactly once**; and
   every upload a learner took as merged (its journal's ``settled`` lines) was merged by a
   commit. ``carried``: a life resumed from a checkpoint (a requeued job) counts the steps of
   its earlier lives too; its journal's start line says how many of them its restored
   accounting holds as delivered, and the earlier lives' commits on the tape must hold
   exactly that many, plus at most the steps the life ``skipped`` (trained by a killed life
   after its checkpoint: delivered by it or lost with it, never trained again; they count
   as dropped) and the steps its checkpoint counted *unknown*, or that the last life sent
   again from its checkpoint under an earlier life's upload id and settled unknown (the
   tape may hold them); an earlier life's upload the checkpoint held in flight, which no
   commit merged and the last life settled without sending it, leaves ``carried`` (for
   the unknown window if settled unknown; returned, its steps went out again in a later
   upload); an upload only rolled-back commits merged whose life had it back
   (``returned``: its steps went out again) is not that life's delivery;
5. per life that was killed, per fragment: steps merged + left out ≤ the last step it
   journaled: **at most once** (what it had not delivered when it died is lost with it: the
   learner's crash, not the protocol's);
6. the longest time the syncer was serving without a commit is within ``stall_bound_s``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class Audit:
    problems: list[str] = field(default_factory=list)
    commits: int = 0
    uploads_merged: int = 0
    uploads_excluded: int = 0
    lives: int = 0
    lives_killed: int = 0
    steps_trained: int = 0
    """Steps trained by the lives that stopped cleanly (summed over learners)."""
    steps_lost_at_kills: int = 0
    """Steps of killed lives that never reached the syncer (summed over their fragments'
    last journaled steps minus what was merged): what the crashes cost."""
    steps_rolled_back: int = 0
    """Steps (per fragment, summed) merged only by commits a rollback undid: delivered by
    their learners, no longer in the global model (the operator's restore lost them)."""
    steps_unknown: int = 0
    """Steps of clean lives' deltas whose fate no syncer could tell them (their accounting's
    ``unknown`` column) and that no commit on the tape merged: 0 wherever the fate was
    knowable."""
    longest_stall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"ok": self.ok}


@dataclass
class _Commit:
    fragment: int
    version: int
    changed: bool
    merged: dict[str, list[list[int]]]
    excluded: dict[str, list[list[int]]]
    rolled_back: bool = False
    """A later ``rollback`` record took the state directory back below this version: the
    commit is no longer in the global model (its version number may be committed again)."""


def commits_of(tape: Iterable[dict]) -> list[_Commit]:
    """Every commit log the tape holds: ``round`` and ``dropped`` records, and the persisted
    logs of ``recovered`` records (in tape order); those a later ``rollback`` record undid
    (``diloco.syncer.lineage``: a state directory restored from a backup, started again with
    ``--accept-rollback``) are marked ``rolled_back``."""
    found = []
    for r in tape:
        event = r.get("event")
        if event == "rollback":
            restored = {
                int(b["fragment"]): int(b["version"])
                for b in [*r.get("fragments", []), *r.get("receipts", [])]
            }
            for c in found:
                if c.fragment in restored and c.version > restored[c.fragment]:
                    c.rolled_back = True
        elif event == "round":
            found.append(
                _Commit(
                    r["fragment"],
                    r["version"],
                    True,
                    r.get("uploads", {}),
                    r.get("excluded_uploads", {}),
                )
            )
        elif event == "dropped" and "excluded_uploads" in r:
            found.append(_Commit(r["fragment"], r["version"], False, {}, r["excluded_uploads"]))
        elif event == "recovered":
            for log in r.get("commits", []):
                changed = log["version"] == log["admitted"] + 1
                found.append(
                    _Commit(
                        log["fragment"], log["version"], changed, log["merged"], log["excluded"]
                    )
                )
    return found


def audit(
    tape: list[dict],
    journals: Mapping[str, list[dict]],
    finals: Mapping[str, dict | None],
    *,
    disk_versions: Mapping[int, int] | None = None,
    down: Iterable[tuple[float, float]] = (),
    window: tuple[float, float] | None = None,
    stall_bound_s: float | None = None,
    stopped_cleanly: bool = False,
) -> Audit:
    """Check the run (see the module docstring). ``finals[learner]``: the ``final.json`` of
    its last life (None: it did not stop cleanly); ``window``: the time span in which commits
    are expected (for the stall check), ``down``: spans in which the syncer was not serving;
    ``stopped_cleanly``: every learner's last life stopped cleanly (its ``final.json`` is a
    problem when missing)."""
    result = Audit()
    commits = commits_of(tape)
    _check_versions(commits, disk_versions, result)
    merged, excluded, undone = _uploads(commits, result)
    for learner, journal in sorted(journals.items()):
        uploads = (merged, excluded, undone.get(learner, set()))
        _check_learner(learner, journal, finals.get(learner), uploads, result)
        if stopped_cleanly and finals.get(learner) is None:
            result.problems.append(f"{learner}: its last life did not stop cleanly (no final.json)")
    if window is not None and stall_bound_s is not None:
        times = sorted(r["t"] for r in tape if r.get("event") == "round" and "t" in r)
        result.longest_stall_s = round(longest_stall(times, window, list(down)), 3)
        if result.longest_stall_s > stall_bound_s:
            result.problems.append(
                f"no commit for {result.longest_stall_s:.1f} s while the syncer was serving "
                f"(bound {stall_bound_s:g} s)"
            )
    return result


def _check_versions(commits, disk_versions, result: Audit) -> None:
    seen: dict[int, set[int]] = defaultdict(set)
    for c in commits:
        if not c.changed or c.rolled_back:
            continue
        result.commits += 1
        if c.version in seen[c.fragment]:
            result.problems.append(f"fragment {c.fragment} version {c.version} committed twice")
        seen[c.fragment].add(c.version)
    for p, versions in sorted(seen.items()):
        missing = sorted(set(range(1, max(versions) + 1)) - versions)
        if missing:
            result.problems.append(f"fragment {p}: versions {missing[:5]} are on no record")
    for p, v in sorted((disk_versions or {}).items()):
        taped = max(seen.get(p, {0}))
        if v != taped:
            result.problems.append(f"fragment {p} is at version {v} on disk, {taped} on the tape")


def _uploads(commits, result: Audit):
    """``(merged, excluded, undone)``: per learner, upload id -> (fragment, steps), and the
    ids that only rolled-back commits hold. An upload merged by a rolled-back commit and
    again after the rollback (its learner sent it again: the restored syncer never held it)
    counts once, by the commit that stands; one merged only by rolled-back commits counts
    too (its learner delivered it; the rollback lost it: ``steps_rolled_back``), unless its
    learner had it back (``_check_learner``)."""
    merged: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
    excluded: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
    standing = [c for c in commits if not c.rolled_back]
    undone = [c for c in commits if c.rolled_back]
    only_undone: dict[str, set[int]] = defaultdict(set)
    for c in standing:
        for kind, parts_by_learner, into in (
            ("merged", c.merged, merged),
            ("left out", c.excluded, excluded),
        ):
            for learner, parts in parts_by_learner.items():
                for upload_id, steps, _tokens in parts:
                    if not upload_id:
                        continue
                    if upload_id in merged[learner] or upload_id in excluded[learner]:
                        result.problems.append(
                            f"{learner}'s upload {upload_id} {kind} again in fragment "
                            f"{c.fragment} version {c.version}"
                        )
                        continue
                    into[learner][upload_id] = (c.fragment, steps)
    for c in undone:
        for parts_by_learner, into in ((c.merged, merged), (c.excluded, excluded)):
            for learner, parts in parts_by_learner.items():
                for upload_id, steps, _tokens in parts:
                    known = upload_id in merged[learner] or upload_id in excluded[learner]
                    if upload_id and not known:
                        into[learner][upload_id] = (c.fragment, steps)
                        only_undone[learner].add(upload_id)
                        result.steps_rolled_back += steps if into is merged else 0
    result.uploads_merged = sum(len(m) for m in merged.values())
    result.uploads_excluded = sum(len(m) for m in excluded.values())
    return merged, excluded, only_undone


def _check_learner(learner, journal, final, tape, result: Audit) -> None:
    merged, excluded, undone = tape
    lives: dict[str, dict] = {}
    order: list[str] = []
    for line in journal:
        life = line.get("life")
        if life is None:
            continue
        if life not in lives:
            lives[life] = {"uploads": {}, "last_step": defaultdict(int)}
            order.append(life)
        if "carried" in line:
            lives[life]["start"] = line.get("start", 0)
            lives[life]["carried"] = list(line["carried"])  # (copies: added to below)
            lives[life]["carried_unknown"] = list(line.get("unknown") or [0] * len(line["carried"]))
        if "skipped" in line:
            lives[life]["skipped"] = lives[life].get("skipped", 0) + line["skipped"]
        if "found_delivered" in line and "carried" in lives[life]:
            column = "carried_unknown" if line.get("unknown") else "carried"
            lives[life][column][line["found_delivered"]] += line["steps"]
        if "u" in line:
            lives[life]["uploads"][line["u"]] = (line["p"], line["steps"])
            lives[life].setdefault("queued_at", {})[line["u"]] = line["step"]
            step = lives[life]["last_step"]
            step[line["p"]] = max(step[line["p"]], line["step"])
        if line.get("how") == "merged":
            lives[life].setdefault("took", {})[line["settled"]] = line.get("v")
        if line.get("how") == "unknown":
            lives[life].setdefault("unknown", set()).add(line["settled"])
        if line.get("how") == "returned":
            lives[life].setdefault("returned", set()).add(line["settled"])
    # an upload resent by a resumed life (same id, from its checkpoint) is that life's
    owner = {u: life for life, info in lives.items() for u in info["uploads"]}
    delivered: dict[str, dict[int, int]] = {life: defaultdict(int) for life in lives}
    for source in (merged.get(learner, {}), excluded.get(learner, {})):
        for upload_id, (p, steps) in source.items():
            life = owner.get(upload_id)
            if life is None:
                result.problems.append(f"{learner}: upload {upload_id} is in no journal")
                continue
            if lives[life]["uploads"][upload_id] != (p, steps):
                result.problems.append(
                    f"{learner}: upload {upload_id} has {(p, steps)} on the tape, "
                    f"{lives[life]['uploads'][upload_id]} in the journal"
                )
            if upload_id in undone and upload_id in lives[life].get("returned", ()):
                # merged only by commits a rollback undid, and its life had it back (the
                # restored syncer refused it): its steps went out again, in another upload
                result.steps_rolled_back -= steps if source is merged.get(learner) else 0
                continue
            delivered[life][p] += steps
    on_tape = set(merged.get(learner, {})) | set(excluded.get(learner, {}))
    for life in order:
        for upload_id, version in lives[life].get("took", {}).items():
            if upload_id not in on_tape:
                result.problems.append(
                    f"{learner}: took upload {upload_id} as merged by version {version}, "
                    "which no commit merged"
                )
    result.lives += len(order)
    last = order[-1] if order else None
    clean = final is not None and final.get("life") == last
    carried = lives[last].get("carried") if last is not None else None
    if carried is not None:  # resumed: its checkpoint says what the earlier lives delivered
        # and past it (every resumed life's skip): delivered by them or lost
        skipped = sum(lives[life].get("skipped", 0) for life in order)
        unknown = lives[last]["carried_unknown"]
        # the lives since the last one that started without local state: a checkpoint
        # carries what they delivered, not what a life before a fresh start did
        fresh = [i for i, life in enumerate(order[:-1]) if "carried" not in lives[life]]
        since_fresh = order[fresh[-1] if fresh else 0 : -1]
        # a delta of the checkpoint the last life sent again (an earlier life's upload id)
        # and settled unknown: not sent again, and maybe delivered by an earlier life (which
        # may have had it back and sent its steps in a later upload): like ``unknown``
        journaled_before = {u for life in since_fresh for u in lives[life]["uploads"]}
        for upload_id in lives[last].get("unknown", set()) & journaled_before - on_tape:
            if upload_id in lives[last]["uploads"]:
                p, steps = lives[last]["uploads"][upload_id]
                unknown[p] += steps
        # an earlier life's upload the checkpoint held in flight (queued by its step: in
        # ``carried``) that no commit merged and the last life settled without sending it:
        # unknown, its steps move to the unknown window; returned, they went out again
        for upload_id in journaled_before - set(lives[last]["uploads"]) - on_tape:
            if lives[owner[upload_id]]["queued_at"][upload_id] > lives[last]["start"]:
                continue  # (queued after the checkpoint: not in what it carried)
            unknown_fate = upload_id in lives[last].get("unknown", ())
            if unknown_fate or upload_id in lives[last].get("returned", ()):
                p, steps = lives[owner[upload_id]]["uploads"][upload_id]
                carried[p] -= steps
                unknown[p] += steps if unknown_fate else 0
        for p, steps in enumerate(carried):
            earlier = sum(delivered[life].get(p, 0) for life in since_fresh)
            if not steps <= earlier <= steps + unknown[p] + skipped:
                window = f"{steps}" if not skipped else f"{steps} (+ {skipped} skipped)"
                window += f" (+ {unknown[p]} unknown)" if unknown[p] else ""
                result.problems.append(
                    f"{learner}: fragment {p}: its earlier lives delivered {earlier} steps "
                    f"(tape), its checkpoint carried {window} into the last life"
                )
    for life in order:
        if life == last and clean:
            unknown_on_tape = defaultdict(int)  # unknown to the learner, merged all the same
            for upload_id in lives[life].get("unknown", set()) & on_tape:
                p, steps = lives[owner[upload_id]]["uploads"][upload_id]  # (maybe an earlier
                unknown_on_tape[p] += steps  # life's, settled unknown by this one)
            books = (delivered[life], carried, unknown_on_tape)
            _check_clean(learner, final, books, on_tape, result)
            continue
        result.lives_killed += 1
        for p, steps in delivered[life].items():
            bound = lives[life]["last_step"][p]
            if steps > bound:
                result.problems.append(
                    f"{learner} (a killed life): fragment {p} delivered {steps} steps of the "
                    f"{bound} it had trained when it last sent it"
                )
        for p, bound in lives[life]["last_step"].items():
            result.steps_lost_at_kills += max(0, bound - delivered[life].get(p, 0))
    if final is not None and not clean:
        result.problems.append(f"{learner}: final.json is not from its last life")


def _check_clean(learner, final, tape_books, on_tape, result: Audit) -> None:
    delivered, carried, unknown_on_tape = tape_books
    books = final.get("accounting")
    if books is None:
        result.problems.append(f"{learner}: final.json has no accounting")
        return
    trained = books["trained"]
    result.steps_trained += trained
    # sent without an answer: counted unsent by the learner, merged if the tape says so
    heard_of = defaultdict(int)
    for upload_id, p, steps in final.get("unanswered", []):
        if upload_id in on_tape:
            heard_of[p] += steps
    unknown_books = books.get("unknown") or [0] * len(books["unsent"])
    columns = zip(books["unsent"], books["dropped"], unknown_books, strict=True)
    for p, (unsent, dropped, unknown) in enumerate(columns):
        unsent -= heard_of.get(p, 0)
        unknown -= unknown_on_tape.get(p, 0)  # (the tape counts those)
        result.steps_unknown += unknown
        tape = delivered.get(p, 0)
        before = carried[p] if carried is not None else 0
        if tape + before + unsent + dropped + unknown != trained:
            result.problems.append(
                f"{learner}: fragment {p}: {tape} steps merged or left out (tape) + {before} "
                f"carried + {unsent} unsent + {dropped} dropped + {unknown} unknown "
                f"!= {trained} trained"
            )


def longest_stall(
    commits: list[float], window: tuple[float, float], down: list[tuple[float, float]]
) -> float:
    """The longest span inside ``window`` without a commit, not counting the time the syncer
    was down (``down`` spans). ``commits``: sorted commit times.

    >>> longest_stall([2.0, 3.0], (0.0, 10.0), [(4.0, 8.0)])
    3.0
    """
    marks = [window[0], *[t for t in commits if window[0] <= t <= window[1]], window[1]]
    longest = 0.0
    for a, b in zip(marks, marks[1:], strict=False):
        outage = sum(max(0.0, min(b, d1) - max(a, d0)) for d0, d1 in down)
        longest = max(longest, b - a - outage)
    return longest
