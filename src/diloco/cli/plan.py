"""``diloco plan``: wide-area bandwidth data-parallel and Decoupled DiLoCo need (docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import sys

from diloco.plan import PlanInputs, plan, with_comms
from diloco.runtime.units import GBIT_S, parse_rate
from diloco.wire.comms import COMMS


def parse_count(text: str) -> float:
    """``12e9``, ``12B``, ``350M``, ``70b`` → a parameter count."""
    t = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    if scale != 1.0:
        t = t[:-1]
    try:
        return float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count (e.g. 12B, 350M)"
        ) from None


def link_rate(text: str) -> float:
    """``--link``: a link rate in bits per second (``diloco.runtime.units.parse_rate``:
    ``1Gbps``, ``200Mbit``, ``50mbit``, ``2.5g``); a bare number is Gbit/s (``0.5``)."""
    try:
        return parse_rate(text, bare_bps=GBIT_S)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers) -> None:
    d = PlanInputs(params=1, step_time_s=1)
    p = subparsers.add_parser(
        "plan",
        help="wide-area bandwidth data-parallel and Decoupled DiLoCo need (docs/plan.md)",
        description=__doc__.splitlines()[0].strip('`" '),
    )
    p.add_argument("--params", type=parse_count, required=True, help="e.g. 12B")
    p.add_argument("--step-time", type=float, required=True, help="seconds per step")
    p.add_argument("--sites", type=int, default=d.sites, help="data centres (learners or DP sites)")
    p.add_argument("--dp-bits", type=int, default=d.dp_bits, help="data-parallel gradient bits")
    p.add_argument("--bits", type=int, default=d.up_bits, help="learner upload bits (int4: 4)")
    p.add_argument("--down-bits", type=int, default=d.down_bits, help="syncer download bits")
    p.add_argument("--fragments", type=int, default=d.num_fragments, help="P")
    p.add_argument("--sync-every", type=int, default=d.sync_every, help="H")
    p.add_argument("--tau", type=float, default=d.tau, help="overlap in steps")
    p.add_argument("--utilization", type=float, default=d.utilization, help="target, in (0, 1)")
    p.add_argument("--dp-overlap", type=float, default=d.dp_overlap, help="in [0, 1]")
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
        inputs = PlanInputs(
            params=args.params,
            step_time_s=args.step_time,
            sites=args.sites,
            dp_bits=args.dp_bits,
            up_bits=args.bits,
            down_bits=args.down_bits,
            num_fragments=args.fragments,
            sync_every=args.sync_every,
            tau=args.tau,
            utilization=args.utilization,
            dp_overlap=args.dp_overlap,
        )
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
    return 0
