"""The command-line flags ``diloco run`` gives the syncer and the learners it starts."""

from __future__ import annotations

import argparse


def syncer_flags(args: argparse.Namespace) -> list[str]:
    wait_for_all = args.learners if args.mode == "sync" else args.wait_for_all
    return [
        f"--schedule={'learner' if args.mode == 'sync' else args.schedule}",
        f"--sync-every={args.sync_every}",
        f"--weight-cap={args.weight_cap}",
        f"--merge={args.merge_rule}",
        f"--weighting={args.weighting}",
        f"--quorum={args.quorum}",
        f"--wait-for-all={wait_for_all}",
        f"--gamma={0.0 if args.mode == 'sync' else args.gamma}",
        f"--tau={args.tau}",
        f"--max-staleness={args.max_staleness}",
        f"--lease={args.lease}",
        f"--outer-lr={args.outer_lr}",
        f"--outer-momentum={args.outer_momentum}",
        f"--outer-scale={args.outer_scale}",
        f"--up-codec={args.up_codec}",
        f"--down-codec={args.down_codec}",
        f"--norm-guard={args.norm_guard}",
        *([f"--token-file={args.token_file}"] if args.token_file else []),
    ]


def corrupt_flags(window, started: float, tape) -> list[str]:
    """Worker flags for a ``corrupt`` chaos window (and its ``chaos`` record on the tape)."""
    if window is None:
        return []
    end = started + window.end_s
    tape.append(
        {
            "event": "chaos",
            "t": started + window.start_s,
            "kind": "corrupt",
            "target": f"learner-{window.index}",
            "how": window.how,
            "down_s": None if window.end_s == float("inf") else window.end_s - window.start_s,
        }
    )
    return [
        f"--corrupt={window.how}",
        f"--corrupt-start={started + window.start_s}",
        f"--corrupt-end={0.0 if end == float('inf') else end}",
    ]


def sync_lag(args: argparse.Namespace) -> int:
    """``--mode sync``: a learner does not start the step that would send a fragment again
    while that fragment's previous round is still open (``H − 1`` steps after the send; -1
    otherwise: never wait). So every learner contributes once to every round, and a fast
    learner runs at most one cycle of H steps ahead of the slowest one.

    Why this lag and no smaller one: with P = H a learner sends every other fragment in the
    H − 1 steps before it waits, so whatever round it waits for, its peers owe a fragment that
    they send before they wait themselves, and no two learners can wait for each other. A
    restarted learner resumes at another phase of the schedule; with a lag of 1 it and its
    peers each waited for a fragment the other sends later (a deadlock, seen in a test).
    """
    return args.sync_every - 1 if args.mode == "sync" else -1


def recipe_flags(args: argparse.Namespace) -> list[str]:
    flags = [f"--recipe={args.recipe}", f"--seed={args.seed}", f"--fragments={args.fragments}"]
    return flags + ([f"--data={args.data}"] if args.data else [])
