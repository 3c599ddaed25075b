"""``diloco report PATH``: one self-contained HTML file about a run or a bench folder.

For a run directory (``--mode decoupled``, ``sync`` or ``dp``), or a standalone syncer's
state directory (read from its tape; the report lists what that cannot show): the summary
table, the
learners, the figures (the run at a glance: loss and the global model's progress against wall
time with every failure marked; loss against tokens; where the provisioned time went;
learners merged per round; bytes per learner) and the commands that reproduce it. For a
``diloco bench`` folder: its table, targets and figures, and one line per run. Figures are
embedded as PNG data, so the file can be mailed or attached as it is.
"""

from __future__ import annotations

import base64
import html
import json
import shlex
import time
from pathlib import Path

from diloco.report import run_figures
from diloco.report.run_files import NotARun, RunFiles, load_run

STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 980px; margin: 24px auto; padding: 0 16px;
       color: #1d1d1f; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 32px; }
.sub { color: #6b6b70; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0; font-variant-numeric: tabular-nums; }
th, td { padding: 4px 12px 4px 0; border-bottom: 1px solid #e3e3e0; text-align: left; }
td.n { text-align: right; }
figure { margin: 16px 0; } figcaption { color: #6b6b70; font-size: 13px; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f5f5f3; padding: 10px 12px; overflow-x: auto; border-radius: 6px; }
"""


def write_report(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of the run or bench folder ``path`` to ``out`` (default
    ``path/report.html``); returns where. ``NotARun`` for anything else."""
    path = Path(path)
    if (path / "results.json").is_file() and not (path / "summary.json").exists():
        text = bench_report(path)
    else:
        text = run_report(load_run(path))
    target = Path(out) if out else path / "report.html"
    target.write_text(text, encoding="utf-8")
    return target


def _page(title: str, body: list[str]) -> str:
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )


def _figure(png: bytes | None, caption: str, name: str) -> str:
    if png is None:
        return ""
    data = base64.b64encode(png).decode()
    return (
        f"<figure id='{name}'><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def _table(rows: list[list], header: list[str] | None = None) -> str:
    def cell(value, tag="td") -> str:
        numeric = isinstance(value, (int, float))
        return f"<{tag}{' class=n' if numeric else ''}>{html.escape(_fmt(value))}</{tag}>"

    head = "<tr>" + "".join(cell(h, "th") for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def summary_rows(s: dict) -> list[list]:
    """The summary table: what ran and how it went."""
    b = s.get("bytes", {})
    per_round = s.get("contributors_per_round") or {}
    rows = [
        ["mode", s.get("mode")],
        ["learners", s.get("learners")],
        ["stopped by", s.get("stopped_by")],
        ["wall time (s)", s.get("wall_s")],
        ["tokens merged" if s.get("source") else "tokens", s.get("tokens")],
        [
            "held-out loss, start → end",
            f"{_fmt(s['val_loss']['initial'])} → {_fmt(s['val_loss']['final'])} "
            + s["val_loss"].get("unit", "nats/byte"),
        ],
        *[
            [f"held-out {name}, start → end", f"{_fmt(v['initial'])} → {_fmt(v['final'])}"]
            for name, v in (s.get("val_scores") or {}).items()
        ],
        ["goodput", _pct(s.get("goodput"))],
        ["down (failure schedule)", _pct(s.get("down_share"))],
        ["goodput while up", _pct(s.get("goodput_up"))],
        ["uptime of the global model", _pct(s.get("uptime"))],
        ["longest pause of the global model (s)", s.get("max_commit_gap_s")],
        ["rounds" if s.get("mode") != "dp" else "all-reduce steps", s.get("rounds")],
    ]
    if s.get("syncer_restarts"):
        rows.append(["syncer restarts", s["syncer_restarts"]])
    if per_round.get("mean") is not None:
        rows.append(
            [
                "learners per round (mean; ≥ 3)",
                f"{per_round['mean']:.2f}; {_pct(per_round.get('at_least_3'))}",
            ]
        )
    if b.get("per_token") is not None:
        ratio = b.get("reduction_vs_data_parallel")
        rows.append(
            [
                "bytes per token",
                f"{b['per_token']:,.1f}"
                + (
                    f" ({ratio:.0f}× fewer than data-parallel)"
                    if ratio and s.get("mode") != "dp"
                    else ""
                ),
            ]
        )
    rows.append(["failures injected", len(s.get("failures_injected") or [])])
    return rows


def learner_rows(s: dict) -> list[list]:
    return [
        [
            name,
            ln.get("steps"),
            ln.get("tokens"),
            ln.get("steps_per_s"),
            ln.get("contributions"),
            ln.get("restarts"),
            f"{ln.get('bytes_up', 0) / 1e6:.1f} / {ln.get('bytes_down', 0) / 1e6:.1f}",
            ln.get("exit_code"),
        ]
        for name, ln in s.get("per_learner", {}).items()
    ]


def commands(run: RunFiles) -> list[str]:
    """Command lines that run the same configuration again, and make this report."""
    out = []
    name = run.path.name
    if (run.path / "config.json").is_file():
        out.append(
            shlex.join(
                [
                    "diloco",
                    "run",
                    "--config",
                    str(run.path / "config.json"),
                    "--name",
                    f"{name}-again",
                ]
            )
        )
        try:  # the same run as flags, written by the launcher (``command.txt``)
            out.append((run.path / "command.txt").read_text().strip())
        except OSError:
            pass
    out.append(shlex.join(["diloco", "report", str(run.path)]))
    return out


def state_dir_learner_rows(s: dict) -> list[list]:
    """The learners of a syncer's state directory, as its tape knows them."""
    return [
        [
            name,
            ln.get("steps"),
            ln.get("tokens"),
            ln.get("contributions"),
            ln.get("staleness_mean"),
            ln.get("staleness_max"),
            ln.get("rejoins"),
            ln.get("left") or "no leave on the tape",
        ]
        for name, ln in s.get("per_learner", {}).items()
    ]


def _learners_table(run: RunFiles) -> str:
    if run.from_state_dir:
        header = [
            "learner",
            "steps merged",
            "tokens merged",
            "contributions",
            "staleness (mean)",
            "staleness (max)",
            "rejoins",
            "left",
        ]
        return _table(state_dir_learner_rows(run.summary), header)
    header = [
        "learner",
        "steps",
        "tokens",
        "steps/s",
        "contributions",
        "restarts",
        "MB sent / received",
        "exit",
    ]
    return _table(learner_rows(run.summary), header)


def _limits(run: RunFiles) -> str:
    """What the report cannot show (a syncer's state directory), as a short list."""
    if not run.from_state_dir:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in run.summary.get("limits", ()))
    return (
        "<p>"
        + html.escape(
            "A syncer's state directory, read from its event tape (events.jsonl): the "
            "rounds, what each merged and who took part. It has"
        )
        + f"</p><ul>{items}</ul>"
    )


def run_report(run: RunFiles) -> str:
    s = run.summary
    kind = "syncer state" if run.from_state_dir else "run"
    title = f"diloco {kind} {run.path.name}"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.started)) if run.started else ""
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='sub'>{html.escape(s.get('mode', ''))}, {s.get('learners')} learners, "
        f"started {when}, {html.escape(str(run.path))}</p>",
        _limits(run),
        _figure(
            run_figures.at_a_glance(run),
            "The run at a glance: held-out loss of the global model (top) and its progress "
            "(bottom) against wall time; dashed lines mark injected failures, dotted lines "
            "restarts and rejoins.",
            "glance",
        ),
        "<h2>Summary</h2>",
        _table(summary_rows(s)),
        "<h2>Learners</h2>",
        _learners_table(run),
        _figure(run_figures.loss_vs_tokens(run), "Held-out loss against tokens trained.", "tokens"),
        _figure(run_figures.training_loss(run), "Each learner's training loss.", "training-loss"),
        _figure(
            run_figures.provisioned_time(run),
            "Where each learner's provisioned time went (definitions: docs/resilience.md).",
            "time",
        ),
        _figure(
            run_figures.contributors(run), "Learners merged per committed round.", "contributors"
        ),
        _figure(
            run_figures.bytes_per_learner(run),
            "Bytes each learner's transport sent and received.",
            "bytes",
        ),
        "<h2>Reproduce</h2>",
        "<pre>" + html.escape("\n".join(commands(run))) + "</pre>",
    ]
    return _page(title, body)


