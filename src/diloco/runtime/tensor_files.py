"""Tensors to safetensors files, streamed: one tensor's bytes in memory at a time.

``write_safetensors`` writes the format itself (an 8-byte little-endian header length, a
JSON header naming each tensor's dtype, shape and byte range, then the bytes), so saving a
model's ``state_dict`` never makes a second copy of the model (``safetensors.torch.save``
builds the whole file in memory first). ``write_sharded`` cuts a state dict into files of at
most ``max_shard_bytes`` (a tensor larger than that gets a file of its own) with an index,
as Hugging Face names them: ``model-00001-of-00003.safetensors`` and
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name:
file}}``); a state dict that fits one shard is one ``model.safetensors``, no index.

Every file is written whole or not at all (a temporary name, fsynced, renamed, the
directory fsynced).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from diloco.runtime.atomic_files import replace_atomically_with

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch dtypes and their names in a safetensors header."""

SINGLE_FILE = "model.safetensors"
"""A state dict that fits one shard."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded state dict: which file holds each tensor."""
HEADER_ALIGNMENT = 8
"""The header is padded with spaces to a multiple of this many bytes (as safetensors does)."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` (copied only if it is not a contiguous CPU tensor)."""
    t = tensor.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, object] | None = None,
    *,
    fence: Callable[[], None] | None = None,
) -> Path:
    """Write ``tensors`` to ``path`` as safetensors, one tensor at a time, atomically and
    durably; ``metadata`` values are stored as strings. ``fence`` is called just before and
    after the rename (raising before it refuses the write). ``ValueError`` for a dtype
    safetensors has no name for (nothing written)."""
    path = Path(path)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: safetensors cannot hold {t.dtype}")
        size = tensor_bytes(t)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)

    def write(f) -> None:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors.values():
            if t.numel():
                f.write(_raw(t))

    replace_atomically_with(path, write, fence=fence)
    return path


def shard_names(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The tensors' names cut, in order, into shards of at most ``max_shard_bytes`` (a
    tensor larger than that is a shard alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = tensor_bytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_sharded(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int,
    metadata: Mapping[str, object] | None = None,
) -> list[Path]:
    """Write ``tensors`` into ``directory`` (made if missing) as shards of at most
    ``max_shard_bytes`` and their index (see the module's docstring); returns the files
    written, the index last. Each shard is streamed (``write_safetensors``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards = shard_names(tensors, max_shard_bytes)
    if len(shards) == 1:
        return [write_safetensors(directory / SINGLE_FILE, tensors, metadata)]
    written, weight_map = [], {}
    for i, names in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        written.append(
            write_safetensors(directory / name, {n: tensors[n] for n in names}, metadata)
        )
        weight_map.update(dict.fromkeys(names, name))
    total = sum(tensor_bytes(t) for t in tensors.values())
    index = {
        "metadata": {"total_size": total, **{k: str(v) for k, v in (metadata or {}).items()}},
        "weight_map": weight_map,
    }
    text = json.dumps(index, indent=2).encode()
    replace_atomically_with(directory / INDEX_FILE, lambda f: f.write(text))
    return [*written, directory / INDEX_FILE]


def load_sharded(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read back what ``write_sharded`` wrote (or a Hugging Face model directory's weights)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / INDEX_FILE).is_file():
        return load_file(str(directory / SINGLE_FILE))
    index = json.loads((directory / INDEX_FILE).read_text())
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(directory / name)))
    return state
