"""``diloco selfcheck``: a few seconds of sanity checks on the algorithm core."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    import torch

    from diloco.algorithm import rda, token_weight

    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    merged = rda([a, b], [1.0, 1.0])
    print(f"RDA of two orthogonal norm-2 deltas has norm {merged.norm():.4f} (expected 2.0000)")
    print(f"token_weight(tokens=10, steps=2) = {token_weight(10, 2)} (expected 50.0)")
    ok = abs(float(merged.norm()) - 2.0) < 1e-5 and token_weight(10, 2) == 50.0
    print("selfcheck", "passed" if ok else "FAILED")
    return 0 if ok else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("selfcheck", help="quick sanity check of the algorithm core")
    p.set_defaults(func=run)
