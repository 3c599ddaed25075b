"""The README's dashboard screenshot and the report's main figure, made by the code itself.

    python benchmarks/readme_figures.py [--out docs] [--minutes 2] [--runs-dir /tmp/figures]

Runs ``diloco run --learners 4 --minutes M --chaos kill:mtbf=40s,down=5-10s`` (the default
recipe), opens its dashboard in Debian's chromium through playwright when three quarters of
the run have passed and saves ``OUT/dashboard.png``, then writes the main figure of the
finished run's report (``diloco.report.run_figures.at_a_glance``) to ``OUT/report_glance.png``
and the whole report beside the run. Needs ``/usr/bin/chromium`` (``make test`` installs it
as root).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHAOS = "kill:mtbf=40s,down=5-10s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs", help="where the two PNG files go (default docs)")
    p.add_argument("--minutes", type=float, default=2.0, help="the run's length (default 2)")
    p.add_argument("--runs-dir", default="/tmp/diloco-figures", help="where the run goes")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    from diloco.report.run_figures import at_a_glance
    from diloco.report.run_files import load_run

    name = time.strftime("figures-%Y%m%d-%H%M%S")
    run_dir = Path(args.runs_dir) / name
    command = [sys.executable, "-m", "diloco.cli", "run", "--learners=4",
               f"--minutes={args.minutes}", f"--chaos={CHAOS}", f"--runs-dir={args.runs_dir}",
               f"--name={name}", "--no-view"]  # fmt: skip
    run = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        url_file = run_dir / "dashboard.url"
        while not url_file.is_file():
            if run.poll() is not None:
                raise SystemExit("the run ended before it served its dashboard")
            time.sleep(0.5)
        url = url_file.read_text().strip()
        time.sleep(args.minutes * 60 * 0.75)
        out = Path(args.out)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
            )
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url)
            page.wait_for_selector("body[data-updates='3']", timeout=30_000)
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            browser.close()
        if run.wait(timeout=args.minutes * 60 + 120) != 0:
            raise SystemExit(f"the run failed (exit {run.returncode})")
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(60)
    (out / "report_glance.png").write_bytes(at_a_glance(load_run(run_dir)))
    subprocess.run([sys.executable, "-m", "diloco.cli", "report", str(run_dir)], check=True)
    print(f"wrote {out / 'dashboard.png'}, {out / 'report_glance.png'} (run {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
