"""``diloco export RUN_DIR -o model.safetensors``: a finished (or stopped) run's global model
as the recipe model's own ``state_dict`` (``diloco.syncer.export``); ``diloco export
STATE_DIR --model MODULE:CALLABLE -o ...``: the same from any syncer's state directory, live
or dead, for the user's own model.

Formats (``ExportConfig``): one safetensors file, safetensors shards with their index, a
``torch.save`` file, or a transformers model's ``save_pretrained`` directory. The global
model is read into the model one fragment at a time and written one tensor (or one shard)
at a time: the export holds the model and never a second copy of it.

Where the model is: ``syncer/`` (or ``syncer-<i>/`` per shard) for ``--mode decoupled`` and
``--mode sync``, the last parameter snapshot of rank 0 (``dp/global.safetensors``) for
``--mode dp``. The run's ``config.json`` names the recipe, its seed (the initial model) and
the fragment count; a ``diloco launch`` run's names the user's ``--model`` (imported from the
working directory, as at the launch).
"""

from __future__ import annotations

from pathlib import Path

from diloco.config.export import ExportConfig
from diloco.syncer.export import ExportError, load_into_model, save_state_dict


def write_model(model, state: dict, output: str | Path, options: ExportConfig, **metadata) -> str:
    """Write ``state`` (``model``'s state_dict) to ``output`` in the format ``options`` and
    the output's name say; returns that format. ``ExportError`` (one line) for a name that
    contradicts the format, or ``--format hf`` of a model without ``save_pretrained``."""
    import os

    try:
        written_as = options.resolve(str(output))
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if written_as == "hf":
        if not callable(getattr(model, "save_pretrained", None)):
            raise ExportError(
                f"--format hf needs a transformers model (save_pretrained); "
                f"{type(model).__name__} has none: use --format safetensors"
            )
        shard = options.max_shard_size
        model.save_pretrained(str(output), **({"max_shard_size": shard} if shard else {}))
    elif written_as == "pt":
        import torch

        tmp = Path(str(output) + ".tmp")
        torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)  # (views: no copy)
        os.replace(tmp, output)
    elif options.max_shard_size is not None:
        from diloco.runtime.tensor_files import write_sharded

        write_sharded(output, state, options.max_shard_size, metadata)
    else:
        save_state_dict(state, output, **metadata)
    return written_as


def export_run(
    run_dir: str | Path, output: str | Path, options: ExportConfig | None = None
) -> dict:
    """Write ``run_dir``'s global model to ``output`` (``options``: the format, safetensors
    unless said); returns what was written (``keys``, ``versions`` or ``step``, ``mode``,
    ``format``). Raises ``ExportError`` with the reason."""
    from diloco.algorithm.fragments import balanced_fragments
    from diloco.config.run import load_run_config
    from diloco.launch.syncers import syncer_names
    from diloco.recipes import recipe_of

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ExportError(f"{run_dir} is not a run directory (it has no config.json)")
    launched = launched_model(run_dir / "config.json")
    if launched is not None:  # diloco launch: the syncer served the user's --model
        from diloco.runtime.model_ref import load_model

        return export_state_dir(run_dir / "syncer", load_model(launched), output, options)
    try:
        config = load_run_config(run_dir / "config.json")
    except (ValueError, OSError) as exc:
        raise ExportError(f"{run_dir / 'config.json'}: {exc}") from None
    options = options or ExportConfig()
    recipe = recipe_of(config.recipe)
    model = recipe.build_model(config.recipe.seed)
    if config.mode == "dp":
        return _export_dp(run_dir, model, output, options)
    layout = balanced_fragments(model.named_parameters(), config.syncer.protocol.num_fragments)
    dirs = [run_dir / name for name in syncer_names(config.shards)]
    state, versions = load_into_model(model, layout, dirs)
    written_as = write_model(model, state, output, options, mode=config.mode, versions=versions)
    return {"mode": config.mode, "keys": len(state), "versions": versions, "format": written_as}


def launched_model(config_path: Path) -> str | None:
    """The ``--model`` of a ``diloco launch`` run's configuration (None: a ``diloco run``)."""
    import json

    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{config_path}: {exc}") from None
    return raw.get("model") if isinstance(raw, dict) and raw.get("script") else None


def _export_dp(run_dir: Path, model, output, options: ExportConfig) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    snapshot = run_dir / "dp" / "global.safetensors"
    if not snapshot.is_file():
        raise ExportError(f"{snapshot} is missing: the data-parallel run wrote no snapshot")
    tensors = load_file(str(snapshot))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    params = {n for n, _ in model.named_parameters()}
    if unexpected or params & set(missing):
        raise ExportError(f"{snapshot} does not hold this recipe's parameters")
    with safe_open(str(snapshot), "pt") as f:
        step = (f.metadata() or {}).get("step", "?")
    del tensors  # (in the model now)
    state = model.state_dict()
    written_as = write_model(model, state, output, options, mode="dp", step=step)
    return {"mode": "dp", "keys": len(state), "step": step, "format": written_as}


def export_state_dir(
    state_dir: str | Path, model, output: str | Path, options: ExportConfig | None = None
) -> dict:
    """Write the global model held in a syncer's ``state_dir`` into ``model`` (the model the
    syncer served, as ``--model`` builds it) and to ``output`` (``options``: the format,
    safetensors unless said); returns what was written (``keys``, ``versions``,
    ``format``). A fragment never committed keeps ``model``'s own value. Raises
    ``ExportError`` with the reason (not a state directory, another model)."""
    import json

    from diloco.algorithm.fragments import FragmentLayout

    state_dir = Path(state_dir)
    meta_path = state_dir / "meta.json"
    if not meta_path.is_file():
        raise ExportError(
            f"{state_dir} is neither a run directory (config.json) nor a syncer's state "
            "directory (meta.json)"
        )
    try:
        meta = json.loads(meta_path.read_text())
        layout = FragmentLayout.from_dict(meta["layout"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{meta_path} is unreadable ({exc!r})") from None
    if tuple(meta.get("shard", (0, 1)))[1] > 1:
        raise ExportError(
            f"{state_dir} holds one shard of a sharded syncer; export the run directory"
        )
    named = dict(model.named_parameters())
    try:
        layout.check_compatible(
            [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named.items()]
        )
    except ValueError as exc:
        raise ExportError(f"--model is not the model {state_dir} holds: {exc}") from None
    state, versions = load_into_model(model, layout, [state_dir])
    written_as = write_model(
        model, state, output, options or ExportConfig(), mode="syncer", versions=versions
    )
    return {"mode": "syncer", "keys": len(state), "versions": versions, "format": written_as}
