"""One run, several clusters: a standalone syncer and learners from a Slurm array, a Ray
cluster and a hand-started process, each site behind its own shaped wide-area link.

    python benchmarks/bench_across_clusters.py --out bench/across/s0 --seed 0  # root; ~4 min
    python benchmarks/bench_across_clusters.py --report bench/across/s*/across.json  # medians

**What runs** (the recipe of docs/deploy.md, "Across clusters", on one machine):

* the links: one network namespace per site, each joined to the hub's by its own link, shaped
  by the kernel (``tbf``) with a user-space round trip (``diloco.wan.fabric``; ``--links``);
* the hub: ``diloco syncer --bind 0.0.0.0:0 --token-file ...`` (a standalone syncer, the
  recipe of --recipe) in the hub's namespace;
* site ``slurm``: a Slurm cluster (``deploy/slurm/local-cluster.sh``) runs
  ``deploy/slurm/learner.sbatch`` as a 2-task array, each learner under
  ``DILOCO_WRAP="ip netns exec <site's namespace>"``;
* site ``ray``: a Ray cluster (``ray start --head``) runs ``deploy/ray/learners.py`` (2
  learners, ``--wrap "ip netns exec <site's namespace>"``);
* site ``hand``: one ``diloco learner`` started by hand in its site's namespace.

Every learner stops cleanly at one deadline. In the middle of the run one site (``--cut``)
loses its link for ``--cut-s`` seconds (``ip link set wan0 down`` in its namespace): its
learners train on, offline, and deliver when the link is back.

**Measures**: rounds committed, per phase (before the cut, during it, after it, until the sites are
stopped) and per site (rounds that merged one of its learners); how long after its link is
back the cut site is in a committed round again; bytes at each site's interface (the kernel's
counters), per phase; each learner's steps; the exactly-once audit of every step
(``diloco.report.audit_files``). Written to ``OUT/across.json`` and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco.report.audit_files import audit_directories
from diloco.runtime.jsonl import read_jsonl
from diloco.wan.fabric import LEARNER_IFACE, Fabric
from diloco.wan.spec import parse_link

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TOKEN = "across-clusters-bench-token-0123456789"


@dataclass(frozen=True)
class Site:
    name: str
    learners: int
    link: str


SITES = (Site("slurm", 2, "rate=20mbit,rtt=40ms"), Site("ray", 2, "rate=10mbit,rtt=80ms"))
HAND = Site("hand", 1, "rate=2mbit,rtt=150ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def learner_ids(sites: list[Site]) -> list[tuple[Site, str, int]]:
    """(site, learner id, data index) of every learner, the indices numbered across sites."""
    out, index = [], 0
    for site in sites:
        for k in range(site.learners):
            out.append((site, f"{site.name}-{k}", index))
            index += 1
    return out


class Bench:
    """Everything started for one run, stopped in :meth:`close` whatever happened."""

    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.sites = [*SITES, HAND]
        self.procs: list[subprocess.Popen] = []
        self.slurm_dir: Path | None = None
        self.slurm_env: dict[str, str] = {}
        self.ray_started = False
        self.fabric: Fabric | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        self.token = self.out / "token"
        self.token.write_text(TOKEN)
        self.token.chmod(0o600)
        self.fabric = Fabric([parse_link(s.link) for s in self.sites])
        port_file = self.out / "syncer.at"
        self.syncer = self.spawn(
            "syncer",
            [
                *self.fabric.hub_prefix(),
                *self.diloco("syncer"),
                "--bind=0.0.0.0:0",
                f"--port-file={port_file}",
                f"--state-dir={self.out / 'state'}",
                f"--token-file={self.token}",
                f"--seed={self.args.seed}",
                f"--recipe={self.args.recipe}",
                "--threads=1",
            ],
        )
        self.port = wait_for(
            lambda: port_file.exists() and port_file.read_text().strip().rsplit(":", 1)[1],
            60,
            "the syncer to serve",
        )
        # A safety net only: the bench stops every site itself (:meth:`stop_sites`).
        self.deadline = time.time() + self.args.warmup_s + self.args.seconds + 120
        self.start_slurm(self.sites[0], 0)
        self.start_ray(self.sites[1], 1)
        self.start_hand(self.sites[2], 2)

    def diloco(self, *argv: str) -> list[str]:
        return [sys.executable, "-m", "diloco.cli", *argv]

    def learner_flags(self) -> list[str]:
        return [
            f"--recipe={self.args.recipe}",
            f"--seed={self.args.seed}",
            f"--total-steps={self.args.max_steps}",
            f"--slow={self.args.slow}",
            f"--deadline={self.deadline}",
            "--threads=1",
            "--checkpoint-every=5",
        ]

    def spawn(self, name: str, argv: list[str], env=None) -> subprocess.Popen:
        log = (self.out / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self.procs.append(proc)
        return proc

    def address(self, link: int) -> str:
        return f"{self.fabric.hub_address(link)}:{self.port}"

    def start_slurm(self, site: Site, link: int) -> None:
        self.slurm_dir = self.out / "slurm-cluster"
        script = str(ROOT / "deploy" / "slurm" / "local-cluster.sh")
        subprocess.run(
            [script, "start", str(self.slurm_dir)], check=True, capture_output=True, timeout=60
        )
        home = self.out / site.name
        home.mkdir()
        shutil.copy(self.token, home / "token")
        self.slurm_env = {
            **os.environ,
            "SLURM_CONF": str(self.slurm_dir / "slurm.conf"),
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "DILOCO_HOME": str(home),
            "DILOCO_SYNCER": self.address(link),
            "DILOCO_RECIPE": self.args.recipe,
            "DILOCO_ID_PREFIX": f"{site.name}-",
            "DILOCO_INDEX_OFFSET": "0",
            "DILOCO_WRAP": " ".join(self.fabric.exec_prefix(link)),
            "DILOCO_LEARNER_ARGS": " ".join(self.learner_flags()[1:]),
        }
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--cpus-per-task=1",
                f"--chdir={home}",
                f"--array=0-{site.learners - 1}",
                str(ROOT / "deploy" / "slurm" / "learner.sbatch"),
            ],
            env=self.slurm_env,
            check=True,
            capture_output=True,
            timeout=30,
        )

    def start_ray(self, site: Site, link: int) -> None:
        ray_port = free_port()
        # Ray 2.60 authenticates with a token (~/.ray/auth_token, made if missing) when the
        # mode is "token"; the cluster and the site's script must agree on the mode.
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
        subprocess.run(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                f"--port={ray_port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=2",
                "--object-store-memory=100000000",
                f'--resources={{"{site.name}": 1}}',
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            check=True,
            capture_output=True,
            timeout=120,
            env=env,
        )
        self.ray_started = True
        self.ray_site = self.spawn(
            "ray-site",
            [
                sys.executable,
                str(ROOT / "deploy" / "ray" / "learners.py"),
                f"--address=127.0.0.1:{ray_port}",
                f"--syncer={self.address(link)}",
                f"--token-file={self.token}",
                f"--learners={site.learners}",
                f"--first-index={SITES[0].learners}",
                f"--id-prefix={site.name}-",
                f"--workdir={self.out / site.name}",
                f"--resource={site.name}",
                f"--wrap={' '.join(self.fabric.exec_prefix(link))}",
                "--",
                *self.learner_flags(),
            ],
            env=env,
        )

    def start_hand(self, site: Site, link: int) -> None:
        first = sum(s.learners for s in self.sites[:link])
        self.hand = self.spawn(
            "hand-0",
            [
                *self.fabric.exec_prefix(link),
                *self.diloco("learner"),
                f"--syncer={self.address(link)}",
                f"--token-file={self.token}",
                f"--id={site.name}-0",
                f"--index={first}",
                f"--workdir={self.out / site.name / '0'}",
                *self.learner_flags(),
            ],
        )

    # ---------------------------------------------------------------- measure
    def tape(self) -> list[dict]:
        path = self.out / "state" / "events.jsonl"
        return read_jsonl(path) if path.exists() else []

    def joined(self) -> set[str]:
        return {p for r in self.tape() if r.get("event") == "round" for p in r["participants"]}

    def counters(self) -> list[dict]:
        return [{"up": c.up, "down": c.down} for c in self.fabric.counters()]

    def set_link(self, link: int, up: bool) -> None:
        subprocess.run(
            ["ip", "-n", self.fabric.namespace(link), "link", "set", LEARNER_IFACE]
            + ["up" if up else "down"],
            check=True,
            timeout=20,
        )
        if up:  # the route through the link went with it
            subprocess.run(
                ["ip", "-n", self.fabric.namespace(link), "route", "replace", "default", "via"]
                + [self.fabric.hub_address(link)],
                check=True,
                timeout=20,
            )

    def run(self) -> dict:
        everyone = {lid for _, lid, _ in learner_ids(self.sites)}
        wait_for(
            lambda: self.check_alive() and everyone <= self.joined(),
            self.args.warmup_s,
            "every learner to commit",
        )
        marks = {"joined": (time.time(), self.counters())}
        cut = [s.name for s in self.sites].index(self.args.cut)
        time.sleep(self.args.before_s)
        marks["cut"] = (time.time(), self.counters())
        self.set_link(cut, up=False)
        time.sleep(self.args.cut_s)
        self.set_link(cut, up=True)
        marks["back"] = (time.time(), self.counters())
        time.sleep(max(0.0, self.args.seconds - self.args.before_s - self.args.cut_s))
        marks["stop"] = (time.time(), self.counters())
        self.stop_sites()
        wait_for(self.learners_done, 120, "every learner to stop")
        marks["end"] = (time.time(), self.counters())
        self.syncer.send_signal(signal.SIGTERM)
        self.syncer.wait(timeout=60)
        return self.report(marks)

    def stop_sites(self) -> None:
        """SIGTERM every learner the way its site stops it: Slurm cancels the array (each
        learner flushes and exits 0), the Ray site's script stops its actors, the hand-started
        learner is signalled."""
        subprocess.run(["scancel", "--user=root"], env=self.slurm_env, check=True, timeout=30)
        self.ray_site.send_signal(signal.SIGTERM)
        self.hand.send_signal(signal.SIGTERM)

    def check_alive(self) -> bool:
        for name, proc in (
            ("syncer", self.syncer),
            ("ray-site", self.ray_site),
            ("hand-0", self.hand),
        ):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}: see {self.out / name}.log")
        return True

    def learners_done(self) -> bool:
        squeue = subprocess.run(
            ["squeue", "-h"], env=self.slurm_env, capture_output=True, text=True, timeout=30
        )
        return (
            squeue.stdout.strip() == ""
            and self.hand.poll() is not None
            and (self.ray_site.poll() is not None)
        )

    def workdirs(self) -> dict[str, Path]:
        out = {}
        for site, lid, _ in learner_ids(self.sites):
            k = lid.rsplit("-", 1)[1]
            out[lid] = self.out / site.name / ("learners" if site.name == "slurm" else "") / k
        return out

    def report(self, marks: dict) -> dict:
        tape = self.tape()
        rounds = [r for r in tape if r.get("event") == "round"]
        names = ["joined", "cut", "back", "stop"]
        phases = {}
        for a, b, label in zip(names, names[1:], ("before", "cut", "after"), strict=False):
            (t0, c0), (t1, c1) = marks[a], marks[b]
            inside = [r for r in rounds if t0 <= r["t"] < t1]
            phases[label] = {
                "seconds": round(t1 - t0, 1),
                "rounds": len(inside),
                "rounds_per_min": round(len(inside) / (t1 - t0) * 60, 1),
                "sites": {
                    site.name: {
                        "rounds": sum(
                            any(p.startswith(f"{site.name}-") for p in r["participants"])
                            for r in inside
                        ),
                        "up_bytes": c1[i]["up"] - c0[i]["up"],
                        "down_bytes": c1[i]["down"] - c0[i]["down"],
                    }
                    for i, site in enumerate(self.sites)
                },
            }
        verdict = audit_directories(self.out / "state", self.workdirs(), stopped_cleanly=True)
        steps = {}
        for lid, workdir in self.workdirs().items():
            final = workdir / "final.json"
            steps[lid] = json.loads(final.read_text())["step"] if final.exists() else None
        back = marks["back"][0]
        rejoined = [
            r["t"] - back
            for r in rounds
            if r["t"] >= back and any(p.startswith(f"{self.args.cut}-") for p in r["participants"])
        ]
        return {
            "seed": self.args.seed,
            "recipe": self.args.recipe,
            "cut_site_back_in_a_round_after_s": round(rejoined[0], 2) if rejoined else None,
            "links": {s.name: s.link for s in self.sites},
            "cut": self.args.cut,
            "cut_s": self.args.cut_s,
            "rounds": len(rounds),
            "phases": phases,
            "steps": steps,
            "bytes_per_site": {
                s.name: {
                    "up": marks["end"][1][i]["up"],
                    "down": marks["end"][1][i]["down"],
                }
                for i, s in enumerate(self.sites)
            },
            "audit": {
                "ok": verdict.ok,
                "problems": verdict.problems[:10],
                "commits": verdict.commits,
                "lives": verdict.lives,
            },
        }

    # ------------------------------------------------------------------- stop
    def close(self) -> None:
        if self.slurm_dir is not None:
            script = str(ROOT / "deploy" / "slurm" / "local-cluster.sh")
            subprocess.run([script, "stop", str(self.slurm_dir)], capture_output=True, timeout=90)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self.ray_started:
            subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=60)
        if self.fabric is not None:
            self.fabric.close()


def table(result: dict) -> str:
    lines = [
        "| phase | s | rounds/min | "
        + " | ".join(f"{s} rounds, up/down MB" for s in result["links"])
        + " |",
        "|---|---|---|" + "---|" * len(result["links"]),
    ]
    for label, phase in result["phases"].items():
        cells = [
            f"{v['rounds']}, {v['up_bytes'] / 1e6:.2f}/{v['down_bytes'] / 1e6:.2f}"
            for v in phase["sites"].values()
        ]
        lines.append(
            f"| {label} | {phase['seconds']} | {phase['rounds_per_min']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def medians(paths: list[Path]) -> str:
    """The median over runs (``across.json`` files) of each phase's rounds per minute and of
    each site's rounds and bytes per phase, as :func:`table` draws one run."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    median = statistics.median
    first = runs[0]
    for label, phase in first["phases"].items():
        phase["seconds"] = median(r["phases"][label]["seconds"] for r in runs)
        phase["rounds_per_min"] = median(r["phases"][label]["rounds_per_min"] for r in runs)
        for site, cell in phase["sites"].items():
            for key in cell:
                cell[key] = median(r["phases"][label]["sites"][site][key] for r in runs)
    back = [r["cut_site_back_in_a_round_after_s"] for r in runs]
    ok = sum(r["audit"]["ok"] for r in runs)
    return (
        f"{len(runs)} runs (medians); the cut site back in a committed round after "
        f"{median(b for b in back if b is not None):.1f} s (each: {back}); exactly-once audit "
        f"passed in {ok} of {len(runs)}; rounds in all: {[r['rounds'] for r in runs]}\n\n"
        + table(first)
    )


def main() -> int:
    if sys.argv[1:2] == ["--report"]:
        print(medians([Path(a) for a in sys.argv[2:]]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/across")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", default="shakespeare")
    p.add_argument("--warmup-s", type=float, default=90.0, help="bound on every learner joining")
    p.add_argument("--seconds", type=float, default=150.0, help="training once all joined")
    p.add_argument("--before-s", type=float, default=40.0, help="all sites, before the cut")
    p.add_argument("--cut", default="ray", choices=[s.name for s in (*SITES, HAND)])
    p.add_argument("--cut-s", type=float, default=30.0)
    p.add_argument("--slow", type=float, default=4.0, help="each learner's --slow")
    p.add_argument("--max-steps", type=int, default=100_000)
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench_across_clusters: needs root (namespaces, Slurm)", file=sys.stderr)
        return 2
    bench = Bench(args)
    try:
        bench.start()
        result = bench.run()
    finally:
        bench.close()
    (bench.out / "across.json").write_text(json.dumps(result, indent=1))
    keys = ("rounds", "cut_site_back_in_a_round_after_s", "steps", "bytes_per_site", "audit")
    print(json.dumps({k: result[k] for k in keys}))
    print(table(result))
    return 0 if result["audit"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
