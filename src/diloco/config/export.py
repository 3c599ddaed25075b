"""How ``diloco export`` writes the global model (``diloco.launch.export``)."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.runtime.schema import option
from diloco.runtime.units import parse_size

EXPORT_FORMATS = ("auto", "safetensors", "pt", "hf")
"""What ``--format`` accepts."""
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
"""Output names that say ``torch.save`` (``--format auto`` writes what the suffix says)."""
SAFETENSORS_SUFFIX = ".safetensors"


@dataclass(kw_only=True, frozen=True)
class ExportConfig:
    """The format of the exported model."""

    format: str = option("auto", choices=EXPORT_FORMATS)
    """``safetensors``: one file (or, with --max-shard-size, a directory of shards and their
    index ``model.safetensors.index.json``, as Hugging Face shards); ``pt``: ``torch.save`` of
    the state_dict; ``hf``: a ``save_pretrained`` directory (config and weights, loads with
    ``from_pretrained``) for a transformers model; ``auto``: what the output's name says
    (``.safetensors``; ``.pt``, ``.pth``, ``.bin``; a directory with --max-shard-size)."""
    max_shard_size: int | None = option(None, type=parse_size, metavar="SIZE")
    """Cut the weights into files of at most SIZE (5GB, 500MiB, bytes) with an index; the
    output is then a directory. Every tensor is written as it is read: the export never
    holds a second copy of the model."""

    def __post_init__(self) -> None:
        if self.format not in EXPORT_FORMATS:
            raise ValueError(f"--format must be one of {', '.join(EXPORT_FORMATS)}")
        if self.format == "pt" and self.max_shard_size is not None:
            raise ValueError("--max-shard-size shards safetensors, not --format pt")

    def resolve(self, output: str) -> str:
        """The format ``output`` is written in; ``ValueError`` (one line) when the output's
        name contradicts it or says none."""
        name = output.lower().rstrip("/")
        if self.format == "auto":
            if self.max_shard_size is not None:
                if name.endswith(TORCH_SUFFIXES):
                    raise ValueError(f"--max-shard-size writes a directory, not {output!r}")
                return "safetensors"
            if name.endswith(SAFETENSORS_SUFFIX):
                return "safetensors"
            if name.endswith(TORCH_SUFFIXES):
                return "pt"
            raise ValueError(
                f"cannot tell a format from {output!r}: name it .safetensors or .pt, or give "
                "--format (hf and --max-shard-size write a directory)"
            )
        if self.format == "safetensors" and name.endswith(TORCH_SUFFIXES):
            raise ValueError(
                f"{output!r} is a torch.save name; --format safetensors writes "
                "safetensors (name it .safetensors, or use --format pt)"
            )
        if self.format == "pt" and name.endswith(SAFETENSORS_SUFFIX):
            raise ValueError(f"{output!r} is a safetensors name; --format pt writes torch.save")
        return self.format
