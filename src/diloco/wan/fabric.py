"""Wide-area links made by the kernel: one network namespace per learner, joined to the syncer's.

Topology (``i`` = learner index, every name owned by this process's pid)::

    learner ns dlc<pid>l<i>             hub ns dlc<pid>h (syncer, supervisor, evaluator)
    wan0 198.18.x.2/30  ==veth==  h<i>  [delay bridge]  x<i> ==veth== y<i> 198.18.x.1/30

* **Rate**: a ``tbf`` qdisc on each sending end of the link: the learner's ``wan0`` (up) and
  the hub's ``y<i>`` (down; ``h<i>`` when there is no delay). Shaping where the traffic is
  made lets TCP feel the limit at once, as it would at a WAN router's queue.
* **Round trip**: ``netem`` does not exist in this kernel, so the delay is user space: a bridge
  process (:mod:`diloco.wan.bridge`) holds every frame between ``h<i>`` and ``x<i>`` for
  rtt/2 in each direction. Without a round trip there is no bridge and ``h<i>`` holds the
  hub's address. The delay is applied after the shaping, so queueing at the rate limit
  adds to it as on a real path.
* **Addresses**: only inside namespaces made here, in 198.18.0.0/15 (RFC 2544's benchmarking
  range): link ``i`` is the /30 at ``198.18.0.0 + 4i``. The hub routes between links, so
  learners (or data-parallel ranks) reach each other through it over two shaped links.

:class:`Fabric` makes all of it, counts bytes at every learner's interface, and removes it
on :meth:`Fabric.close` (also on the way out of a ``with``). A crashed owner leaves its
namespaces behind: :func:`sweep_leftovers` (called by every new :class:`Fabric`) removes the
namespaces whose owner pid is gone, and the processes inside them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from diloco.wan.spec import LinkSpec

PREFIX = "dlc"
NETWORK = ipaddress.ip_network("198.18.0.0/15")
LEARNER_IFACE = "wan0"
CLONE_NEWNET = 0x40000000
_OWNED = re.compile(rf"^{PREFIX}(\d+)[hl]\d*$")


class WanUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no ``ip``/``tc``)."""


def check_available() -> None:
    """Raise :class:`WanUnavailable` with what is missing, or return."""
    if os.geteuid() != 0:
        raise WanUnavailable(
            "--wan makes network namespaces and shapes links with tc: run as root "
            "(or with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise WanUnavailable(f"--wan needs the {tool!r} command (iproute2)")


def link_addresses(i: int) -> tuple[str, str]:
    """(hub, learner) address of link ``i``: the /30 at 198.18.0.0 + 4i. Pure."""
    base = NETWORK.network_address + 4 * i
    if base + 3 > NETWORK.broadcast_address:
        raise ValueError(f"link {i}: more links than 198.18.0.0/15 holds")
    return str(base + 1), str(base + 2)


def tbf_args(bps: float) -> list[str]:
    """``tc`` arguments of a token bucket at ``bps``: a burst of 4 ms at the rate (at least
    two full frames, so the bucket never starves a frame) and 100 ms of queue. Pure."""
    burst = max(32 * 1024, int(bps / 8 * 0.004))
    return ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "100ms"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise WanUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20
    )
    if done.returncode != 0:
        raise WanUnavailable(f"tc {' '.join(args)} in {ns}: {done.stderr.strip()}")


