"""Where the quality gap to data-parallel comes from (issue "Same quality as data-parallel").

    python benchmarks/bench_quality.py [--out bench/quality] [--seeds 0,1,2] [--settings ...]

Clean runs at equal tokens (M = 4 learners × batch 8 × 800 steps = 3.28M tokens of the
default recipe; ``--steps`` for other budgets), one at a time, each setting a ``diloco run`` with:

- ``dp``: data-parallel, global batch 32;
- ``sync``: synchronous DiLoCo at P = H = 24, int4 up, int8 down (pinned, below);
- ``sync-H1``: synchronous DiLoCo exchanging the whole model after every step
  (``--fragments 1 --sync-every 1``: parameter averaging every step);
- ``decoupled``: the default decoupled setting until 2026-11-27 (H = 24, int4 up, int8 down);
  ``default``: the default since (``--comms default``: H = 16, sign1 up, int2 down). Every
  other setting starts from the former default's H and codecs (``PINNED``), so each name
  keeps the meaning it had when it was measured;
- ``outer-LR-MU``: decoupled with outer lr LR and Nesterov momentum MU, any numbers
  (``sync-outer-LR-MU`` the same in synchronous mode); ``no-share``: without the round share
  (``--outer-scale none``); ``decoupled-P1``: the whole model as one fragment;
- ``lowbw``: the documented low-bandwidth setting (H = 64, int4 both ways; ``lowbw-LR-MU``
  with that outer step; ``sparse-LR-MU`` and ``sparse-up-LR-MU`` likewise);
- ``sparse``: top-k 2-bit exchanges both ways (``--up-codec topk2 --down-codec topk2``);
  ``sparse-up``: topk2 up, int4 down; ``sparse-down``: int4 up, topk2 down; ``sparse-mean``:
  both ways with the weighted mean instead of RDA; ``int2``: dense ternary (int2) both ways;
  ``sign1``: dense sign bits both ways; ``sign1-up``: sign1 up, int4 down; ``sign1-nofb``:
  sign1 both ways, Θ set to the wire image at every commit (``--down-feedback off``);
  ``sign1-up-nofb``: sign1 up, int4 down, the same; ``sign1w-up``: sign1w (wide blocks,
  1024 values per scale) up, int4 down; ``sign1w-nofb``: sign1w both ways, no down feedback;
  ``sign1-int2``: sign1 up, dense ternary (int2) down (``sign1-int2-nofb`` without down
  feedback; ``sign1-int2-H16`` is ``default``);
- ``dp-muon``, ``decoupled-muon``: the inner optimizer Muon (hidden matrices; AdamW for the
  rest) instead of AdamW; any setting as ``SETTING+muon`` with Muon, and as ``SETTING@LR``
  with the peak inner lr LR (``sparse+muon@6e-3``); ``SETTING-HN`` with sync period H = N
  (``sparse-up-H96+muon@6e-3``); ``SETTING-earlyH0forN`` with the H schedule H0 for the
  clock's first N cycles (``decoupled-early8for8``); ``SETTING-olrVtoF`` with the outer lr's
  cosine decay over V versions down to F × lr (``decoupled-olr33to0.1``);
  ``SETTING-nodrain`` with learners that stop without the final download
  (``--drain-timeout 0``: the export holds their flushed progress all the same);
- ``sync-P1``, ``sync-fp32``, ``sync-mean``, ``sync-torchft-like``: synchronous mode with what
  torchft's DiLoCo does differently (one fragment, fp32 both ways, the plain mean; all three).

Per run: held-out loss at the end (of the global model the evaluator holds, and of the
exported global model, the syncer's Θ: they differ by what the down codec has not sent yet),
the share of inner steps whose gradient was clipped (``clipped_steps`` ÷ steps), wall time,
bytes per token and the reduction against data-parallel. Medians over seeds are printed and written to
``OUT/results.json``. Runs already there are reused. With several budgets and ``dp`` among
the settings, ``OUT/gap_vs_budget.png`` shows each setting's held-out loss and its gap to
data-parallel against the budget (tokens per parameter).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from diloco.wire.experimental import FORMER_DEFAULT, SPARSE, SPARSE_UP

PINNED = [
    f"--sync-every={FORMER_DEFAULT.sync_every}",
    f"--up-codec={FORMER_DEFAULT.up_codec}",
    f"--down-codec={FORMER_DEFAULT.down_codec}",
]
"""H and the codecs every setting but ``default`` and data-parallel starts from (its own flags
come after and win): the default until 2026-11-27, when these settings were named and
measured."""
SETTINGS = {
    "default": ["--mode=decoupled"],
    "dp": ["--mode=dp"],
    "sync": ["--mode=sync"],
    "sync-H1": ["--mode=sync", "--fragments=1", "--sync-every=1"],
    "decoupled": ["--mode=decoupled"],
    "no-share": ["--mode=decoupled", "--outer-scale=none"],
    # the whole model as one fragment (one round every H fleet steps)
    "decoupled-P1": ["--mode=decoupled", "--fragments=1"],
    # what torchft's DiLoCo does differently, one thing at a time (synchronous mode): the
    # whole model as one fragment, fp32 both ways, the plain mean; and all three
    "sync-P1": ["--mode=sync", "--fragments=1"],
    "sync-fp32": ["--mode=sync", "--up-codec=fp32", "--down-codec=fp32"],
    "sync-mean": ["--mode=sync", "--merge=mean"],
    "sync-torchft-like": [
        "--mode=sync",
        "--fragments=1",
        "--up-codec=fp32",
        "--down-codec=fp32",
        "--merge=mean",
    ],  # fmt: skip
}
LOW_BANDWIDTH = ["--mode=decoupled", "--sync-every=64", "--down-codec=int4"]
SETTINGS["lowbw"] = LOW_BANDWIDTH
# sparse exchanges (experimental, diloco.wire.experimental): top-k 2-bit with error feedback
SETTINGS["sparse"] = [
    "--mode=decoupled", f"--up-codec={SPARSE.up_codec}", f"--down-codec={SPARSE.down_codec}"
]  # fmt: skip
SETTINGS["sparse-up"] = [
    "--mode=decoupled", f"--up-codec={SPARSE_UP.up_codec}", f"--down-codec={SPARSE_UP.down_codec}"
]  # fmt: skip
SETTINGS["sparse-down"] = ["--mode=decoupled", f"--down-codec={SPARSE.down_codec}"]
SETTINGS["sparse-mean"] = [*SETTINGS["sparse"], "--merge=mean"]
# dense ternary (int2) exchanges both ways with error feedback
SETTINGS["int2"] = ["--mode=decoupled", "--up-codec=int2", "--down-codec=int2"]
# dense sign (sign1: one bit per value and a mean-magnitude scale per block) with error
# feedback: both ways, or up only with int4 down
SETTINGS["sign1"] = ["--mode=decoupled", "--up-codec=sign1", "--down-codec=sign1"]
SETTINGS["sign1-up"] = ["--mode=decoupled", "--up-codec=sign1", "--down-codec=int4"]
# ... and without error feedback down: the syncer's Θ takes the wire image at every commit
SETTINGS["sign1-nofb"] = [*SETTINGS["sign1"], "--down-feedback=off"]
SETTINGS["sign1-up-nofb"] = [*SETTINGS["sign1-up"], "--down-feedback=off"]
# sign1 with wide blocks (1024 values per scale): up with int4 down, or both ways without
# down feedback
SETTINGS["sign1w-up"] = ["--mode=decoupled", "--up-codec=sign1w", "--down-codec=int4"]
# sign1 up with dense ternary (int2) down: downloads are most of the bytes
SETTINGS["sign1-int2"] = ["--mode=decoupled", "--up-codec=sign1", "--down-codec=int2"]
SETTINGS["sign1-int2-nofb"] = [*SETTINGS["sign1-int2"], "--down-feedback=off"]
SETTINGS["sign1w-nofb"] = [
    "--mode=decoupled", "--up-codec=sign1w", "--down-codec=sign1w", "--down-feedback=off",
]  # fmt: skip
# the inner optimizer: Muon for the hidden matrices, AdamW for the rest (one peak lr)
SETTINGS["dp-muon"] = ["--mode=dp", "--inner-optimizer=muon"]
SETTINGS["decoupled-muon"] = ["--mode=decoupled", "--inner-optimizer=muon"]
OUTER_PREFIXES = {  # NAME-LR-MU: the setting's flags with that outer step
    "outer": ["--mode=decoupled"],
    "sync-outer": ["--mode=sync"],
    "lowbw": LOW_BANDWIDTH,
    "sparse": SETTINGS["sparse"],
    "sparse-up": SETTINGS["sparse-up"],
    "int2": SETTINGS["int2"],
    "sign1": SETTINGS["sign1"],
    "sign1-up": SETTINGS["sign1-up"],
    "sign1-nofb": SETTINGS["sign1-nofb"],
    "sign1-up-nofb": SETTINGS["sign1-up-nofb"],
    "sign1w-nofb": SETTINGS["sign1w-nofb"],
    "sign1-int2": SETTINGS["sign1-int2"],
}


def setting_args(setting: str) -> list[str]:
    """The ``diloco run`` flags of a setting: a named one, or NAME-LR-MU (``outer-0.6-0.7``);
    ``SETTING@LR`` is SETTING with the peak inner learning rate LR (``dp-muon@6e-3``),
    ``SETTING+muon`` with Muon, ``SETTING-HN`` with sync period H = N."""
    if "@" in setting:
        base, _, inner_lr = setting.partition("@")
        return [*setting_args(base), f"--inner-lr={float(inner_lr)}"]
    if setting.endswith("+muon"):
        return [*setting_args(setting.removesuffix("+muon")), "--inner-optimizer=muon"]
    if setting in SETTINGS:
        flags = SETTINGS[setting]
        return flags if setting == "default" or "--mode=dp" in flags else [*PINNED, *flags]
    if setting.endswith("-nodrain"):
        return [*setting_args(setting.removesuffix("-nodrain")), "--drain-timeout=0"]
    base, _, period = setting.rpartition("-H")
    if base and period.isdigit():
        return [*setting_args(base), f"--sync-every={int(period)}"]
    base, _, early = setting.rpartition("-early")
    if base and re.fullmatch(r"\d+for\d+", early):
        h0, cycles = early.split("for")
        return [*setting_args(base), f"--early-sync-every={h0}", f"--early-cycles={cycles}"]
    base, _, decay = setting.rpartition("-olr")
    if base and re.fullmatch(r"\d+to[0-9.]+", decay):
        versions, final = decay.split("to")
        return [*setting_args(base), f"--outer-lr-decay={versions}", f"--outer-lr-final={final}"]
    prefix, _, mu = setting.rpartition("-")
    prefix, _, lr = prefix.rpartition("-")
    try:
        float(lr), float(mu)
    except ValueError:
        prefix = None
    if prefix not in OUTER_PREFIXES:
        known = ", ".join([*SETTINGS, *(f"{k}-LR-MU" for k in OUTER_PREFIXES)])
        raise SystemExit(f"unknown setting {setting!r}; known: {known}")
    return [*PINNED, *OUTER_PREFIXES[prefix], f"--outer-lr={lr}", f"--outer-momentum={mu}"]


DEFAULT_SETTINGS = ("dp", "sync", "sync-H1", "decoupled", "default")


def run(out: Path, setting: str, seed: int, extra: list[str], steps: int = 800) -> dict:
    name = f"{setting}-s{seed}" if steps == 800 else f"{setting}-{steps}-s{seed}"
    run_dir = out / name
    if not (run_dir / "summary.json").exists():
        subprocess.run(
            [sys.executable, "-m", "diloco.cli", "run", "--learners=4", f"--steps={steps}",
             f"--minutes={40 * steps // 800}", f"--seed={seed}", "--eval-every=10", "--no-view",
             "--dashboard=off", f"--runs-dir={out}", f"--name={name}",
             *setting_args(setting), *extra],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    s = json.loads((run_dir / "summary.json").read_text())
    trained = sum(v["steps"] for v in s["per_learner"].values())
    clipped = sum(v.get("clipped_steps", 0) for v in s["per_learner"].values())
    return {
        "setting": setting,
        "steps": steps,
        "seed": seed,
        "val_loss": s["val_loss"]["final"],
        "tokens": s["tokens"],
        "clipped_share": clipped / trained if trained else None,
        "wall_s": s["wall_s"],
        "bytes_per_token": s["bytes"]["per_token"],
        "reduction_vs_dp": s["bytes"].get("reduction_vs_data_parallel"),
        "val_loss_exported": exported_loss(run_dir),
    }


def exported_loss(run_dir: Path) -> float:
    """Held-out loss of the run's exported global model (``diloco export``: the syncer's Θ,
    not the wire image the evaluator and the learners hold; the two differ by what the down
    codec has not sent yet, a rounding for int8, more for topk2)."""
    from safetensors.torch import load_file

    from diloco.config.run import load_run_config
    from diloco.launch.export import export_run
    from diloco.recipes import recipe_of

    path = run_dir / "exported.safetensors"
    if not path.exists():
        export_run(run_dir, path)
    config = load_run_config(run_dir / "config.json")
    recipe = recipe_of(config.recipe)
    model = recipe.build_model(config.recipe.seed)
    model.load_state_dict(load_file(path))
    return recipe.evaluate(model)


def gap_figure(path: Path, rows: list[dict]) -> None:
    """Held-out loss (median over seeds) against tokens per parameter for each setting, and
    each setting's gap to data-parallel at the same budget."""
    import matplotlib.ticker

    from diloco.report.headless import headless_pyplot

    plt = headless_pyplot()

    from diloco.recipes import get_recipe

    params = sum(p.numel() for p in get_recipe("shakespeare").build_model(0).parameters())
    loss: dict[str, dict[float, float]] = {}
    for r in rows:
        same = [
            x["val_loss"] for x in rows if (x["setting"], x["steps"]) == (r["setting"], r["steps"])
        ]
        loss.setdefault(r["setting"], {})[r["tokens"] / params] = statistics.median(same)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for setting, points in loss.items():
        xs = sorted(points)
        (line,) = top.plot(xs, [points[x] for x in xs], marker="o", label=setting)
        if setting != "dp":
            gap = [(x, 100 * (points[x] / loss["dp"][x] - 1)) for x in xs if x in loss["dp"]]
            bottom.plot(*zip(*gap, strict=True), marker="o", color=line.get_color())
    top.set_ylabel("held-out loss (nats/byte)")
    top.legend()
    bottom.axhline(0, color="grey", lw=0.5)
    bottom.set_ylabel("gap to data-parallel (%)")
    bottom.set_xlabel("tokens per parameter")
    bottom.set_xscale("log")
    bottom.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    bottom.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bottom.set_xticks(sorted({x for points in loss.values() for x in points}))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/quality")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--settings",
        default=",".join(DEFAULT_SETTINGS),
        help="comma list of " + ", ".join([*SETTINGS, *(f"{k}-LR-MU" for k in OUTER_PREFIXES)]),
    )
    p.add_argument("--inner-lr", type=float, default=None, help="for every setting")
    p.add_argument(
        "--steps", default="800", help="comma list of steps per learner (the token budget)"
    )
    args = p.parse_args()
    out = Path(args.out)
    extra = [f"--inner-lr={args.inner_lr}"] if args.inner_lr else []
    for setting in args.settings.split(","):
        setting_args(setting)  # an unknown name fails before the first run
    rows = []
    budgets = [int(s) for s in args.steps.split(",")]
    for steps in budgets:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for setting in args.settings.split(","):
                rows.append(run(out, setting, seed, extra, steps))
                print(json.dumps(rows[-1]), flush=True)
    medians = {}
    for steps, setting in [(b, s) for b in budgets for s in args.settings.split(",")]:
        mine = [r for r in rows if r["setting"] == setting and r["steps"] == steps]
        key = setting if steps == 800 else f"{setting}-{steps}"
        measures = (
            "val_loss",
            "val_loss_exported",
            "clipped_share",
            "wall_s",
            "bytes_per_token",
            "reduction_vs_dp",
        )
        medians[key] = {
            k: statistics.median(r[k] for r in mine)
            for k in measures
            if all(r.get(k) is not None for r in mine)
        }
    print(json.dumps(medians, indent=1))
    if len(budgets) > 1 and "dp" in args.settings.split(","):
        gap_figure(out / "gap_vs_budget.png", rows)
    (out / "results.json").write_text(json.dumps({"runs": rows, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
