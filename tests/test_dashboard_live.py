"""The dashboard of a real run: ``diloco run`` in a subprocess (a real syncer, two learners, a
real ``kill -9``), its page driven by a real headless Chromium (Debian's, through playwright;
never a downloaded browser), its ``/metrics`` scraped during the run, its TensorBoard
scalars and its report read after it; and a standalone ``diloco syncer --dashboard``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kit import (
    GrowingTape,
    diloco_command,
    run_diloco,
    start_diloco,
    stop_when,
    wait_until,
    wandb_history,
)

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: How long the scrape waits for the learners' next progress report to raise the tokens
#: trained (they report every few seconds on an idle machine, less often on a loaded one).
METRICS_GROW_S = 40


def stop(proc) -> None:
    """End ``proc`` if it still runs: SIGTERM (it stops cleanly), SIGKILL after 30 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def scrape(url: str, token: str | None) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A run of at most 45 seconds with a kill; yields (process, run directory, dashboard
    link). The last test ends it once the killed learner has rejoined."""
    runs = tmp_path_factory.mktemp("live")
    proc = start_diloco(
        "run",
        "--recipe=tiny",
        "--learners=2",
        "--minutes=0.75",
        "--eval-every=2",
        "--chaos=kill:at=6s,down=2s",
        f"--runs-dir={runs}",
        "--name=live",
        "--no-view",
        *(["--wandb=offline"] if importlib.util.find_spec("wandb") else []),
    )
    run_dir = runs / "live"
    try:
        url = wait_until(
            lambda: (
                (run_dir / "dashboard.url").is_file()
                and (run_dir / "dashboard.url").read_text().strip()
            ),
            60,
            "the dashboard link",
        )
        yield proc, run_dir, url
    finally:
        stop(proc)


@pytest.mark.timeout(120)
def test_the_page_shows_the_learners_of_the_running_job_and_updates(live_run):
    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium (make test installs it as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    _, run_dir, url = live_run
    assert (run_dir / "dashboard.url").stat().st_mode & 0o077 == 0  # it holds the token
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            for learner in ("learner-0", "learner-1"):
                page.wait_for_selector(f"#learners tr[data-learner='{learner}']", timeout=30_000)
            assert "token=" not in page.url  # dropped from the address bar, kept in a cookie
            page.wait_for_selector("#learners td:has-text('training')", timeout=30_000)
            seen = int(page.get_attribute("body", "data-updates"))
            tokens = int(page.inner_text("#tokens").replace(",", ""))
            elapsed = page.inner_text("#elapsed")
            page.wait_for_selector(f"body[data-updates='{seen + 3}']", timeout=15_000)
            assert int(page.inner_text("#tokens").replace(",", "")) > tokens
            assert page.inner_text("#elapsed") != elapsed
            assert page.locator("#loss-chart svg path").count() == 1
            assert float(page.inner_text("#loss-now")) > 0
            # the injected kill and the learners' comeback reach the page's time axis
            page.wait_for_selector("#events li[data-kind='kill']", timeout=40_000)
            page.wait_for_selector("#events li[data-kind='rejoin']", timeout=40_000)
            assert page.locator("#loss-chart line.marker[data-kind='kill']").count() >= 1
            page.reload()  # the cookie opens the page again without the link's token
            page.wait_for_selector("#learners tr[data-learner='learner-0']", timeout=15_000)
        finally:
            browser.close()


@pytest.mark.timeout(60)
def test_metrics_are_scraped_during_the_run(live_run):
    proc, run_dir, url = live_run
    assert proc.poll() is None, "the run ended before its metrics were scraped"
    base, token = url.split("?token=")
    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape(base + "metrics", None)
    assert refused.value.code == 401
    tokens = ("diloco_tokens_total", ())
    first = scrape(base + "metrics", token)

    learners = ("learner-0", "learner-1")

    def learner_tokens(scraped: dict, learner: str) -> float:
        return scraped.get(("diloco_learner_tokens_total", (("learner", learner),)), 0.0)

    def grown() -> dict | None:
        now = scrape(base + "metrics", token)
        reported = all(learner_tokens(now, learner) > 0 for learner in learners)
        return now if now[tokens] > first[tokens] and reported else None

    # The tokens trained grow with the learners' next progress report: wait for it, not for a
    # fixed window (on a loaded machine 3 s once saw none). A learner restarted by the kill
    # counts its tokens from 0 again until its first report after the restart (a counter
    # reset, as a restarted process's counters are): wait for that report too.
    second = wait_until(grown, METRICS_GROW_S, f"{tokens[0]} to grow", interval=0.5, alive=proc)
    assert second[("diloco_rounds_total", ())] > 0
    for learner in learners:
        assert second[("diloco_learner_tokens_total", (("learner", learner),))] > 0
        assert second[("diloco_learner_contributions_total", (("learner", learner),))] > 0
    versions = [v for (name, _), v in second.items() if name == "diloco_fragment_version"]
    assert len(versions) == 24 and sum(versions) > 0


@pytest.mark.timeout(120)
def test_the_finished_run_leaves_tensorboard_scalars_and_a_report(live_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc, run_dir, url = live_run
    tape = GrowingTape(run_dir / "syncer" / "events.jsonl")
    stop_when(proc, tape, killed_learner_rejoined, 100, "the kill's rejoin")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    assert f"dashboard: {url}" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"goodput {100 * summary['goodput']:.1f}%" in out  # the printed summary says it
    for learner in ("learner-0", "learner-1"):  # a learner's log says what it does
        log = (run_dir / "logs" / f"{learner}.log").read_text()
        assert f"learner {learner}: training from step 0 (syncer " in log
        assert re.search(rf"learner {learner}: step \d+, [\d,]+ tokens, loss \d", log)
        assert f"learner {learner}: stopped; step " in log
    with pytest.raises(OSError):  # the dashboard stopped with the run
        urllib.request.urlopen(url, timeout=2)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("heldout/loss")]
    assert losses == pytest.approx([m["val_loss"] for m in metrics], rel=1e-6)
    assert events.Scalars("train/tokens")[-1].value == summary["tokens"]
    assert events.Scalars("train/goodput")[-1].value == pytest.approx(summary["goodput"], rel=0.02)
    assert events.Scalars("rounds/total")[-1].value == summary["rounds"]
    if importlib.util.find_spec("wandb"):  # --wandb offline: the same points
        [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
        history = wait_until(lambda: wandb_history(run_file), 60, "W&B's run file")
        logged = [row["heldout/loss"] for row in history if "heldout/loss" in row]
        assert logged == pytest.approx(losses, rel=1e-6)
        assert max(row["train/tokens"] for row in history) == summary["tokens"]

    report = tmp_path / "report.html"
    done = run_diloco("report", str(run_dir), "-o", str(report), timeout=60)
    assert done.returncode == 0, done.stderr
    page = report.read_text()
    figures = re.findall(r"<figure id='(\w+)'><img [^>]*src='data:image/png;base64,", page)
    assert figures == ["glance", "tokens", "time", "contributors", "bytes"]
    assert f"diloco run --config {run_dir / 'config.json'}" in page
    assert "--chaos kill:at=6s,down=2s" in page
    assert f"{100 * summary['goodput']:.1f}%" in page


def killed_learner_rejoined(tape: list[dict]) -> bool:
    """Whether the tape holds the kill's restart and every learner that restarted or
    crashed has joined again since: the run's ``--minutes`` is an upper bound; the tests
    above need no more of it, and no learner is stopped in the middle of its start."""
    down: dict[str, float] = {}  # learner -> its last restart or crash
    for r in tape:
        if r["event"] in ("restart", "crash") and r["target"].startswith("learner"):
            down[r["target"]] = r["t"]
    joined = {r["learner"]: r["t"] for r in tape if r["event"] == "join"}
    return bool(down) and all(joined.get(who, -1.0) > t for who, t in down.items())


@pytest.mark.timeout(120)
def test_a_standalone_syncer_serves_its_dashboard(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("a-shared-secret-for-this-test-000\n")
    os.chmod(token_file, 0o600)
    port_file = tmp_path / "syncer.addr"
    syncer = subprocess.Popen(
        diloco_command(
            "syncer",
            "--recipe=tiny",
            "--bind=127.0.0.1:0",
            f"--port-file={port_file}",
            f"--state-dir={tmp_path / 'state'}",
            "--dashboard=127.0.0.1:0",
            f"--token-file={token_file}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    learner = None
    try:
        link = wait_until(lambda: _dashboard_line(syncer), 60, "the syncer's dashboard line")
        address = wait_until(lambda: port_file.is_file() and port_file.read_text(), 30, "address")
        learner = subprocess.Popen(
            diloco_command(
                "learner",
                "--recipe=tiny",
                f"--syncer={address}",
                "--id=site-a",
                f"--workdir={tmp_path / 'site-a'}",
                "--total-steps=1000000",  # trains until the test stops it
                f"--token-file={token_file}",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        base, viewer = link.split("?token=")

        def merged():
            snap = json.loads(_get(base + "api/snapshot", viewer))
            rows = {ln["id"]: ln for ln in snap["learners"]}
            return "site-a" in rows and rows["site-a"]["contributions"] > 0 and snap

        snap = wait_until(merged, 60, "a merged contribution of site-a on the dashboard")
        assert snap["mode"] == "syncer" and snap["rounds"]["total"] > 0
        assert next(ln for ln in snap["learners"] if ln["id"] == "site-a")["live"]
        samples = scrape(base + "metrics", viewer)
        assert samples[("diloco_learner_contributions_total", (("learner", "site-a"),))] > 0
        with pytest.raises(urllib.error.HTTPError):
            _get(base + "api/snapshot", None)
    finally:
        for proc in (learner, syncer):
            stop(proc)


def _dashboard_line(proc) -> str | None:
    line = proc.stdout.readline()
    if not line and proc.poll() is not None:
        raise AssertionError("the syncer exited before serving its dashboard")
    return line.split("dashboard: ", 1)[1].strip() if line.startswith("dashboard: ") else None


def _get(url: str, token: str | None) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        return r.read()


def test_the_page_is_one_self_contained_file():
    """Nothing the page loads leaves its origin (the server's CSP would block it anyway)."""
    import diloco.dashboard

    page = (Path(diloco.dashboard.__file__).parent / "page.html").read_text()
    assert not re.search(r"""(src|href)=["']https?:""", page)
    assert 'fetch("api/snapshot"' in page
