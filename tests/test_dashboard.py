"""The dashboard's parts without a run: the tallies and the watch on real files, the HTTP
server (its token rules), Prometheus's text and TensorBoard's event files read back by their
own parsers."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from kit import wait_until, wandb_history

from diloco.dashboard.prometheus import exposition
from diloco.dashboard.server import MAX_CONNECTIONS, DashboardServer, json_safe
from diloco.dashboard.tensorboard import ScalarLog
from diloco.dashboard.watch import MAX_POINTS, RunWatch
from diloco.report.tally import JsonlFollower, TapeTally, tape_metrics
from diloco.wire import auth

T0 = 1_000_000.0
SECRET = "s3cret-token-for-the-tests-0123456789"


def write_jsonl(path, records, mode="a"):
    with open(path, mode) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def tape_records():
    """Two learners join, rounds of 1 and 2 learners, a kill, a restart and a rejoin."""
    records = [
        {"event": "start", "t": T0},
        {"event": "join", "t": T0 + 1, "learner": "a", "observer": False, "rejoin": False},
        {"event": "join", "t": T0 + 1, "learner": "b", "observer": False, "rejoin": False},
        {"event": "join", "t": T0 + 1, "learner": "evaluator", "observer": True},
    ]
    for i in range(20):
        both = i % 4 != 0
        records.append(
            {
                "event": "round",
                "t": T0 + 2 + i * 0.5,
                "fragment": i % 4,
                "version": i // 4 + 1,
                "participants": ["a", "b"] if both else ["a"],
                "tokens_by_learner": {"a": 100, "b": 100} if both else {"a": 100},
            }
        )
    records += [
        {"event": "chaos", "t": T0 + 12, "kind": "kill", "target": "b", "down_s": 3.0},
        {"event": "restart", "t": T0 + 15, "target": "b", "warm": True},
        {"event": "join", "t": T0 + 15.5, "learner": "b", "observer": False, "rejoin": True},
        {
            "event": "round",
            "t": T0 + 16,
            "fragment": 0,
            "version": 6,
            "participants": ["a", "b"],
            "tokens_by_learner": {"a": 100, "b": 100},
        },
    ]
    return records


def test_the_follower_reads_only_complete_new_lines_and_starts_over_on_a_new_file(tmp_path):
    path = tmp_path / "f.jsonl"
    follower = JsonlFollower(path)
    assert follower.poll() == []  # no file yet
    path.write_text('{"a": 1}\n{"b": ')
    assert follower.poll() == [{"a": 1}]
    with path.open("a") as f:
        f.write('2}\nnot json\n[1, 2]\n{"c": 3}\n')
    assert follower.poll() == [{"b": 2}, {"c": 3}]  # a torn line and a non-object skipped
    assert follower.poll() == []
    path.write_text('{"d": 4}\n')  # replaced by a shorter file
    assert follower.poll() == [{"d": 4}]


def test_the_tape_tally_counts_rounds_versions_contributions_and_reintegrations():
    tally = TapeTally(fragments=4, bin_s=5.0)
    for r in tape_records():
        tally.add(r)
    assert tally.rounds == 21
    assert tally.contributors == {1: 5, 2: 16}
    assert tally.versions == {0: 6, 1: 5, 2: 5, 3: 5}
    assert tally.contributions == {"a": 21, "b": 16}
    assert tally.joins == {"a": T0 + 1, "b": T0 + 1}  # the observer is not a learner
    assert [m["kind"] for m in tally.markers] == ["kill", "restart", "rejoin"]
    assert tally.reintegrations == [
        {"learner": "b", "restarted_at": T0 + 15, "reintegration_s": 1.0}
    ]
    assert sum(c for c, _ in tally.timeline.values()) == 21


def test_the_watch_snapshot_agrees_with_the_summary_measures(tmp_path):
    tape, metrics = tmp_path / "events.jsonl", tmp_path / "metrics.jsonl"
    progress = {m: tmp_path / f"{m}.jsonl" for m in ("a", "b")}
    records = tape_records()
    write_jsonl(tape, records[:10])
    write_jsonl(metrics, [{"t": 3.0, "val_loss": 5.0, "tokens": 0}])
    for path in progress.values():
        write_jsonl(
            path,
            [
                {
                    "t": T0 + 1 + s,
                    "step": 10 * s,
                    "tokens": 1000 * s,
                    "busy_s": s,
                    "bytes_up": 50 * s,
                    "bytes_down": 90 * s,
                }
                for s in range(20)
            ],
        )
    watch = RunWatch(
        tape=tape,
        fragments=4,
        started=T0,
        name="t",
        budget_s=60.0,
        metrics=metrics,
        progress=progress,
    )
    rows = [{"id": m, "step": 190, "tokens": 19000, "state": "training"} for m in ("a", "b")]
    first = watch.update(rows, now=T0 + 10)
    assert first["rounds"]["total"] == 6
    write_jsonl(tape, records[10:])  # the files grow: only the new records are read
    write_jsonl(
        metrics,
        [
            {"t": 9.0, "val_loss": 3.5, "tokens": 20000},
            {"t": 10.0, "val_loss": float("nan"), "tokens": 21000},
        ],
    )
    snap = watch.update(rows, now=T0 + 20)
    assert snap["rounds"]["total"] == 21
    assert snap["rounds"]["contributors"]["histogram"] == {"1": 5, "2": 16}
    assert snap["versions"] == [6, 5, 5, 5]
    assert [p[:2] for p in snap["loss"]][:2] == [[3.0, 5.0], [9.0, 3.5]]
    a = next(ln for ln in snap["learners"] if ln["id"] == "a")
    assert a["contributions"] == 21 and a["bytes_up"] == 50 * 19 and a["restarts"] == 0
    assert next(ln for ln in snap["learners"] if ln["id"] == "b")["restarts"] == 1
    assert [m["kind"] for m in snap["markers"]] == ["kill", "restart", "rejoin"]
    assert snap["markers"][0]["t"] == pytest.approx(12.0)
    expected = tape_metrics(
        records, fragments=4, end=T0 + 20, speeds={}, rates={"a": 1000.0, "b": 1000.0}
    )
    assert snap["goodput"]["goodput"] == pytest.approx(expected["goodput"])
    assert snap["goodput"]["down_share"] == pytest.approx(expected["down_share"])
    # strict JSON for the browser: the diverged loss becomes null
    text = json.dumps(json_safe(snap), allow_nan=False)
    assert json.loads(text)["loss"][-1][1] is None


def test_a_long_timeline_is_merged_to_at_most_max_points(tmp_path):
    tape = tmp_path / "events.jsonl"
    records = [{"event": "start", "t": T0}]
    records += [{"event": "round", "t": T0 + 7.0 * i, "participants": ["a"]} for i in range(2000)]
    write_jsonl(tape, records)
    snap = RunWatch(tape=tape, fragments=1, started=T0).update([], now=T0 + 14000)
    points = snap["timeline"]["points"]
    assert len(points) <= MAX_POINTS
    width = snap["timeline"]["bin_s"]
    assert sum(p[1] * width for p in points) == pytest.approx(2000)


def get(url, headers=None):
    """(status, headers, body) of a GET, errors included."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def served():
    snap = {"value": 1}
    server = DashboardServer(lambda: snap, bind="127.0.0.1:0", token=SECRET).start()
    yield server, f"http://127.0.0.1:{server.port}"
    server.stop()


