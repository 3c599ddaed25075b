"""``diloco report``: one self-contained HTML file about a run or a bench folder."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="write one self-contained HTML report of a run, a syncer's state dir or a bench folder",
        description=(
            "Write an HTML file with the figures and the summary of a run directory "
            "(diloco run or launch, any --mode), of a standalone diloco syncer's --state-dir "
            "(read from its event tape, even after a kill) or of a diloco bench folder, and "
            "the commands that reproduce it. Figures are embedded: the file stands alone."
        ),
    )
    p.add_argument(
        "path",
        metavar="PATH",
        help="a run directory (runs/NAME), a syncer --state-dir or a bench --out",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="where to write (default: PATH/report.html)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.report.html import write_report
    from diloco.report.run_files import NotARun

    try:
        target = write_report(args.path, args.output)
    except (NotARun, OSError) as exc:
        print(f"diloco report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {target}")
    return 0
