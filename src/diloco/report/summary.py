"""The run summary (``summary.json``) and the bandwidth comparison with data-parallel.

Pure functions: they take what the supervisor collected and return plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping


def data_parallel_bytes_per_token(num_params: int, learners: int, tokens_per_step: int) -> float:
    """Bytes data-parallel training would put on the wire per token, for the same workers.

    Ring all-reduce of fp32 gradients every step: each of the M workers sends
    ``2·(M−1)/M · 4·N`` bytes per step, so all together ``2·(M−1)·4·N`` bytes per step of
    ``tokens_per_step`` tokens (the global batch). One worker sends nothing (0.0).
    """
    if learners < 1 or tokens_per_step < 1:
        raise ValueError("learners and tokens_per_step must be >= 1")
    return 2 * (learners - 1) * 4 * num_params / tokens_per_step


def contributors_per_round(rounds: list[dict]) -> dict:
    """How many learners each committed round merged, from the tape's ``round`` records:
    ``{"histogram": {"1": n1, "2": n2, ...}, "mean": m, "at_least_3": share}`` (an empty
    tape gives an empty histogram and ``None`` for the rest)."""
    counts: dict[int, int] = {}
    for r in rounds:
        n = len(r.get("participants", ()))
        counts[n] = counts.get(n, 0) + 1
    return contributors_summary(counts)


def contributors_summary(counts: Mapping[int, int]) -> dict:
    """``contributors_per_round`` from counts ``{learners merged: rounds}``."""
    total = sum(counts.values())
    return {
        "histogram": {str(n): counts[n] for n in sorted(counts)},
        "mean": round(sum(n * c for n, c in counts.items()) / total, 3) if total else None,
        "at_least_3": round(sum(c for n, c in counts.items() if n >= 3) / total, 4)
        if total
        else None,
    }


def build_summary(
    *,
    mode: str,
    run_dir: str,
    wall_s: float,
    val_initial: float,
    val_final: float,
    rounds: int,
    learners: list[dict],
    num_params: int,
    tokens_per_sample: int,
    stopped_by: str,
) -> dict:
    """``summary.json``: what ran, how long, how well, how many bytes.

    ``learners`` holds per learner ``id``, ``steps``, ``tokens``, ``steps_per_s``,
    ``batch_size``, ``slow``, ``exit_code``, ``bytes_up``, ``bytes_down``.
    """
    tokens = sum(int(ln["tokens"]) for ln in learners)
    up = sum(int(ln["bytes_up"]) for ln in learners)
    down = sum(int(ln["bytes_down"]) for ln in learners)
    per_token = (up + down) / tokens if tokens else None
    tokens_per_step = sum(int(ln["batch_size"]) * tokens_per_sample for ln in learners)
    dp = data_parallel_bytes_per_token(num_params, len(learners), tokens_per_step)
    return {
        "mode": mode,
        "run_dir": run_dir,
        "stopped_by": stopped_by,
        "learners": len(learners),
        "wall_s": round(wall_s, 2),
        "tokens": tokens,
        "params": num_params,
        "val_loss": {"initial": val_initial, "final": val_final},
        "rounds": rounds,
        "bytes": {
            "up": up,
            "down": down,
            "per_token": per_token,
            "data_parallel_per_token": dp,
            "reduction_vs_data_parallel": (dp / per_token) if per_token and dp else None,
        },
        "per_learner": {ln["id"]: {k: v for k, v in ln.items() if k != "id"} for ln in learners},
    }


def add_scores(summary: dict, facts: dict) -> None:
    """The held-out loss's unit (``val_loss.unit``) and the recipe's other held-out measures
    (``val_scores.<name>.initial/final``, e.g. accuracy) from ``facts`` (``loss_unit`` and
    ``scores``: the initial and final dicts), where the run has them."""
    if facts.get("loss_unit"):
        summary["val_loss"]["unit"] = facts["loss_unit"]
    initial, final = facts.get("scores") or ({}, {})
    if initial or final:
        summary["val_scores"] = {
            k: {"initial": initial.get(k), "final": final.get(k)} for k in {**initial, **final}
        }


def format_summary(s: dict) -> str:
    """A few human lines for the end of ``diloco run``."""
    b = s["bytes"]
    per_round = s.get("contributors_per_round") or {}
    merged = f" (learners per round: mean {per_round['mean']:.2f})" if per_round.get("mean") else ""
    lines = [
        f"run {s['run_dir']} ({s['mode']}, {s['learners']} learners, stopped by {s['stopped_by']})",
        f"  wall {s['wall_s']:.1f}s  tokens {s['tokens']:,}  rounds {s['rounds']}{merged}",
    ]
    if s["val_loss"]["initial"] is not None and s["val_loss"]["final"] is not None:
        lines.append(
            f"  held-out loss {s['val_loss']['initial']:.3f} -> {s['val_loss']['final']:.3f} "
            + s["val_loss"].get("unit", "nats/byte")
        )
    for name, v in (s.get("val_scores") or {}).items():
        if v["initial"] is not None and v["final"] is not None:
            lines.append(f"  held-out {name} {v['initial']:.3f} -> {v['final']:.3f}")
    if s.get("goodput") is not None:
        line = f"  goodput {100 * s['goodput']:.1f}%"
        if s.get("down_share"):
            line += f" (failures took {100 * s['down_share']:.1f}% of the provisioned time)"
        if s.get("max_commit_gap_s") is not None:
            line += f", longest pause of the global model {s['max_commit_gap_s']:.2f}s"
        lines.append(line)
    if b["per_token"] is not None:
        ratio = b["reduction_vs_data_parallel"]
        lines.append(
            f"  bytes up {b['up']:,} down {b['down']:,} = {b['per_token']:.2f} B/token"
            + (f" ({ratio:.0f}x less than data-parallel)" if ratio and s["mode"] != "dp" else "")
        )
    if s.get("wan"):
        lines.append(_wan_line(s["wan"]))
    for name, ln in s["per_learner"].items():
        lines.append(
            f"  {name}: {ln['steps']} steps, {ln['tokens']:,} tokens, "
            f"{ln['steps_per_s']:.2f} steps/s, "
            + ("down at the end" if ln["exit_code"] is None else f"exit {ln['exit_code']}")
            + (f", link {s['wan']['links'][name]['link']}" if s.get("wan") else "")
        )
    return "\n".join(lines)


def _wan_line(wan: dict) -> str:
    """``--wan``: the bytes the learners' interfaces counted, beside the transport's."""
    ratios = [
        f"{d} {wan[f'{d}_ratio']:.2f}x" for d in ("up", "down") if wan.get(f"{d}_ratio") is not None
    ]
    per_token = wan.get("iface_bytes_per_token")
    return (
        f"  at the interfaces: up {wan['iface_up']:,} down {wan['iface_down']:,}"
        + (f" = {per_token:.2f} B/token" if per_token else "")
        + (f" (vs the transport's count: {', '.join(ratios)})" if ratios else "")
    )