def test_the_dashboard_needs_the_token_except_for_health(served):
    server, base = served
    viewer = auth.viewer_token(SECRET)
    assert server.url == f"{base}/?token={viewer}"
    for path in ("/", "/api/snapshot", "/metrics"):
        status, headers, body = get(base + path)
        assert status == 401 and b"missing token" in body
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert get(base + path, {"Authorization": "Bearer wrong-token-0123456789"})[0] == 401
        assert get(base + path + "?token=" + auth.learner_token(SECRET, "a"))[0] == 401
    assert get(base + "/healthz") == (200, get(base + "/healthz")[1], b"ok\n")
    status, _, body = get(base + "/api/snapshot", {"Authorization": f"Bearer {viewer}"})
    assert status == 200 and json.loads(body) == {"value": 1}
    assert get(base + "/api/snapshot", {"Authorization": f"Bearer {SECRET}"})[0] == 200
    # the printed link sets an HTTP-only cookie that the page's requests then carry
    status, headers, body = get(server.url)
    assert status == 200 and b"<title>diloco</title>" in body
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert get(base + "/api/snapshot", {"Cookie": cookie.split(";")[0]})[0] == 200
    assert headers["Referrer-Policy"] == "no-referrer"
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert get(base + "/nope", {"Authorization": f"Bearer {viewer}"})[0] == 404


