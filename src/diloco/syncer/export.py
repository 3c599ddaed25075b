"""The global model out, as an ordinary ``state_dict``: from a live syncer, a state
directory, or a finished run (``diloco export``).

The syncer holds the global model as one flat float32 vector per fragment
(``diloco.algorithm.fragments``). :func:`into_model` writes those vectors into a model's own
parameters and returns ``model.state_dict()``: the model's own names, shapes and dtypes, its
buffers, and both names of a tied parameter (a token embedding shared with the output head
is one parameter but two ``state_dict`` keys), so ``load_state_dict(strict=True)`` accepts
it. Without a model, :func:`parameters_by_name` gives the parameters alone.

What is exported is Θ, the syncer's exact global value of each fragment at its latest
committed version (a fragment never committed has its initial value). Learners hold the
syncer's wire image of it, which differs by the rounding of the deltas sent down
(``diloco.syncer.service``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from diloco.algorithm.fragments import FragmentLayout
from diloco.runtime.modules import plain_module
from diloco.syncer.store import FragmentStore, StateError


class ExportError(ValueError):
    """A run directory or state directory that holds no exportable model (said why)."""


def into_model(
    model: torch.nn.Module, layout: FragmentLayout, params: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Write every fragment's flat vector into ``model``'s parameters (in place) and return
    ``model.state_dict()`` (for a compiled model, the state_dict of the module
    ``torch.compile`` wrapped: the names learners and the syncer agree on). Raises
    ``ExportError`` when the model is not the layout's."""
    model = plain_module(model)
    named = _checked_parameters(model, layout)
    for p, flat in enumerate(params):
        layout.scatter(p, flat, named)
    return model.state_dict()


def parameters_by_name(
    layout: FragmentLayout, params: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The global parameters as ``{name: tensor}`` with the model's names, shapes and dtypes
    (no buffers; a tied parameter under its first name only)."""
    named = {
        name: torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
        for name, shape, dtype in layout.tensors
    }
    for p, flat in enumerate(params):
        layout.scatter(p, flat, named)
    return named


def read_state_dirs(
    dirs: Sequence[str | Path], layout: FragmentLayout, initial: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[int]]:
    """Every fragment's latest committed value across the state directories of one run (one
    per syncer shard) and its version: ``(params, versions)``; a fragment no directory holds
    keeps its ``initial`` value at version 0. Raises ``ExportError`` if any of ``dirs`` is
    not a syncer's state directory (a shard's missing directory would otherwise export its
    fragments at their initial values, silently) or a file is corrupt. It reads and never
    claims: a live syncer's directory can be read."""
    missing = [str(d) for d in dirs if not Path(d, "meta.json").is_file()]
    if missing or not dirs:
        raise ExportError(
            f"not a syncer state directory (no meta.json): {', '.join(missing) or 'none given'}"
        )
    stores = [FragmentStore(d) for d in dirs]
    params = [t.detach().to(torch.float32).reshape(-1).clone() for t in initial]
    versions = [0] * layout.num_fragments
    for store in stores:
        for p in range(layout.num_fragments):
            try:
                loaded = store.load(p, layout.fragments[p].numel)
            except StateError as exc:
                raise ExportError(str(exc)) from None
            if loaded is not None and loaded[0] > versions[p]:
                versions[p], params[p] = loaded[0], loaded[1]
    return params, versions


def save_state_dict(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    fence: Callable[[], None] | None = None,
    **metadata,
) -> Path:
    """Write ``state`` as safetensors, streamed one tensor at a time (never a second copy of
    the model; tied names are written once each), atomically and durably: a temporary file,
    fsynced, renamed, the directory fsynced, ``fence`` called around the rename
    (``diloco.runtime.tensor_files.write_safetensors``). ``metadata`` values are stored as
    strings."""
    from diloco.runtime.tensor_files import write_safetensors

    return write_safetensors(path, state, metadata, fence=fence)


def load_into_model(
    model: torch.nn.Module, layout: FragmentLayout, dirs: Sequence[str | Path]
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Write the global model held in ``dirs`` (the state directories of one run, one per
    syncer shard) into ``model``'s parameters, one fragment at a time (the model and one
    fragment in memory: never two copies of the model), and return ``(model.state_dict(),
    versions)``. A fragment no directory holds keeps ``model``'s own value at version 0.
    Raises ``ExportError`` as ``read_state_dirs`` and ``into_model`` do."""
    model = plain_module(model)
    named = _checked_parameters(model, layout)
    missing = [str(d) for d in dirs if not Path(d, "meta.json").is_file()]
    if missing or not dirs:
        raise ExportError(
            f"not a syncer state directory (no meta.json): {', '.join(missing) or 'none given'}"
        )
    stores = [FragmentStore(d) for d in dirs]
    versions = [0] * layout.num_fragments
    for p in range(layout.num_fragments):
        newest = None
        for store in stores:
            try:
                loaded = store.load(p, layout.fragments[p].numel)
            except StateError as exc:
                raise ExportError(str(exc)) from None
            if loaded is not None and loaded[0] > versions[p]:
                versions[p], newest = loaded[0], loaded[1]
        if newest is not None:
            layout.scatter(p, newest, named)
    return model.state_dict(), versions


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _checked_parameters(model: torch.nn.Module, layout: FragmentLayout) -> dict[str, torch.Tensor]:
    """``model``'s named parameters; ``ExportError`` when they are not the layout's."""
    named = dict(model.named_parameters())
    try:
        layout.check_compatible([(n, tuple(t.shape), _dtype(t)) for n, t in named.items()])
    except ValueError as exc:
        raise ExportError(f"the model does not match the syncer's: {exc}") from None
    return named
