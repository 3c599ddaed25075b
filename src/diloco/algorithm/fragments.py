"""Balanced tensor fragmentation and the per-fragment sync schedule (docs/algorithm.md,
"Fragments and schedule").

A model's named parameters are cut into ``P`` disjoint fragments of nearly equal byte size.
Tensors are placed by greedy bin-packing: largest tensor first, into the currently lightest
fragment (ties: lowest fragment index). A tensor that does not fit in that fragment's remaining
room up to the fair share (total bytes / P, rounded up) is cut by rows: the rows that fit stay
there and the rest goes on to the next lightest fragment. Every fragment then holds at most the
fair share plus one row. Whole-tensor packing of a small model
is badly unbalanced (benchmarks/RESULTS.md, "What the protocol's bounds rest on"); splitting
by rows fixes that.

The layout is a pure function of ``(names, shapes, dtypes, P)``: every learner and the syncer
compute the same one, and its :attr:`FragmentLayout.hash` is exchanged at join.

A fragment travels as one flat float32 vector: the concatenation of its pieces (each a
contiguous row range of one tensor, flattened), in model order. :meth:`FragmentLayout.gather`
and :meth:`FragmentLayout.scatter` convert between that vector and the model's tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "TensorPiece",
    "Fragment",
    "FragmentLayout",
    "LayoutMismatch",
    "balanced_fragments",
    "fragment_offset",
    "due_fragments",
]


class LayoutMismatch(ValueError):
    """Two models (or a model and a layout) do not have the same named tensors."""


@dataclass(frozen=True)
class TensorPiece:
    """Rows ``[row_start, row_stop)`` of tensor ``name``, at ``offset`` in its fragment's vector."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    row_start: int
    row_stop: int
    offset: int
    numel: int
    nbytes: int


@dataclass(frozen=True)
class Fragment:
    """One fragment: its pieces in model order and its total size."""

    index: int
    pieces: tuple[TensorPiece, ...]
    numel: int
    nbytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def _row_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:]) if shape else 1


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


