"""The figures of one run's report, as PNG bytes (matplotlib's Agg backend, no display).

Each function takes a :class:`~diloco.report.run_files.RunFiles` and returns the PNG, or None
when the run has nothing to draw (no evaluation, no committed round).
"""

from __future__ import annotations

import io

from diloco.report.headless import headless_pyplot
from diloco.report.run_files import RunFiles, time_split

MARKER_COLORS = {
    "kill": "tab:red",
    "hang": "tab:orange",
    "restart": "tab:blue",
    "rejoin": "tab:green",
    "partition": "tab:purple",
    "syncer-kill": "darkred",
    "syncer-hang": "saddlebrown",
    "group-stop": "crimson",
    "added": "tab:cyan",
}
"""Colors of the tape's failure and recovery markers (others are gray)."""


def _png(fig) -> bytes:
    plt = headless_pyplot()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _markers(ax, run: RunFiles, *, legend: bool) -> None:
    """Vertical lines at every failure, restart and rejoin of the tape."""
    seen = set()
    for m in run.tape.markers:
        kind = m["kind"]
        ax.axvline(
            m["t"] - run.started,
            color=MARKER_COLORS.get(kind, "gray"),
            linestyle=":" if kind in ("restart", "rejoin") else "--",
            linewidth=1,
            alpha=0.7,
            label=kind if legend and kind not in seen else None,
        )
        seen.add(kind)


def at_a_glance(run: RunFiles) -> bytes | None:
    """The main figure: held-out loss (top) and the global model's progress (bottom: committed
    rounds per second, or data-parallel's steps per second) against wall time, with every
    failure and recovery marked."""
    plt = headless_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.6), sharex=True)
    if run.metrics:
        top.plot([m["t"] for m in run.metrics], [m["val_loss"] for m in run.metrics], "o-", ms=3)
    top.set_ylabel("held-out loss\n(nats/byte)")
    top.grid(alpha=0.3)
    _markers(top, run, legend=True)
    if top.get_legend_handles_labels()[0]:
        top.legend(fontsize=8, loc="upper right")
    times, rates, label = _progress_rate(run)
    bottom.step(times, rates, where="mid", color="tab:green")
    bottom.set_ylabel(label)
    bottom.set_xlabel("wall time (s)")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    _markers(bottom, run, legend=False)
    top.set_title(
        f"{run.path.name}: {run.mode}, {run.summary.get('learners')} learners", fontsize=10
    )
    fig.tight_layout()
    return _png(fig)


def _progress_rate(run: RunFiles) -> tuple[list[float], list[float], str]:
    """Bins of the global model's progress: committed rounds per second (DiLoCo), or the
    steps per second of rank 0's step count, rollbacks as 0 (data-parallel)."""
    if run.mode != "dp":
        bin_s = run.tape.bin_s
        offset = (run.tape.start or run.started) - run.started
        cells = run.tape.timeline
        span = max(cells, default=-1) + 1
        times = [offset + (i + 0.5) * bin_s for i in range(span)]
        rates = [cells.get(i, [0, 0])[0] / bin_s for i in range(span)]
        return times, rates, "rounds committed\nper second"
    steps = next(iter(run.steps.values()), [])
    times, rates = [], []
    for (t0, s0), (t1, s1) in zip(steps, steps[1:], strict=False):
        if t1 > t0:
            times.append((t0 + t1) / 2 - run.started)
            rates.append(max(0, s1 - s0) / (t1 - t0))
    return times, rates, "all-reduce steps\nper second"


def loss_vs_tokens(run: RunFiles) -> bytes | None:
    points = [(m["tokens"], m["val_loss"]) for m in run.metrics if m.get("tokens") is not None]
    if not points:
        return None
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(*zip(*points, strict=True), "o-", ms=3)
    ax.set_xlabel("tokens trained (all learners)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def training_loss(run: RunFiles) -> bytes | None:
    """Each learner's training loss against its step (the loss a script gave
    ``learner.step(tokens, loss=...)``: the summary's ``training_loss``, ``diloco launch``)."""
    curves = {k: v for k, v in (run.summary.get("training_loss") or {}).items() if v}
    if not curves:
        return None
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for learner, points in curves.items():
        ax.plot([p[1] for p in points], [p[2] for p in points], "-", lw=1, label=learner)
    ax.set_xlabel("learner step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def provisioned_time(run: RunFiles) -> bytes | None:
    """Per learner, its provisioned time split into useful, the schedule's down time, other."""
    split = time_split(run)
    if not split:
        return None
    plt = headless_pyplot()
    names = list(split)
    fig, ax = plt.subplots(figsize=(6, 1.3 + 0.45 * len(names)))
    left = [0.0] * len(names)
    for part, color, label in (
        ("useful", "tab:green", "useful"),
        ("down", "tab:red", "down (failure schedule)"),
        ("other", "tab:gray", "restarts, lost work, waiting"),
    ):
        widths = [split[n][part] for n in names]
        ax.barh(names, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("provisioned seconds")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    fig.tight_layout()
    return _png(fig)


def contributors(run: RunFiles) -> bytes | None:
    counts = run.tape.contributors
    if not counts:
        return None
    plt = headless_pyplot()
    sizes = sorted(counts)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([str(n) for n in sizes], [counts[n] for n in sizes], color="tab:purple")
    ax.set_xlabel("learners merged in the round")
    ax.set_ylabel("committed rounds")
    fig.tight_layout()
    return _png(fig)


def bytes_per_learner(run: RunFiles) -> bytes | None:
    learners = run.summary.get("per_learner", {})
    if not any("bytes_up" in ln for ln in learners.values()):  # (a state dir does not know)
        return None
    plt = headless_pyplot()
    names = list(learners)
    fig, ax = plt.subplots(figsize=(6, 0.8 + 0.5 * len(names)))
    y = range(len(names))
    up = [learners[n].get("bytes_up", 0) / 1e6 for n in names]
    down = [learners[n].get("bytes_down", 0) / 1e6 for n in names]
    ax.barh([i - 0.2 for i in y], up, height=0.4, label="sent (up)", color="tab:blue")
    ax.barh([i + 0.2 for i in y], down, height=0.4, label="received (down)", color="tab:orange")
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("MB at the learner's transport")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)