def bench_report(path: Path) -> str:
    """The report of a ``diloco bench`` folder: its table, targets, figures and runs."""
    try:
        data = json.loads((path / "results.json").read_text())
    except (OSError, ValueError) as exc:
        raise NotARun(f"{path}/results.json is not readable: {exc}") from None
    title = f"diloco bench {path.name}"
    body = [f"<h1>{html.escape(title)}</h1>"]
    table = path / "table.md"
    if table.is_file():
        body.append(markdown(table.read_text()))
    for png in sorted(path.glob("*.png")):
        body.append(_figure(png.read_bytes(), png.stem.replace("_", " "), png.stem))
    rows = [
        [
            r.get("name"),
            r.get("mode"),
            r.get("condition"),
            r.get("seed"),
            r.get("val_loss"),
            _pct(r.get("goodput")),
            r.get("bytes_per_token"),
            r.get("tokens"),
        ]
        for r in data.get("results", [])
    ]
    body += [
        "<h2>Runs</h2>",
        _table(
            rows,
            [
                "run",
                "mode",
                "condition",
                "seed",
                "held-out loss",
                "goodput",
                "bytes/token",
                "tokens",
            ],
        ),
    ]
    command = data.get("command") or f"diloco bench --out {path} (its flags were not recorded)"
    body += [
        "<h2>Reproduce</h2>",
        "<pre>"
        + html.escape(command)
        + "\n"
        + html.escape(shlex.join(["diloco", "report", str(path)]))
        + "</pre>",
    ]
    return _page(title, body)


def markdown(text: str) -> str:
    """The small subset of Markdown ``diloco bench`` writes: headings, tables, lists, text."""
    out, table = [], []

    def flush() -> None:
        if table:
            cells = [[c.strip() for c in row.strip("|").split("|")] for row in table]
            rows = [r for r in cells if not all(set(c) <= set("-: ") for c in r)]
            out.append(_table(rows[1:], rows[0]))
            table.clear()

    for line in text.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.startswith("# "):
            out.append(f"<h2>{html.escape(line[2:])}</h2>")
        elif line.startswith("- "):
            out.append(f"<li>{html.escape(line[2:])}</li>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(out)
