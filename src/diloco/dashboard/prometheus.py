"""The run's snapshot as Prometheus metrics (``/metrics``), in the text exposition format.

Every value is read from the snapshot (``diloco.dashboard.watch``), which is built from the
event tape and the learners' progress records: there is no second bookkeeping. Counters are
totals since the run (or the syncer's tape) began; gauges are the latest value.
"""

from __future__ import annotations

from collections.abc import Iterator

PREFIX = "diloco_"


def exposition(snapshot: dict) -> tuple[bytes, str]:
    """``(body, content type)`` of the metrics page for ``snapshot``."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _SnapshotCollector:
    def __init__(self, snapshot: dict) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.snapshot

        def gauge(name, doc, value=None, labels=()):
            return GaugeMetricFamily(PREFIX + name, doc, value=value, labels=labels or None)

        def counter(name, doc, value=None, labels=()):
            return CounterMetricFamily(PREFIX + name, doc, value=value, labels=labels or None)

        yield gauge("elapsed_seconds", "Seconds since the run started.", s["elapsed_s"])
        yield counter("tokens", "Tokens trained by all learners.", s["tokens"])
        rounds = s["rounds"]
        yield counter("rounds", "Committed rounds (all fragments).", rounds["total"])
        yield gauge("rounds_per_second", "Committed rounds per second, recently.", rounds["per_s"])
        by_size = counter(
            "rounds_by_contributors", "Committed rounds by learners merged.", labels=["learners"]
        )
        for n, count in rounds["contributors"]["histogram"].items():
            by_size.add_metric([n], count)
        yield by_size
        mean = rounds["contributors"]["mean"]
        if mean is not None:
            yield gauge("contributors_per_round", "Mean learners merged per round.", mean)
        versions = gauge("fragment_version", "Committed version per fragment.", labels=["fragment"])
        for p, v in enumerate(s["versions"]):
            versions.add_metric([str(p)], v)
        yield versions
        goodput = s["goodput"] or {}
        for key, doc in (
            ("goodput", "Useful learner compute / provisioned learner compute so far."),
            ("down_share", "Share of provisioned time the failure schedule took."),
            ("goodput_up", "Goodput of the time the learners were up."),
        ):
            if goodput.get(key) is not None:
                yield gauge(f"{key}_ratio", doc, goodput[key])
        if s["loss"]:
            yield gauge("heldout_loss", "Held-out loss of the global model.", s["loss"][-1][1])
        failures = counter("failures_injected", "Injected failures by kind.", labels=["kind"])
        kinds: dict[str, int] = {}
        for m in s["markers"]:
            if m["kind"] not in ("restart", "rejoin"):
                kinds[m["kind"]] = kinds.get(m["kind"], 0) + 1
        for kind, count in sorted(kinds.items()):
            failures.add_metric([kind], count)
        yield failures
        yield from _learner_metrics(s["learners"], gauge, counter)


def _learner_metrics(learners: list[dict], gauge, counter) -> Iterator:
    families = {
        "live": gauge("learner_live", "1 while the learner is live.", labels=["learner"]),
        "step": counter("learner_steps", "Inner steps of the learner.", labels=["learner"]),
        "tokens": counter("learner_tokens", "Tokens the learner trained.", labels=["learner"]),
        "tokens_per_s": gauge(
            "learner_tokens_per_second", "The learner's recent speed.", labels=["learner"]
        ),
        "steps_per_s": gauge(
            "learner_steps_per_second", "The learner's steps per second.", labels=["learner"]
        ),
        "contributions": counter(
            "learner_contributions", "Committed rounds the learner was in.", labels=["learner"]
        ),
        "restarts": counter("learner_restarts", "Restarts of the learner.", labels=["learner"]),
    }
    sent = counter(
        "learner_bytes",
        "Payload bytes at the learner's transport.",
        labels=["learner", "direction"],
    )
    for ln in learners:
        for key, family in families.items():
            family.add_metric([ln["id"]], float(ln[key]))
        sent.add_metric([ln["id"], "up"], ln["bytes_up"])
        sent.add_metric([ln["id"], "down"], ln["bytes_down"])
    yield from families.values()
    yield sent