def test_the_dashboard_is_read_only(served):
    _, base = served
    request = urllib.request.Request(base + "/api/snapshot", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 405


@pytest.mark.timeout(60)
def test_slow_clients_are_cut_at_the_deadline_and_cannot_starve_health():
    server = DashboardServer(dict, bind="127.0.0.1:0", token=SECRET, deadline_s=1.5).start()
    base = f"http://127.0.0.1:{server.port}"
    stop = threading.Event()
    slow = []  # slowloris: more connections than the cap, each sending a byte every 0.2 s

    def dribble():
        while not stop.wait(0.2):
            for s in slow:
                try:
                    s.send(b"X")
                except OSError:
                    pass

    peak = [0]  # the most handler threads alive at once (counted by name: other tests'
    # threads may still be ending, and the dribbler and this sampler are the test's own)

    def sample():
        while not stop.wait(0.005):
            alive = sum(t.name == "dashboard-request" for t in threading.enumerate())
            peak[0] = max(peak[0], alive)

    dribbler = threading.Thread(target=dribble, daemon=True)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
            slow.append(s)
        t0 = time.monotonic()
        dribbler.start()
        time.sleep(0.5)
        # /healthz answers a new client within a few seconds (503 while the cap is full)
        healthy = lambda: _status(base + "/healthz") == 200  # noqa: E731
        wait_until(healthy, 5.0 - (time.monotonic() - t0), "/healthz to answer", interval=0.1)
        # every slow connection is closed by the deadline, however it paces its bytes
        for s in slow:
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        assert time.monotonic() - t0 < 1.5 + 3.0
        # at no moment did more than the cap hold a handler thread
        assert 0 < peak[0] <= MAX_CONNECTIONS, peak[0]
    finally:
        stop.set()
        for s in slow:
            s.close()
        server.stop()


def _status(url) -> int | str:
    """The status of a GET, or the error's name when the connection was cut."""
    try:
        return get(url)[0]
    except (urllib.error.URLError, ConnectionError) as e:
        return type(e).__name__


def test_the_dashboard_refuses_a_network_address_without_a_token_a_busy_port_and_nonsense():
    with pytest.raises(auth.AuthConfigError):
        DashboardServer(dict, bind="0.0.0.0:0")
    with pytest.raises(ValueError, match="HOST:PORT"):
        DashboardServer(dict, bind="nonsense")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            DashboardServer(dict, bind=f"127.0.0.1:{taken.getsockname()[1]}")
    open_server = DashboardServer(lambda: {"ok": True}, bind="127.0.0.1:0").start()
    try:  # on loopback without a token, as the gRPC port
        assert get(f"http://127.0.0.1:{open_server.port}/api/snapshot")[0] == 200
    finally:
        open_server.stop()


def snapshot_of_a_run(tmp_path):
    tape = tmp_path / "events.jsonl"
    write_jsonl(tape, tape_records())
    metrics = tmp_path / "metrics.jsonl"
    write_jsonl(
        metrics,
        [{"t": 5.0, "val_loss": 4.0, "tokens": 1000}, {"t": 15.0, "val_loss": 3.0, "tokens": 5000}],
    )
    watch = RunWatch(tape=tape, fragments=4, started=T0, metrics=metrics)

    def rows(scale):  # without progress files, the watch samples the rows' tokens for speeds
        a = {"id": "a", "step": 50, "tokens": int(5000 * scale), "state": "training"}
        a |= {"steps_per_s": 5.0, "bytes_up": 7, "bytes_down": 9}
        b = {"id": "b", "step": 40, "tokens": int(4000 * scale), "state": "down, restart in 1s"}
        return [a, b]

    assert watch.update(rows(0.5), now=T0 + 18)["goodput"] is None  # no speed known yet
    return watch.update(rows(1), now=T0 + 20)


def test_prometheus_reads_back_the_snapshot(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    snap = snapshot_of_a_run(tmp_path)
    body, kind = exposition(snap)
    assert kind.startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("diloco_rounds_total", ())] == 21
    assert samples[("diloco_tokens_total", ())] == 9000
    assert samples[("diloco_rounds_by_contributors_total", (("learners", "2"),))] == 16
    assert samples[("diloco_fragment_version", (("fragment", "0"),))] == 6
    assert samples[("diloco_heldout_loss", ())] == 3.0
    assert samples[("diloco_learner_contributions_total", (("learner", "b"),))] == 16
    assert samples[("diloco_learner_bytes_total", (("direction", "down"), ("learner", "a")))] == 9
    assert samples[("diloco_learner_live", (("learner", "a"),))] == 1
    assert samples[("diloco_failures_injected_total", (("kind", "kill"),))] == 1
    assert 0 < samples[("diloco_goodput_ratio", ())] <= 1


def test_tensorboard_reads_back_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    snap = snapshot_of_a_run(tmp_path)
    log = ScalarLog(tmp_path / "tb")
    log.write(snap)
    log.write(snap)  # a held-out loss is written once, however often the snapshot is
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "heldout/loss",
        "train/goodput",
        "rounds/total",
        "bytes/up",
        "learner/a/tokens_per_second",
        "learner/b/steps_per_second",
    } <= tags
    losses = [(e.step, e.value) for e in events.Scalars("heldout/loss")]
    assert losses == [(1000, 4.0), (5000, 3.0)]
    assert [e.value for e in events.Scalars("rounds/total")] == [21, 21]
    assert all(math.isfinite(e.value) for e in events.Scalars("train/goodput"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_weights_and_biases_gets_the_same_scalars_as_tensorboard(tmp_path):
    """Issue 36: W&B as an optional logger beside TensorBoard, offline in tests: the same
    points (``scalar_points``), each logged against ``train/tokens``."""
    pytest.importorskip("wandb")
    from diloco.dashboard.tensorboard import scalar_points
    from diloco.dashboard.wandb_log import WandbLog

    snap = snapshot_of_a_run(tmp_path)
    (t, _, tokens), later = snap["loss"][0], snap["loss"][1:]
    snap["loss"] = [snap["loss"][0], (t + 1.0, 3.5, tokens), *later]  # two at one token count
    log = WandbLog(tmp_path / "run", name="run", project="diloco-test", mode="offline")
    log.write(snap)
    log.write(snap)  # a held-out loss is logged once, however often the snapshot is
    log.close()
    [run_file] = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = wait_until(lambda: wandb_history(run_file), 60, "W&B's run file")
    logged = [(row["train/tokens"], k, v) for row in history for k, v in row.items()]
    points, _ = scalar_points(snap, float("-inf"))
    expected = {(p.step, p.tag, p.value) for p in points}
    assert expected <= set(logged)  # every TensorBoard point is in W&B, at its tokens
    losses = [(tokens, v) for tokens, k, v in logged if k == "heldout/loss"]
    assert losses == [(1000, 4.0), (1000, 3.5), (5000, 3.0)]
    with pytest.raises(ValueError, match="--wandb must be one of off, offline, online"):
        WandbLog(tmp_path, name="x", project="p", mode="on")
