"""``diloco plan``: wide-area bandwidth data-parallel and Decoupled DiLoCo need, and the syncer
shards (docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import sys

from diloco.plan import PlanInputs, plan, with_comms
from diloco.plan import parse_count as parse_count  # --params' grammar, where PlanInputs is
from diloco.plan.syncer import syncer_lines
from diloco.runtime.schema import add_options, from_namespace
from diloco.runtime.units import GBIT_S, parse_rate
from diloco.wire.comms import COMMS


def link_rate(text: str) -> float:
    """``--link``: a link rate in bits per second (``diloco.runtime.units.parse_rate``:
    ``1Gbps``, ``200Mbit``, ``50mbit``, ``2.5g``); a bare number is Gbit/s (``0.5``)."""
    try:
        return parse_rate(text, bare_bps=GBIT_S)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="wide-area bandwidth data-parallel and Decoupled DiLoCo need, and the syncer "
        "shards (docs/plan.md)",
        description="diloco plan: wide-area bandwidth data-parallel and Decoupled DiLoCo need, "
        "and how many syncer shards (cores, memory, disk, network) it takes (docs/plan.md). "
        "The exchange's defaults are the paper's setting (H=24, P=24, tau=2, "
        "4-bit values both ways), not this project's default exchange: --comms default prices "
        "that.",
    )
    add_options(p, PlanInputs)
    p.add_argument(
        "--comms",
        choices=tuple(COMMS),
        help="take H and the codecs' bits from this named setting (overrides --sync-every, "
        "--bits, --down-bits)",
    )
    p.add_argument(
        "--link",
        type=link_rate,
        metavar="RATE",
        help="each site's wide-area link in bits/s (1Gbps, 200Mbps, 50mbit as --wan reads them; a bare number is Gbps): say which --comms it needs",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        inputs = from_namespace(PlanInputs, args)
        if args.comms:
            inputs = with_comms(inputs, args.comms)
    except ValueError as exc:
        print(f"diloco plan: error: {exc}", file=sys.stderr)
        return 2
    out = plan(inputs, args.link)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    p = inputs
    print(
        f"{p.params:.3g} parameters, {p.step_time_s:g} s/step, {p.sites} sites, "
        f"utilization target {p.utilization:g}"
    )
    print(
        f"  data-parallel ({p.dp_bits}-bit gradients, ring across sites, {p.dp_overlap:g} of a "
        f"step overlapped): {out['dp_gbps']:.3g} Gbps per site"
    )
    print(
        f"  Decoupled DiLoCo (P={p.num_fragments}, H={p.sync_every}, tau={p.tau:g}, "
        f"{p.up_bits:.3g}-bit up / {p.down_bits:.3g}-bit down): {out['decoupled_gbps']:.3g} Gbps "
        "per site"
    )
    print(f"  ratio {out['ratio']:.0f}x")
    print("  named settings (--comms), per site:")
    for name, gbps in out["comms_gbps"].items():
        print(f"    {name:<8} {gbps:9.3g} Gbps   {COMMS[name].describe()}")
    if args.link is not None:
        pick = out["recommended_comms"]
        rate = f"a {args.link / 1e9:g} Gbps link"
        print(
            f"  {rate}: --comms {pick}"
            if pick
            else f"  {rate} carries none of them: raise --sync-every beyond "
            f"{COMMS['lowest'].sync_every} (and --tau) or add bandwidth"
        )
    for line in syncer_lines(out["syncer"]):
        print(line)
    return 0
