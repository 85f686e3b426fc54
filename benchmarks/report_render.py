"""Size and render time of the HTML run report (``palaestra report``) for a synthetic 500-step train run.

Usage: ``python benchmarks/report_render.py [--quick] [--steps N] [--no-browser]``.

The run is written with the trainer's own writers (``tests/watch_fixtures.make_train_run``): each step saves
16 trajectories (4 groups x 4, with token logprobs, as ``samples_per_step`` keeps by default) and every 10th
step validates on 1000 examples, so a 500-step run holds 8,000 sampled trajectories and 51,000 validation
rows. Prints: run size on disk, the time to load it, ``palaestra show --step`` on one step, the time to write
the report, its size and how many rollouts it embeds; with Chromium installed, the time until the report's
script is ready in headless Chromium and the time of one filter click. ``--quick``: 40 steps, 100 val rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from watch_fixtures import Chromium, chromium_path, make_train_run  # noqa: E402

from palaestra.evals.report import MAX_ROLLOUTS, write_report  # noqa: E402
from palaestra.evals.runs import load_run  # noqa: E402
from palaestra.evals.show import show_text  # noqa: E402


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 steps, 100 validation rows (a few seconds)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--no-browser", action="store_true", help="skip the headless Chromium timing")
    args = ap.parse_args(argv)
    steps, val_n = (40, 100) if args.quick else (args.steps, 1000)
    print(
        f"report_render benchmark  {dt.datetime.now().isoformat(timespec='seconds')}  "
        f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu(s) python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        make_train_run(
            run, steps=steps, groups=4, group_size=4, val_every=10, val_n=val_n, tool_call_step=None
        )
        t_build = time.perf_counter() - t0
        print(
            f"synthetic train run: {steps} steps, 16 samples/step, val every 10 steps on {val_n} examples; "
            f"{folder_bytes(run) / 1e6:.1f} MB on disk (written in {t_build:.1f} s)"
        )

        t0 = time.perf_counter()
        view = load_run(run)
        t_load = time.perf_counter() - t0
        mid = view.steps("train")[len(view.steps("train")) // 2]
        t0 = time.perf_counter()
        text = show_text(view, steps=[mid], limit=5)
        t_show = time.perf_counter() - t0
        print(f"load_run (manifest, summary, history of {len(view.history)} rows): {t_load * 1e3:.0f} ms")
        print(
            f"palaestra show --step {mid} (reads one samples file): {t_show * 1e3:.0f} ms, {len(text)} chars"
        )

        t0 = time.perf_counter()
        out = write_report(run, Path(tmp) / "report.html")
        t_report = time.perf_counter() - t0
        size = out.stat().st_size
        import json
        import re

        html = out.read_text(encoding="utf-8")
        data = json.loads(re.search(r"id='report-data'>(.*?)</script>", html, re.S).group(1))  # type: ignore[union-attr]
        total = sum(t["n"] for t in data["totals"])
        print(f"palaestra report: {t_report:.2f} s to read every rollout file and write the HTML")
        print(
            f"report.html: {size / 1e6:.2f} MB, {len(data['rollouts'])} of {total} rollouts embedded "
            f"(cap {MAX_ROLLOUTS}), {len(data['texts'])} distinct message texts, "
            f"{len(view.step_counts())} breakdown rows"
        )

        binary = None if args.no_browser else chromium_path()
        if binary is None:
            print("headless Chromium: skipped" + ("" if args.no_browser else " (chromium not installed)"))
            return 0
        with Chromium(binary, width=1200, height=1400, timeout=60) as chrome:
            t0 = time.perf_counter()
            chrome.open(out.as_uri())
            t_open = time.perf_counter() - t0
            ready_ms = int(chrome.eval("document.body.dataset.readyMs"))
            click_ms = chrome.eval(
                "(() => { const t = performance.now();"
                " document.querySelector('#chips-category button[data-value=\"model_math\"]').click();"
                " return performance.now() - t; })()"
            )
            page_ms = chrome.eval(
                "(() => { const t = performance.now();"
                " document.querySelector('#pager-top button[data-go=\"next\"]').click();"
                " return performance.now() - t; })()"
            )
            shown = chrome.eval("document.getElementById('match-count').dataset.n")
        print(
            f"headless Chromium: script ready {ready_ms} ms after navigation start "
            f"(navigate + load event {t_open * 1e3:.0f} ms); category filter click re-render "
            f"{click_ms:.0f} ms ({shown} match); next page {page_ms:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
