"""Table, targets and figures of a `diloco bench --out DIR` over the runs that exist, running nothing.

    python benchmarks/bench_table.py DIR

`diloco bench` builds its table from the cells of the command it was given; when the cells of
one matrix were measured by several commands (some conditions or seeds at a time), this reads
every finished run in DIR/runs (not the sweep) with the bench's own report code and writes the
figures into DIR and the medians and targets to stdout and DIR/final.json.
"""

import json
import sys
from pathlib import Path

from diloco.cli.bench import read_curve
from diloco.report import bench as rp
from diloco.report import plots


def main(out: Path) -> None:
    results = []
    for d in sorted((out / "runs").iterdir()):
        if d.name.startswith("sweep") or not (d / "summary.json").exists():
            continue
        mode, condition, seed = d.name.rsplit("-", 2)
        spec = {"name": d.name, "mode": mode, "condition": condition, "seed": int(seed[1:])}
        summary = json.loads((d / "summary.json").read_text())
        results.append(rp.result_of(spec, summary, read_curve(d)))
    rows = rp.cells(results)
    goals = rp.targets(rows)
    plots.loss_curves(results, out)
    plots.bars(rows, out)
    print(rp.markdown_table(rows), "", sep="\n")
    for g in goals:
        print(f"- {'met' if g['met'] else 'MISSED'}: {g['target']} ({g['measured']})")
    for r in results:
        print(r["name"], {k: r[k] for k in ("val_loss", "tokens", "tokens_per_s", "goodput")})
    payload = {"results": results, "rows": rows, "targets": goals}
    (out / "final.json").write_text(json.dumps(payload, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
