"""Reading a fragment's snapshot file (``fragments/p007.safetensors``) in one pass: every
tensor read straight into the tensor that keeps it, and its checksum computed on the bytes
as they arrive (``diloco.syncer.store`` checks it), never in a second pass over memory; and
writing one (``write_snapshot``) from the tensors themselves, with no serialised copy of
them in memory (12 bytes per value of the fragment, 504 MB at 1B parameters and P = 24).

The file is a safetensors file (8 bytes: the header's length, little-endian; the header,
JSON: per tensor its dtype, shape and byte range in the data that follows, and the
``__metadata__`` strings; then the data). ``read_snapshot`` parses that header itself and
refuses, as ``StateError``, everything safetensors' own loader refuses that the store could
meet: a header that is not JSON or not an object, a tensor whose byte range does not match
its shape, ranges that overlap, leave gaps or do not end where the file ends, a file cut
short. A file holding anything but float32 tensors (the store writes no other) is read by
safetensors' loader, as before. The digest is ``tensor_digest``'s, bit for bit (per tensor in
the order of their names: the name, the shape, the raw bytes).

Where it is used and what a restart costs: ``docs/architecture.md``, "A restart, phase by
phase".
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.syncer.files import StateError

CHUNK_BYTES = 8 << 20
"""Bytes read (and hashed while they are in the CPU's caches) at a time."""
MAX_HEADER_BYTES = 100_000_000
"""The longest header read (safetensors' own limit): a longer length is a corrupt file."""
_LENGTH = struct.Struct("<Q")
_FLOAT32 = "F32"


@dataclass
class SnapshotFile:
    """What ``read_snapshot`` read: the tensors, the metadata strings, the digest of the
    tensors (``tensor_digest``), and the seconds spent reading from the file and
    hashing (for the restart's phases)."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    tensor_digest: str
    read_s: float = 0.0
    checksum_s: float = 0.0


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names, shapes and raw bytes of ``tensors`` (sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(raw_bytes(t))
    return h.hexdigest()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying them (bfloat16 through int16)."""
    array = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return memoryview(array).cast("B")


def snapshot_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The first bytes of a safetensors file of float32 ``tensors`` and ``metadata``, as
    safetensors' own writer makes them: the header's length (8 bytes, little-endian), the
    header (JSON without spaces: ``__metadata__``, then each tensor's dtype, shape and byte
    range, the tensors in the order of their names), padded with spaces to a multiple of 8
    bytes. The tensors' raw bytes follow, in that order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype != torch.float32:
            raise ValueError(f"a snapshot holds float32 tensors; {name} is {t.dtype}")
        header[name] = {
            "dtype": _FLOAT32,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + 4 * t.numel()],
        }
        offset += 4 * t.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return _LENGTH.pack(len(text)) + text


def write_snapshot(file, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write the safetensors file of float32 ``tensors`` (contiguous, on the CPU) and
    ``metadata`` into the binary ``file``: ``snapshot_header``, then each tensor's bytes
    straight from its memory."""
    file.write(snapshot_header(tensors, metadata))
    for name in sorted(tensors):
        file.write(raw_bytes(tensors[name]))


def read_snapshot(path: Path) -> SnapshotFile:
    """The tensors, metadata and tensor digest of the snapshot file at ``path``, read once
    (see the module docstring). Raises ``StateError`` (saying why, not naming the remedy: the
    store adds it) when the file is not a well-formed safetensors file; ``OSError`` when it
    cannot be read."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        header, data_start = _header(f, size)
        entries = {name: spec for name, spec in header.items() if name != "__metadata__"}
        metadata = header.get("__metadata__")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise StateError("its metadata is not a map of strings")
        if any(not isinstance(s, dict) or s.get("dtype") != _FLOAT32 for s in entries.values()):
            return _read_with_safetensors(path, metadata)
        ranges = _check_ranges(entries, size - data_start)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        h = hashlib.sha256()
        tensors: dict[str, torch.Tensor] = {}
        read_s = checksum_s = 0.0
        for name in sorted(entries):
            shape, begin, end = ranges[name]
            tensor = torch.empty(shape, dtype=torch.float32)
            h.update(name.encode())
            h.update(str(tuple(tensor.shape)).encode())
            view = raw_bytes(tensor)
            f.seek(data_start + begin)
            at = 0
            while at < end - begin:
                chunk = view[at : min(at + CHUNK_BYTES, end - begin)]
                started = time.perf_counter()
                got = f.readinto(chunk)
                read = time.perf_counter()
                if not got:
                    raise StateError(f"it is cut short (tensor {name!r})")
                h.update(chunk[:got])
                checksum_s += time.perf_counter() - read
                read_s += read - started
                at += got
            tensors[name] = tensor
    return SnapshotFile(tensors, dict(metadata), h.hexdigest(), read_s, checksum_s)


def _header(f, size: int) -> tuple[dict, int]:
    """The parsed header and the offset where the data begins."""
    raw = f.read(_LENGTH.size)
    if len(raw) < _LENGTH.size:
        raise StateError("it is too short to be a safetensors file")
    (length,) = _LENGTH.unpack(raw)
    if length > MAX_HEADER_BYTES or _LENGTH.size + length > size:
        raise StateError(f"its header length {length} does not fit the file")
    text = f.read(length)
    try:
        header = json.loads(text.decode("utf-8"))  # (not another encoding json would guess)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise StateError("its header is not a JSON object")
    return header, _LENGTH.size + length


def _check_ranges(entries: dict, data_bytes: int) -> dict[str, tuple[list[int], int, int]]:
    """Per tensor ``(shape, begin, end)`` once every range matches its shape and the ranges
    tile the data exactly (as safetensors checks)."""
    ranges = {}
    for name, spec in entries.items():
        shape, offsets = spec.get("shape"), spec.get("data_offsets")
        if not (
            isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
        ):
            raise StateError(f"tensor {name!r} has a bad shape or byte range")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end or end - begin != 4 * numel:
            raise StateError(f"tensor {name!r}: its byte range does not match its shape")
        ranges[name] = (shape, begin, end)
    at = 0
    for _, begin, end in sorted(ranges.values(), key=lambda r: (r[1], r[2])):
        if begin != at:
            raise StateError("its tensors' byte ranges overlap or leave a gap")
        at = end
    if at != data_bytes:
        raise StateError(f"its data is {data_bytes} bytes, its tensors {at}")
    return ranges


def _read_with_safetensors(path: Path, metadata: dict) -> SnapshotFile:
    """A file with tensors of other dtypes, read by safetensors' loader (then hashed)."""
    from safetensors.torch import load_file

    started = time.perf_counter()
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise StateError(str(exc)) from None
    read = time.perf_counter()
    digest = tensor_digest(tensors)
    return SnapshotFile(tensors, dict(metadata), digest, read - started, time.perf_counter() - read)
