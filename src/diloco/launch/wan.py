"""``diloco run --wan SPEC``: the run's processes on shaped wide-area links (``diloco.wan``).

The supervisor makes the :class:`~diloco.wan.fabric.Fabric` (one namespace per learner, a hub
namespace for the syncer), moves itself into the hub namespace (so the syncer, the evaluator
and the status client it starts talk over the hub's own loopback), and starts learner ``i``
inside namespace ``i``, pointed at the syncer's address on link ``i``. The syncer then binds
every address of the hub, with the run's token (``diloco.launch.secrets``). At the end the summary gets a ``wan`` section:
per link, its spec and the bytes at the learner's interface beside the transport's count.
"""

from __future__ import annotations

from diloco.config.run import RunConfig

WAN_BIND_HOST = "0.0.0.0"
"""The syncer binds every address of the hub namespace (one per link)."""


def check_wan(config: RunConfig, clauses) -> None:
    """Refuse (``ValueError``) what cannot run on the harness yet: the Ray backend (its
    workers are not ours to place in namespaces) and network chaos (its relays listen on a
    loopback the learners' namespaces cannot reach). Checks the specs themselves too."""
    from diloco.chaos import NETWORK_KINDS
    from diloco.wan.spec import plan_links

    if not config.wan:
        return
    plan_links(config.wan, config.learners)
    if config.ray.backend != "local":
        raise ValueError("--wan runs on the local backend only (--backend local)")
    kinds = sorted({c.kind for c in clauses if c.kind in NETWORK_KINDS})
    if kinds:
        raise ValueError(
            f"--chaos {','.join(kinds)} is not supported with --wan yet: shape the link instead"
        )


def open_fabric(config: RunConfig):
    """Make the links of ``config.wan`` and move this process into the hub namespace."""
    from diloco.wan.fabric import Fabric

    return Fabric.in_hub(config.wan, config.learners)


def on_link(addresses: str, host: str) -> str:
    """The syncer ``addresses`` (``h:p`` or ``h:p,h:p``) with every host replaced by ``host``:
    ``127.0.0.1`` for the supervisor's own clients, link ``i``'s hub address for learner
    ``i``. Pure."""
    return ",".join(f"{host}:{a.rsplit(':', 1)[1]}" for a in addresses.split(","))


def wan_section(fabric, counters, summary: dict, plans) -> dict:
    """The ``wan`` section of ``summary``: per learner link, the spec and the bytes counted at
    the interface beside the transport's own (payload) count, with their ratio per direction
    (None where the transport does not count that direction: a data-parallel rank counts
    what it sends), and interface bytes per trained token. Pure but for ``fabric``'s specs."""
    per_learner = summary.get("per_learner", {})
    tokens = summary.get("tokens") or 0
    links, totals = {}, {"iface_up": 0, "iface_down": 0, "transport_up": 0, "transport_down": 0}
    for plan in plans:
        count, learner = counters[plan.index], per_learner.get(plan.id, {})
        row = {
            "link": fabric.links[plan.index].describe(),
            "iface_up": count.up,
            "iface_down": count.down,
            "transport_up": int(learner.get("bytes_up", 0)),
            "transport_down": int(learner.get("bytes_down", 0)),
        }
        for key in totals:
            totals[key] += row[key]
        links[plan.id] = {**row, **_ratios(row)}
    return {
        "links": links,
        **totals,
        **_ratios(totals),
        "iface_bytes_per_token": (totals["iface_up"] + totals["iface_down"]) / tokens
        if tokens
        else None,
        "counted": "iface: Ethernet frames at each learner's interface (kernel counters: "
        "payload, gRPC framing, TCP/IP headers, heartbeats, retransmissions); transport: the "
        "process's own count of payload bytes",
    }


def _ratios(row: dict) -> dict:
    def ratio(a: int, b: int) -> float | None:
        return a / b if b else None

    return {
        "up_ratio": ratio(row["iface_up"], row["transport_up"]),
        "down_ratio": ratio(row["iface_down"], row["transport_down"]),
    }