class FragmentLayout:
    """The partition of a model's tensors into fragments, plus its stable hash.

    ``tensors`` lists ``(name, shape, dtype)`` of every parameter in model order; ``fragments``
    are indexed ``0..P-1``.
    """

    def __init__(self, fragments: list[Fragment], tensors: list[tuple[str, tuple[int, ...], str]]):
        self.fragments = list(fragments)
        self.tensors = [(n, tuple(s), d) for n, s, d in tensors]
        self.hash = self._compute_hash()

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    def _compute_hash(self) -> str:
        doc = {
            "tensors": [[n, list(s), d] for n, s, d in self.tensors],
            "fragments": [
                [[pc.name, pc.row_start, pc.row_stop] for pc in f.pieces] for f in self.fragments
            ],
        }
        blob = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # -- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-able description (tensors and row ranges); :meth:`from_dict` inverts it."""
        return {
            "hash": self.hash,
            "tensors": [[n, list(s), d] for n, s, d in self.tensors],
            "fragments": [
                [[pc.name, pc.row_start, pc.row_stop] for pc in f.pieces] for f in self.fragments
            ],
        }

    @classmethod
    def from_dict(cls, doc: Mapping) -> FragmentLayout:
        tensors = [(n, tuple(s), d) for n, s, d in doc["tensors"]]
        by_name = {n: (s, d) for n, s, d in tensors}
        fragments = []
        for index, pieces in enumerate(doc["fragments"]):
            fragments.append(_build_fragment(index, [(n, a, b) for n, a, b in pieces], by_name))
        layout = cls(fragments, tensors)
        if "hash" in doc and doc["hash"] != layout.hash:
            raise LayoutMismatch(f"layout hash {doc['hash']!r} does not match its content")
        return layout

    # -- compatibility -------------------------------------------------------------------
    def check_compatible(self, tensors: Iterable[tuple[str, Iterable[int], str]]) -> None:
        """Raise :class:`LayoutMismatch` naming the first tensor that differs from this layout."""
        theirs = [(n, tuple(s), d) for n, s, d in tensors]
        for i, mine in enumerate(self.tensors):
            if i >= len(theirs):
                raise LayoutMismatch(f"tensor {mine[0]!r} is missing")
            other = theirs[i]
            if other[0] != mine[0]:
                raise LayoutMismatch(f"tensor {i} is {other[0]!r}, expected {mine[0]!r}")
            if other[1] != mine[1]:
                raise LayoutMismatch(
                    f"tensor {mine[0]!r} has shape {list(other[1])}, expected {list(mine[1])}"
                )
            if other[2] != mine[2]:
                raise LayoutMismatch(f"tensor {mine[0]!r} has dtype {other[2]}, expected {mine[2]}")
        if len(theirs) > len(self.tensors):
            raise LayoutMismatch(f"unexpected extra tensor {theirs[len(self.tensors)][0]!r}")

    # -- moving values -------------------------------------------------------------------
    def gather(self, p: int, named: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Fragment ``p`` of ``named`` as a new flat float32 vector (detached, on CPU)."""
        frag = self.fragments[p]
        parts = [
            _row_view(named[pc.name], pc.shape)[pc.row_start : pc.row_stop]
            .detach()
            .reshape(-1)
            .to(device="cpu", dtype=torch.float32)
            for pc in frag.pieces
        ]
        return torch.cat(parts) if parts else torch.zeros(0)

    def scatter(self, p: int, flat: torch.Tensor, named: Mapping[str, torch.Tensor]) -> None:
        """Write the flat vector of fragment ``p`` into the tensors of ``named`` (in place).
        Host values go to a CUDA device through pinned memory, without a host sync."""
        with torch.no_grad():
            for target, part in self.pieces_of(p, self._staged(p, flat, named), named):
                target.copy_(part, non_blocking=True)

    def add_(self, p: int, flat: torch.Tensor, named: Mapping[str, torch.Tensor]) -> None:
        """Add the flat vector of fragment ``p`` to the tensors of ``named`` (in place: no
        gathered copy of the fragment is made; no host sync on a CUDA device)."""
        with torch.no_grad():
            for target, part in self.pieces_of(p, self._staged(p, flat, named), named):
                target.add_(part.to(target.device, non_blocking=True))

    def pieces_of(self, p: int, flat: torch.Tensor, named: Mapping[str, torch.Tensor]):
        """``(view of a tensor of named, the matching slice of flat)`` for each piece of
        fragment ``p``; ``ValueError`` if ``flat`` has the wrong length."""
        frag = self.fragments[p]
        if flat.numel() != frag.numel:
            raise ValueError(f"fragment {p} has {frag.numel} values, got {flat.numel()}")
        pairs = []
        for pc in frag.pieces:
            target = _row_view(named[pc.name], pc.shape)[pc.row_start : pc.row_stop]
            pairs.append((target, flat[pc.offset : pc.offset + pc.numel].reshape(target.shape)))
        return pairs

    def _staged(self, p: int, flat: torch.Tensor, named: Mapping[str, torch.Tensor]):
        """``flat`` in pinned host memory when fragment ``p``'s tensors are on a CUDA device
        (so the copy does not wait for the device; torch keeps the pinned block until the copy
        is done), else as is."""
        if flat.device.type == "cpu" and any(
            named[pc.name].is_cuda for pc in self.fragments[p].pieces
        ):
            return flat.pin_memory()
        return flat

    def __repr__(self) -> str:
        sizes = [f.nbytes for f in self.fragments]
        return (
            f"FragmentLayout(P={self.num_fragments}, tensors={len(self.tensors)}, "
            f"bytes={sum(sizes)}, max/mean={max(sizes) * len(sizes) / max(sum(sizes), 1):.3f}, "
            f"hash={self.hash})"
        )


def _row_view(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return t.reshape(_rows(shape), _row_numel(shape))


def _build_fragment(index: int, ranges: list[tuple[str, int, int]], by_name) -> Fragment:
    order = {n: i for i, n in enumerate(by_name)}
    pieces = []
    offset = 0
    for name, a, b in sorted(ranges, key=lambda r: (order[r[0]], r[1])):
        shape, dtype = by_name[name]
        if not 0 <= a < b <= _rows(shape):
            raise LayoutMismatch(f"rows [{a}, {b}) out of range for tensor {name!r} {list(shape)}")
        numel = (b - a) * _row_numel(shape)
        pieces.append(
            TensorPiece(name, shape, dtype, a, b, offset, numel, numel * _itemsize(dtype))
        )
        offset += numel
    return Fragment(index, tuple(pieces), offset, sum(pc.nbytes for pc in pieces))


def balanced_fragments(
    named_params: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    num_fragments: int,
    *,
    split_large: bool = True,
) -> FragmentLayout:
    """Partition named parameters into ``num_fragments`` fragments of near-equal bytes.

    Largest tensor first into the lightest fragment; with ``split_large`` (default) a tensor
    that overflows the fair share is cut by rows and continues in the next lightest fragment. Raises ``ValueError`` if a
    fragment would be empty (more fragments than the model has rows to share).
    """
    if isinstance(named_params, Mapping):
        named_params = named_params.items()
    tensors = [(n, tuple(t.shape), _dtype_name(t.dtype)) for n, t in named_params]
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if not tensors:
        raise ValueError("the model has no parameters")
    names = [n for n, _, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    by_name = {n: (s, d) for n, s, d in tensors}
    sizes = {n: math.prod(s) * _itemsize(d) for n, s, d in tensors}
    capacity = math.ceil(sum(sizes.values()) / num_fragments)

    order = {n: i for i, n in enumerate(names)}
    loads = [0] * num_fragments
    assigned: list[list[tuple[str, int, int]]] = [[] for _ in range(num_fragments)]
    for n in sorted(names, key=lambda n: (-sizes[n], order[n])):
        rows = _rows(by_name[n][0])
        row_bytes = sizes[n] // rows
        start = 0
        while start < rows:
            p = min(range(num_fragments), key=lambda i: (loads[i], i))
            take = rows - start
            if split_large and row_bytes and take * row_bytes > capacity - loads[p]:
                take = max(1, (capacity - loads[p]) // row_bytes)
            assigned[p].append((n, start, start + take))
            loads[p] += take * row_bytes
            start += take
    empty = [p for p, rs in enumerate(assigned) if not rs]
    if empty:
        raise ValueError(
            f"cannot fill {num_fragments} fragments: fragment {empty[0]} would be empty; "
            "use fewer fragments"
        )
    return FragmentLayout(
        [_build_fragment(p, rs, by_name) for p, rs in enumerate(assigned)], tensors
    )


def fragment_offset(p: int, sync_every: int, num_fragments: int) -> int:
    """The step offset of fragment ``p``: ``floor(p * H / P)``."""
    return (p * sync_every) // num_fragments


def due_fragments(step: int, sync_every: int, num_fragments: int) -> list[int]:
    """Fragments due after local step ``step`` (counted from 1): ``(step - offset_p) % H == 0``."""
    if sync_every < 1 or num_fragments < 1:
        raise ValueError("sync_every and num_fragments must be >= 1")
    return [
        p
        for p in range(num_fragments)
        if (step - fragment_offset(p, sync_every, num_fragments)) % sync_every == 0
    ]


def fragment_digest(values: torch.Tensor) -> str:
    """Short SHA-256 of a fragment's float32 values. The syncer's tape records it for every
    commit (and a restarted syncer's ``start`` record shows the digests it restored, so an
    audit can check that no committed round was lost); a learner sends it at subscription
    for the values it starts from, and downloads nothing when they are the syncer's."""
    data = values.detach().to("cpu", torch.float32).contiguous().numpy()
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()[:16]  # no copy of the bytes