def _sysctl(ns: str, key: str, value: str) -> None:
    path = "/proc/sys/" + key.replace(".", "/")
    subprocess.run(
        ["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > {path}"],
        capture_output=True,
        timeout=20,
        check=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned_namespaces() -> dict[str, int]:
    """Every namespace this harness made, by name, with its owner's pid."""
    if shutil.which("ip") is None:
        return {}
    listed = _ip("netns", "list", check=False).stdout.split()
    return {name: int(m.group(1)) for name in listed if (m := _OWNED.match(name))}


def remove_namespace(name: str) -> None:
    """Kill every process inside namespace ``name``, then delete it (veths go with it)."""
    for pid in _ip("netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)


def sweep_leftovers() -> list[str]:
    """Remove the namespaces of owners that are gone (a crashed run); returns their names."""
    gone = [name for name, pid in owned_namespaces().items() if not _alive(pid)]
    for name in sorted(gone, key=lambda n: n.endswith("h")):  # learners before the hub
        remove_namespace(name)
    return gone


@dataclass
class LinkCounters:
    """Bytes at a learner's interface: ``up`` sent by the learner, ``down`` received."""

    up: int
    down: int


class Fabric:
    """The namespaces, links, shaping and delay bridges for ``links`` (one per learner)."""

    def __init__(self, links: list[LinkSpec], *, owner: int | None = None) -> None:
        check_available()
        sweep_leftovers()
        self.links = list(links)
        self.owner = owner or os.getpid()
        self.hub = f"{PREFIX}{self.owner}h"
        self.bridges: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._home: int | None = None
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- names
    def namespace(self, i: int) -> str:
        return f"{PREFIX}{self.owner}l{i}"

    def hub_address(self, i: int) -> str:
        """The syncer's address as learner ``i`` reaches it."""
        return link_addresses(i)[0]

    def learner_address(self, i: int) -> str:
        return link_addresses(i)[1]

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it in learner ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def hub_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.hub]

    # ------------------------------------------------------------------ make
    def _namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        for key in ("net.ipv6.conf.all.disable_ipv6", "net.ipv6.conf.default.disable_ipv6"):
            _sysctl(name, key, "1")  # no router solicitations in the byte counts

    def _make(self) -> None:
        self._namespace(self.hub)
        _sysctl(self.hub, "net.ipv4.ip_forward", "1")
        for i, link in enumerate(self.links):
            self._make_link(i, link)

    def _make_link(self, i: int, link: LinkSpec) -> None:
        ns, hub = self.namespace(i), self.hub
        hub_ip, learner_ip = link_addresses(i)
        self._namespace(ns)
        _ip(
            "-n",
            hub,
            "link",
            "add",
            f"h{i}",
            "type",
            "veth",
            "peer",
            "name",
            LEARNER_IFACE,
            "netns",
            ns,
        )
        _ip("-n", ns, "addr", "add", f"{learner_ip}/30", "dev", LEARNER_IFACE)
        _ip("-n", ns, "link", "set", LEARNER_IFACE, "up")
        _ip("-n", hub, "link", "set", f"h{i}", "up")
        hub_end = f"h{i}"
        if link.rtt_s > 0:
            hub_end = f"y{i}"
            _ip("-n", hub, "link", "add", f"x{i}", "type", "veth", "peer", "name", hub_end)
            for dev in (f"x{i}", hub_end):
                _ip("-n", hub, "link", "set", dev, "up")
        _ip("-n", hub, "addr", "add", f"{hub_ip}/30", "dev", hub_end)
        _ip("-n", ns, "route", "add", "default", "via", hub_ip)
        if link.up_bps is not None:
            _tc(ns, "qdisc", "add", "dev", LEARNER_IFACE, "root", *tbf_args(link.up_bps))
        if link.down_bps is not None:
            _tc(hub, "qdisc", "add", "dev", hub_end, "root", *tbf_args(link.down_bps))
        if link.rtt_s > 0:
            self._start_bridge(f"h{i}", f"x{i}", link.rtt_s / 2)

    def _start_bridge(self, a: str, b: str, one_way_s: float) -> None:
        command = [
            *self.hub_prefix(),
            sys.executable,
            "-m",
            "diloco.cli.wan_bridge",
            a,
            b,
            f"--delay-ms={one_way_s * 1e3}",
        ]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.bridges.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""  # "ready", or EOF if it failed
        if line.strip() != "ready":
            err = proc.stderr.read() if proc.stderr else ""
            raise WanUnavailable(f"the delay bridge {a}<->{b} did not start: {err.strip()}")

    # --------------------------------------------------------------- measure
    def counters(self) -> list[LinkCounters]:
        """Bytes at each learner's ``wan0`` since the link was made (the kernel's counters,
        Ethernet frames: payload plus TCP/IP and Ethernet headers, retransmissions included)."""
        out = []
        for i in range(len(self.links)):
            shown = _ip("-n", self.namespace(i), "-s", "-j", "link", "show", "dev", LEARNER_IFACE)
            stats = json.loads(shown.stdout)[0]["stats64"]
            out.append(LinkCounters(up=int(stats["tx"]["bytes"]), down=int(stats["rx"]["bytes"])))
        return out

    # ----------------------------------------------------------- enter/leave
    @classmethod
    def in_hub(cls, specs: list[str], learners: int) -> Fabric:
        """The links of ``--wan`` ``specs`` for ``learners``, with this process moved into the
        hub namespace (what a launcher does first); everything is removed if that fails."""
        from diloco.wan.spec import plan_links

        fabric = cls(plan_links(specs, learners))
        try:
            fabric.enter_hub()
        except BaseException:
            fabric.close()
            raise
        return fabric

    def enter_hub(self) -> None:
        """Move this thread (and every thread and process it starts afterwards) into the hub
        namespace. Call it before any thread that uses the network starts."""
        libc = ctypes.CDLL(None, use_errno=True)
        self._home = os.open("/proc/self/ns/net", os.O_RDONLY)
        fd = os.open(f"/var/run/netns/{self.hub}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise WanUnavailable(f"setns({self.hub}): {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)

    def leave_hub(self) -> None:
        if self._home is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns(self._home, CLONE_NEWNET)
        os.close(self._home)
        self._home = None

    def close(self) -> None:
        """Stop the bridges and delete every namespace made (idempotent)."""
        for proc in self.bridges:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in self.bridges:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        self.bridges.clear()
        self.leave_hub()
        for name in reversed(self._made):
            remove_namespace(name)
        self._made.clear()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
