"""The HTML report in a real browser: headless Chromium (Debian's ``chromium``) opens the report of a run
folder, the test clicks filters with real mouse events (DevTools ``Input.dispatchMouseEvent``) and checks
what is shown, follows a deep link, and saves a screenshot into the test's temp folder.

Without Chromium the test fails under CI (``CI`` set: ``.ci/run`` installs the package) and skips locally.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from watch_fixtures import Chromium, chromium_path, make_eval_run, make_train_run

from palaestra.evals.report import write_report
from palaestra.evals.runs import load_run
from palaestra.evals.show import diff_steps

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser() -> Any:
    binary = chromium_path()
    if binary is None:
        message = (
            "headless Chromium is not installed: `apt-get install -y chromium` (Debian package; .ci/run "
            "installs it) is needed for the HTML report's browser test"
        )
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(message)
        pytest.skip(message)
    with Chromium(binary, width=1200, height=1400) as chrome:
        yield chrome


def cards(chrome: Chromium) -> list[dict[str, str]]:
    return chrome.eval(  # type: ignore[no-any-return]
        "[...document.querySelectorAll('#list .card')].map(c => Object.assign({}, c.dataset))"
    )


def shown_count(chrome: Chromium) -> int:
    return int(chrome.eval("document.getElementById('match-count').dataset.n"))


def test_report_filters_by_click_in_chromium(browser: Chromium, tmp_path: Path) -> None:
    run = make_train_run(tmp_path / "run", steps=8, groups=4, group_size=4, val_every=2, val_n=40)
    report = write_report(run, page_size=25)
    view = load_run(run)
    every = view.rollouts()
    browser.open(report.as_uri())
    assert browser.eval("document.body.dataset.ready") == "1"
    assert shown_count(browser) == len(every) and len(cards(browser)) == 25  # first page of 25

    # click the "model_math" category chip: only model_math rollouts remain, counted as in Python
    browser.click('#chips-category button[data-value="model_math"]')
    want = [r for r in every if r.category == "model_math"]
    assert shown_count(browser) == len(want) > 0
    shown = cards(browser)
    assert shown and {c["category"] for c in shown} == {"model_math"}
    assert [c["uid"] for c in shown] == [r.uid for r in want][: len(shown)]
    assert "category=model_math" in browser.eval("location.hash")
    assert browser.eval("document.querySelector('#chips-category .chip.on').dataset.value") == "model_math"
    shot = browser.screenshot(tmp_path / "report.png")  # what the filtered browser shows
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    print(f"screenshot: {shot}")

    # then the step-4 validation row of the breakdown table: category and step filters combine
    browser.click('#breakdown-table button[data-goto-step="4"][data-goto-source="val"]')
    want = [r for r in every if r.step == 4 and r.source == "val" and r.category == "model_math"]
    shown = cards(browser)
    assert shown_count(browser) == len(want) and len(shown) == min(len(want), 25)
    assert all(c["step"] == "4" and c["source"] == "val" for c in shown)
    outcome_counts = browser.eval(
        "Object.fromEntries([...document.querySelectorAll('#chips-outcome button')]"
        ".map(b => [b.dataset.value, +b.querySelector('b').textContent]))"
    )
    expected = Counter(r.outcome for r in want)  # facet counts: every other filter applies
    assert {k: v for k, v in outcome_counts.items() if v} == dict(expected)

    # reset, then "bottom K by reward" through the order select and the K box
    browser.click("#f-reset")
    assert shown_count(browser) == len(every)
    browser.eval(
        "const o = document.getElementById('f-order'); o.value = 'top';"
        "o.dispatchEvent(new Event('change')); 0"
    )
    browser.eval(
        "const k = document.getElementById('f-k'); k.value = '7'; k.dispatchEvent(new Event('input')); 0"
    )
    top = [float(c["reward"]) for c in cards(browser)]
    assert top == sorted((r.reward for r in every), reverse=True)[:7]

    # the next-page button pages through the unfiltered list
    browser.click("#f-reset")
    browser.click('#pager-top button[data-go="next"]')
    assert [c["uid"] for c in cards(browser)] == [r.uid for r in every][25:50]

    # the diff section pairs the validation prompts of the first and last validated steps
    summary = browser.eval("document.getElementById('diff-summary').textContent")
    _, pairs, _, _ = diff_steps(view, 0, 8)
    verdicts = Counter(p.verdict for p in pairs)
    assert f"{len(pairs)} embedded prompt(s) in both" in summary
    assert f"improved {verdicts['improved']}, regressed {verdicts['regressed']}" in summary

    browser.screenshot(tmp_path / "report-diff.png")

    # a deep link opens filtered
    outcome = Counter(r.outcome for r in every if r.outcome != "ok").most_common(1)[0][0]
    browser.open("about:blank")  # a fresh load, not a same-document fragment change
    browser.open(report.as_uri() + f"#outcome={outcome}&source=train")
    want = [r for r in every if r.outcome == outcome and r.source == "train"]
    assert shown_count(browser) == len(want) and {c["outcome"] for c in cards(browser)} == {outcome}


def test_eval_report_in_chromium(browser: Chromium, tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, frozen=False)  # has a verifier-suspect row
    report = write_report(run)
    browser.open(report.as_uri())
    assert browser.eval("document.getElementById('diff') === null")
    browser.click('#chips-category button[data-value="verifier_suspect"]')
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    suspects = [r for r in rows if r["category"] == "verifier_suspect"]
    shown = cards(browser)
    assert shown_count(browser) == len(suspects) > 0 and {c["category"] for c in shown} == {
        "verifier_suspect"
    }
    text = browser.eval("document.querySelector('#list .card').textContent")
    assert "lenient ok" in text and "What is " in text
    browser.screenshot(tmp_path / "eval-report.png")


def test_report_shows_tokens_turn_rewards_and_tool_results(browser: Chromium, tmp_path: Path) -> None:
    from test_show import add_calculator_step

    run = make_train_run(tmp_path / "run", steps=2, groups=1, group_size=2, val_every=2, val_n=4)
    trajs = add_calculator_step(run, 3)
    report = write_report(run)
    browser.open("about:blank")
    browser.open(report.as_uri() + "#step=3&source=train")
    assert browser.eval("document.body.dataset.ready") == "1"
    assert shown_count(browser) == len(trajs)
    uids = [c["uid"] for c in cards(browser)]
    used = next(i for i, t in enumerate(trajs) if t.metrics["used_tool"])
    card = f"document.querySelector('#list .card[data-uid=\"{uids[used]}\"]')"
    # one coloured span per sampled token of every policy turn, with its logprob and entropy
    got = browser.eval(
        f"[...{card}.querySelectorAll('.tokens')].map(w => [...w.querySelectorAll('.tok')]"
        ".map(s => [s.textContent, +s.dataset.lp, s.dataset.h === '' ? null : +s.dataset.h, "
        "s.style.backgroundColor, s.title]))"
    )
    choices = trajs[used].choices()
    assert len(got) == len(choices)
    for spans, ch in zip(got, choices):
        content = ch.logprobs.content  # type: ignore[union-attr]
        assert [s[0] for s in spans] == [e.token for e in content]
        assert [s[1] for s in spans] == pytest.approx([e.logprob for e in content], abs=1e-4)
        assert all(s[2] is not None and s[2] >= 0 for s in spans)  # entropy from the top-5 alternatives
        assert all(s[3].startswith("rgba(") or s[3].startswith("hsla(") for s in spans)
        assert all("logprob" in s[4] and "entropy" in s[4] for s in spans)
    # the colour follows the probability: a likely token is green, an unlikely one red
    import math
    import re

    for spans in got:
        for _, lp, _, colour, _ in spans:
            r, g = (int(v) for v in re.findall(r"\d+", colour)[:2])
            if math.exp(lp) > 0.7:
                assert g > r, (lp, colour)
            elif math.exp(lp) < 0.3:
                assert r > g, (lp, colour)
    heads = browser.eval(f"[...{card}.querySelectorAll('.tokhead')].map(h => h.textContent)")
    assert "turn reward -0.05" in heads[0] and f"{len(choices[0].logprobs.content)} tokens" in heads[0]  # type: ignore[union-attr]
    text = browser.eval(f"{card}.textContent")
    assert "-> tool call calc(" in text and "(result of tool call calc call_" in text
    browser.eval(f"{card}.scrollIntoView(); 0")
    shot = browser.screenshot(tmp_path / "report-tokens.png")
    print(f"screenshot: {shot}")
