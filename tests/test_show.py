"""`palaestra show`: the uniform run view, filters, top/bottom K, step diffs, hidden characters, bad input."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from watch_fixtures import make_eval_run, make_select_run, make_train_run

from palaestra.cli import main
from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.evals.runs import load_run
from palaestra.evals.show import diff_steps, parse_steps, select
from palaestra.evals.taxonomy import OUTCOME_CATEGORY, category_of
from palaestra.trainer.advantages import batch_advantages
from palaestra.trajectories.io import DataError, read_groups, read_jsonl

HEAD = re.compile(r"^== (.*) ==$")
REWARD = re.compile(r"^reward (\S+)(?:  outcome (\S+) \((\S+)\))?")


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_train_run(tmp_path_factory.mktemp("watch") / "train", steps=6, groups=3, group_size=4)


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_eval_run(tmp_path_factory.mktemp("watch-eval"))


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["show", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def printed(text: str) -> list[tuple[str, float, str | None, str | None]]:
    """(header, reward, outcome, category) of each printed rollout."""
    rows, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        m = HEAD.match(line)
        if m and i + 1 < len(lines) and (r := REWARD.match(lines[i + 1])):
            rows.append((m.group(1), float(r.group(1)), r.group(2), r.group(3)))
    return rows


def test_train_view_reads_every_file_with_taxonomy_categories_and_advantages(train_run: Path) -> None:
    view = load_run(train_run)
    assert view.kind == "train" and view.sources() == ["train", "val"]
    assert view.steps() == [0, 1, 2, 3, 4, 5, 6] and view.steps("val") == [0, 2, 4, 6]
    assert view.stop is not None and view.stop["reason"] == "plateau"
    for step in range(1, 7):
        groups = read_groups(train_run / "samples" / f"step_{step:06d}.jsonl")
        rolls = view.rollouts(steps=[step], sources=["train"])
        assert len(rolls) == sum(len(g) for g in groups) == 12
        expected_adv = batch_advantages([g.rewards() for g in groups]).advantages
        flat = [float(a) for adv in expected_adv for a in adv]
        assert [r.advantage for r in rolls] == pytest.approx(flat)
        for r, t in zip(rolls, (t for g in groups for t in g.trajectories)):
            assert r.outcome == t.metadata["outcome"] and r.reward == t.reward
            assert r.category == OUTCOME_CATEGORY[r.outcome] == category_of(r.outcome)
            assert r.prompt.startswith("What is ") and r.completion == t.last_assistant_text()
    val = view.rollouts(steps=[4], sources=["val"])
    rows = read_jsonl(train_run / "val" / "step_000004.jsonl")
    assert [r.example_id for r in val] == [row["id"] for row in rows]
    assert [r.outcome for r in val] == [row["greedy_outcome"] for row in rows]
    assert all(r.prompt.startswith("What is ") for r in val)  # looked up in the env's val split by id
    tool = [r for r in view.rollouts(steps=[1]) if any(m.get("tool_calls") for m in r.messages)]
    assert tool and tool[0].messages[1]["tool_calls"] == [{"name": "calc", "arguments": '{"x": 1}'}]


def test_step_counts_match_history_and_the_taxonomy_table(train_run: Path) -> None:
    view = load_run(train_run)
    history = {row["step"]: row for row in view.history}
    counts = view.step_counts()
    for sc in counts:
        if sc.source == "val":
            assert sc.complete
            logged = {
                k.split("/", 2)[2]: v for k, v in history[sc.step].items() if k.startswith("val/outcome/")
            }
            assert sc.outcomes == logged and sc.n == history[sc.step]["val/n"]
        else:
            assert not sc.complete  # counted over the saved samples only
        by_cat = Counter()
        for code, n in sc.outcomes.items():
            by_cat[OUTCOME_CATEGORY[code]] += n
        assert sc.categories == dict(by_cat)
    assert {(sc.step, sc.source) for sc in counts} == set(view.files)


def test_show_filters_by_step_outcome_and_category(
    train_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    view = load_run(train_run)
    code, out, _ = run_cli(capsys, train_run, "--step", "3", "--limit", "0")
    assert code == 0
    shown = printed(out)
    assert len(shown) == len(view.rollouts(steps=[3])) and all(h.startswith("step 3 |") for h, *_ in shown)

    every = view.rollouts()
    outcome = Counter(r.outcome for r in every if r.outcome != "ok").most_common(1)[0][0]
    code, out, _ = run_cli(capsys, train_run, "--outcome", outcome, "--limit", "0")
    shown = printed(out)
    assert code == 0 and len(shown) == sum(r.outcome == outcome for r in every) > 0
    assert {o for _, _, o, _ in shown} == {outcome}

    code, out, _ = run_cli(capsys, train_run, "--category", "model_format", "--source", "val", "--limit", "0")
    shown = printed(out)
    want = [r for r in every if r.source == "val" and r.category == "model_format"]
    assert code == 0 and len(shown) == len(want) > 0
    assert {c for *_, c in shown} == {"model_format"} and all("| val |" in h for h, *_ in shown)
    assert {o for _, _, o, _ in shown} <= {k for k, v in OUTCOME_CATEGORY.items() if v == "model_format"}


def test_top_and_bottom_k_by_reward(train_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    view = load_run(train_run)
    pool = view.rollouts(sources=["train"])
    for flag, reverse in (("--top", True), ("--bottom", False)):
        code, out, _ = run_cli(capsys, train_run, "--source", "train", flag, "5")
        rewards = [r for _, r, _, _ in printed(out)]
        assert code == 0 and rewards == sorted((r.reward for r in pool), reverse=reverse)[:5]
    top = select(pool, order="top", k=3)
    assert [r.uid for r in top] == [
        r.uid for r in sorted(pool, key=lambda r: -r.reward)[:3]
    ]  # ties: file order


def test_messages_tool_calls_advantage_and_hidden_characters(
    train_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, train_run, "--step", "1", "--limit", "1")
    assert code == 0
    assert "-> tool call calc(" in out and "tool [call_1] <- calc | 1" in out and "advantage " in out
    assert "user       | What is " in out
    view = load_run(train_run)
    hidden = [r for r in view.rollouts() if "\u200b" in r.completion]
    assert hidden, "the synthetic run has zero-width spaces"
    r = hidden[0]
    code, out, _ = run_cli(
        capsys,
        train_run,
        "--step",
        r.step,
        "--source",
        r.source,
        "--id",
        r.example_id,
        "--outcome",
        "non_ascii",
        "--limit",
        "0",
    )
    assert "\\u{200B ZERO WIDTH SPACE}" in out and "\u200b" not in out
    trailing = [r for r in view.rollouts() if r.completion.endswith(" ")]
    if trailing:  # a trailing space stays visible inside the quotes
        t = trailing[0]
        code, out, _ = run_cli(capsys, train_run, "--step", t.step, "--id", t.example_id, "--limit", "0")
        assert f'"{t.completion}"' in out


def test_diff_pairs_the_same_prompts_between_steps(
    train_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = {r["id"]: r for r in read_jsonl(train_run / "val" / "step_000000.jsonl")}
    b = {r["id"]: r for r in read_jsonl(train_run / "val" / "step_000006.jsonl")}
    want = Counter()
    for ex_id, rb in b.items():
        ra = a[ex_id]
        if rb["greedy_reward"] != ra["greedy_reward"]:
            want["improved" if rb["greedy_reward"] > ra["greedy_reward"] else "regressed"] += 1
        else:
            want["same" if rb["greedy_completion"] == ra["greedy_completion"] else "changed"] += 1
    src, pairs, only_a, only_b = diff_steps(load_run(train_run), 0, 6)
    assert src == "val" and (only_a, only_b) == (0, 0) and Counter(p.verdict for p in pairs) == want
    assert [p.verdict for p in pairs] == sorted(
        (p.verdict for p in pairs), key=["improved", "regressed", "changed", "same"].index
    )
    code, out, _ = run_cli(capsys, train_run, "--diff", "first", "last", "--limit", "0")
    assert code == 0
    assert f"improved {want['improved']}, regressed {want['regressed']}" in out
    first = pairs[0]
    assert f"== id {first.example_id} | {first.verdict} |" in out
    assert f"step 0   : {json.dumps(a[first.example_id]['greedy_completion'], ensure_ascii=True)[:12]}" in out
    # train samples of two steps hold different prompts: asked explicitly, the diff says so
    src, pairs, only_a, only_b = diff_steps(load_run(train_run), 1, 2, source="train")
    assert src == "train" and len(pairs) + only_b == 3


def test_show_on_the_frozen_rollout_eval_run(eval_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    view = load_run(eval_run)
    results = read_jsonl(eval_run / "results.jsonl")
    assert view.kind == "eval" and view.steps() == [] and len(view.rollouts()) == len(results)
    assert [r.category for r in view.rollouts()] == [row["category"] for row in results]
    dataset = {e["id"]: e for e in read_jsonl(view.manifest["inputs"]["dataset"]["path"])}
    for r, row in zip(view.rollouts(), results):  # the completion shown is the one that was scored
        assert r.completion == row["completion_preview"] and r.outcome == row["outcome"]
        assert r.prompt == dataset[row["id"]]["prompt"]  # looked up in the dataset file the manifest names
        assert StrictFinalVerifier().score(dataset[row["id"]], r.completion).outcome == row["outcome"]
    failing = Counter(row["category"] for row in results if row["category"] != "ok").most_common(1)[0][0]
    code, out, _ = run_cli(capsys, eval_run, "--category", failing, "--limit", "0")
    shown = printed(out)
    assert code == 0 and len(shown) == sum(row["category"] == failing for row in results) > 0
    assert {c for *_, c in shown} == {failing} and "user       | What is " in out
    code, out, _ = run_cli(capsys, eval_run, "--bottom", "3", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["reward"] for r in rows] == sorted(float(x["reward"]) for x in results)[:3]
    code, _, err = run_cli(capsys, eval_run, "--diff", "0", "1")
    assert code == 2 and "no steps" in err


def test_show_flags_verifier_suspects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_eval_run(tmp_path, frozen=False)
    results = read_jsonl(run / "results.jsonl")
    suspects = [row for row in results if row["category"] == "verifier_suspect"]
    code, out, _ = run_cli(capsys, run, "--category", "verifier_suspect", "--limit", "0")
    assert code == 0 and len(printed(out)) == len(suspects) > 0  # lenient accepts, strict rejects
    assert out.count("lenient ok") == len(suspects) and "leading_zeros (verifier_suspect)" in out


def test_show_on_a_select_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_select_run(tmp_path, n_best=4)
    results = read_jsonl(run / "results.jsonl")
    view = load_run(run)
    assert view.kind == "select" and view.sources() == ["select"]
    assert [r.index for r in view.rollouts()] == [row["chosen_sample"] for row in results]
    code, out, _ = run_cli(capsys, run, "--top", "2")
    assert code == 0 and "== select | id " in out and "sample " in out and "n_correct " in out


def test_bad_input_is_named(tmp_path: Path, train_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, tmp_path / "nope")
    assert code == 2 and "run folder not found" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, tmp_path / "empty")
    assert code == 2 and "not a palaestra run folder" in err
    code, _, err = run_cli(capsys, train_run, "--step", "99")
    assert code == 2 and "no rollouts saved at step 99" in err
    code, _, err = run_cli(capsys, train_run, "--category", "model_maths")
    assert code == 2 and "unknown category 'model_maths'" in err
    broken = make_train_run(tmp_path / "broken", steps=2, val_every=1, val_n=3)
    with open(broken / "history.jsonl", "a", encoding="utf-8") as fh:
        fh.write("{not json\n")
    with pytest.raises(DataError, match=r"history\.jsonl:4: malformed JSON"):
        load_run(broken)
    samples = broken / "samples" / "step_000001.jsonl"
    samples.write_text(samples.read_text().replace('"reward":', '"reward":"x","was":', 1), encoding="utf-8")
    history = broken / "history.jsonl"
    history.write_text("".join(history.read_text().splitlines(keepends=True)[:3]))  # drop the broken line
    with pytest.raises(DataError, match=r"step_000001\.jsonl:1: invalid trajectory group"):
        load_run(broken).rollouts(steps=[1])
    assert parse_steps("first,last", load_run(train_run)) == [0, 6]


def test_rollouts_without_an_outcome_and_a_run_still_going(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from palaestra.trainer.runfolder import RunFolder
    from palaestra.trajectories.types import Trajectory, TrajectoryGroup

    run = make_train_run(tmp_path / "run", steps=2, val_every=1, val_n=3)
    (run / "summary.json").unlink()  # killed before the end
    judged = TrajectoryGroup(  # a judge reward: no verifier outcome on the trajectories
        [
            Trajectory(
                messages_and_choices=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": a}],
                reward=r,
            )
            for a, r in (("hello", 0.8), ("go away", 0.1))
        ],
        metadata={"example_id": "chat-1", "group_index": 0},
    )
    RunFolder(run).write_samples(3, [judged], cap=8)
    code, out, _ = run_cli(capsys, run, "--step", "3", "--category", "-")
    assert code == 0 and "no summary.json yet" in out
    shown = printed(out)
    assert [r for _, r, _, _ in shown] == [0.8, 0.1] and all(o is None for _, _, o, _ in shown)
    assert '"go away"' in out
    from palaestra.evals.report import write_report

    html = write_report(run).read_text(encoding="utf-8")
    assert "No summary.json: the run is still going" in html and "stop: " not in html


def add_calculator_step(root: Path, step: int) -> list[Any]:
    """Append a samples step of real calc-base calculator episodes (tool calls, top logprobs for the entropy,
    the tool cost recorded per turn) to a train run; returns its trajectories."""
    import asyncio

    from palaestra.envs.calculator import calculator_group_rollout
    from palaestra.models.registry import load
    from palaestra.trainer.runfolder import RunFolder
    from palaestra.trajectories.types import TrajectoryGroup

    ex = {
        "id": "calc-1",
        "prompt": "What is 81*92? Reply with one line: Final: <int>",
        "expected_answer": "7452",
        "family": "mul",
    }
    trajs = asyncio.run(
        calculator_group_rollout(
            load("calc-base"), ex, 4, seed=1, tool_cost=0.05, cost_per_turn=True, top_logprobs=5
        )
    )
    group = TrajectoryGroup(trajs, metadata={"example_id": ex["id"], "group_index": 0, "step": step})
    RunFolder(root).write_samples(step, [group], cap=4)
    return trajs


def test_per_token_logprobs_entropy_turn_rewards_and_tool_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import math
    import re

    run = make_train_run(tmp_path / "train", steps=2, groups=1, group_size=2)
    trajs = add_calculator_step(run, 3)
    used = next(t for t in trajs if t.metrics["used_tool"])
    code, out, _ = run_cli(capsys, run, "--step", "3", "--limit", "0")
    assert code == 0
    first = used.choices()[0]
    lps = [e.logprob for e in first.logprobs.content]  # type: ignore[union-attr]
    # the turn's header: token count, logprob sum and the per-turn reward (the tool cost of that turn)
    assert f"turn 0: {len(lps)} tokens, logprob sum {sum(lps):+.3f}, turn reward -0.05" in out
    # every sampled token with its logprob and an entropy estimate from the top-5 alternatives
    top = first.logprobs.content[0].top_logprobs  # type: ignore[union-attr]
    ps = [math.exp(a.logprob) for a in top]
    h = -sum(p * math.log(p) for p in ps) - (1 - sum(ps)) * math.log(1 - sum(ps))
    tok0 = first.logprobs.content[0]  # type: ignore[union-attr]
    assert f"{tok0.logprob:+.2f}/H{h:.2f}" in out
    # the tool result names the call it answers
    call_id = first.message.tool_calls[0].id  # type: ignore[index]
    assert re.search(rf"tool \[{call_id}\] <- calc \| ", out)
    assert "\x1b[" not in out  # no colour codes when not a terminal
    # colours on request (a terminal): green / yellow / red by probability
    from palaestra.evals.show import token_line

    coloured = token_line([{"t": "a", "lp": -0.1, "h": None}, {"t": "b", "lp": -3.0, "h": 1.5}], color=True)
    assert coloured.startswith("\x1b[32m") and "\x1b[31m" in coloured and "/H1.50" in coloured
    # --json carries the tokens too
    code, js, _ = run_cli(capsys, run, "--step", "3", "--json")
    rows = [json.loads(line) for line in js.splitlines()]
    toks = [m["tokens"] for r in rows for m in r["messages"] if m.get("tokens")]
    assert toks and all({"t", "lp", "h"} <= set(t[0]) for t in toks)


def test_bad_steps_diffs_and_ranks_are_named(train_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, train_run, "--step", "two")
    assert code == 2 and "--step: 'two' is not a step, a range a-b, 'first' or 'last'" in err
    code, _, err = run_cli(capsys, train_run, "--diff", "1-3", "last")
    assert code == 2 and "error: --diff takes two single steps, e.g. --diff 0 last" in err
    # step 0 has validation rows only, step 1 train samples only: nothing to pair
    code, _, err = run_cli(capsys, train_run, "--diff", "0", "1")
    assert code == 2 and "--diff: steps 0 and 1 share no rollout source (train samples or val rows)" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["show", str(train_run), "--top", "0"])
    assert exit_info.value.code == 2 and "argument --top: must be >= 1, got 0" in capsys.readouterr().err
    view = load_run(train_run)
    with pytest.raises(
        DataError, match=r"--diff: no rollouts saved at step 9 \(steps with rollouts: 0, 1, 2"
    ):
        diff_steps(view, 0, 9)
    with pytest.raises(ValueError, match=r"order must be one of \('file', 'top', 'bottom'\), got 'middle'"):
        select(view.rollouts(), order="middle")  # type: ignore[arg-type]


def test_many_steps_are_listed_in_short(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_train_run(tmp_path / "long", steps=14, groups=1, group_size=2, val_every=100, val_n=2)
    code, _, err = run_cli(capsys, run, "--step", "20")
    assert code == 2
    assert (
        "no rollouts saved at step 20 (steps with rollouts: 0, 1, 2, 3, 4, 5, ..., 12, 13, 14 (15 steps))"
        in err
    )


def test_diff_filters_limit_and_an_empty_selection(
    train_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = {r["id"]: r["greedy_outcome"] for r in read_jsonl(train_run / "val" / "step_000000.jsonl")}
    b = {r["id"]: r["greedy_outcome"] for r in read_jsonl(train_run / "val" / "step_000006.jsonl")}
    wrong = [i for i in b if "wrong_answer" in (a[i], b[i])]
    assert 1 < len(wrong) < len(b)
    code, out, _ = run_cli(
        capsys, train_run, "--diff", "first", "last", "--outcome", "wrong_answer", "--limit", "1"
    )
    assert code == 0
    assert f"  {len(wrong)} pair(s) with a rollout matching the filter on either side" in out
    assert out.count("== id ") == 1 and f"({len(wrong) - 1} more pair(s); --limit 0 shows all)" in out
    shown_id = re.search(r"== id (\S+) \|", out)
    assert shown_id is not None and shown_id.group(1) in wrong
    # a filter nothing matches: say which outcomes there are
    code, out, _ = run_cli(capsys, train_run, "--outcome", "wrong_answr")
    pool = load_run(train_run).rollouts()
    present = Counter(r.outcome for r in pool).most_common(8)
    assert code == 0 and f"-> 0 of {len(pool)} rollout(s)" in out and printed(out) == []
    assert "  outcomes present: " + ", ".join(f"{o} {n}" for o, n in present) in out


def test_odd_messages_notes_and_long_texts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from watch_fixtures import _choice

    from palaestra.evals.show import MAX_TOKENS_SHOWN, token_line
    from palaestra.trainer.runfolder import RunFolder
    from palaestra.trajectories.types import Trajectory, TrajectoryGroup

    run = make_train_run(tmp_path / "run", steps=1, groups=1, group_size=2, val_n=2)
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]  # multi-part content
    long_reply = "Final: 4 " + "x" * 300
    trajs = [
        Trajectory(  # no logprobs, but a per-turn reward
            messages_and_choices=[{"role": "user", "content": parts}, _choice(long_reply, logprobs=False)],
            reward=0.5,
            turn_rewards=[0.25],
            metadata={"score_details": "scored by hand"},
        ),
        Trajectory(  # more tokens than a line shows
            messages_and_choices=[{"role": "user", "content": "Say it"}, _choice("y" * 170, logprobs=True)],
            reward=0.0,
            metadata={"score_details": '["not", "an", "object"]'},
        ),
    ]
    RunFolder(run).write_samples(2, [TrajectoryGroup(trajs, metadata={"example_id": "odd-1"})], cap=4)
    code, out, _ = run_cli(capsys, run, "--step", "2", "--max-chars", "20")
    assert code == 0
    assert "user       | What is 2+2?" in out
    assert f'"Final: 4 xxxxxxxxxxx"  ...(+{len(long_reply) - 20} chars; --max-chars 0 shows all)' in out
    assert "~ turn reward +0.25" in out and "~ turn 0:" not in out.split("== step 2")[1].split("==")[0]
    assert "note: verifier details: scored by hand" in out
    assert 'note: verifier details: ["not", "an", "object"]' in out
    assert f"turn 0: 170 tokens, logprob sum {170 * -0.5:+.3f}" in out
    assert f"...(+{170 - MAX_TOKENS_SHOWN} tokens)" in out
    assert out.count('"y"-0.50') == MAX_TOKENS_SHOWN
    # a token without a usable logprob shows '?' and gets no colour
    assert token_line([{"t": "z", "lp": None}, {"t": "w", "lp": float("nan")}], color=True) == (
        '"z"?\x1b[0m "w"+nan\x1b[0m'
    )


def test_broken_or_foreign_run_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_train_run(tmp_path / "run", steps=2, val_every=1, val_n=3)
    val = run / "val" / "step_000001.jsonl"
    good = val.read_text()
    val.write_text(good.replace('"greedy_reward":', '"greedy_score":', 1))
    with pytest.raises(DataError, match=re.escape(f"{val}:1: validation row lacks a numeric 'reward'")):
        load_run(run).rollouts(steps=[1], sources=["val"])
    val.write_text(good)
    # an environment this install does not know: the rows still show, without their prompts
    for name in ("manifest.json", "config.json"):
        data = json.loads((run / name).read_text())
        data.setdefault("environment", {})["name"] = "my-private-env"
        data.setdefault("env", {})["name"] = "my-private-env"
        (run / name).write_text(json.dumps(data))
    val_rows = load_run(run).rollouts(sources=["val"])
    assert val_rows and all(r.prompt == "" for r in val_rows)
    assert {r.note for r in val_rows} == {"prompt not found (not stored in val rows)"}
    history = run / "history.jsonl"
    history.write_text(history.read_text() + '{"step": "3"}\n')
    code, _, err = run_cli(capsys, run)
    assert code == 2 and f"{history}:4: history row needs an integer 'step'" in err


def test_long_completions_are_noted_as_previews(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from palaestra.envs.arithmetic_data import load_split
    from palaestra.evals.evaluate import PREVIEW_CHARS, evaluate_completions

    ex = load_split("dev")[:2]
    long = f"Final: {ex[0]['expected_answer']}" + " and more" * 50
    rows = [{"id": ex[0]["id"], "completion": long}, {"id": ex[1]["id"], "completion": "Final: 0"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ex))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluate_completions(tmp_path / "d.jsonl", tmp_path / "c.jsonl", tmp_path / "run")
    notes = [r.note for r in load_run(tmp_path / "run").rollouts()]
    assert (
        notes[0] is not None
        and f"completion preview: first {PREVIEW_CHARS} of {len(long)} characters" in notes[0]
    )
    assert notes[1] is None or "preview" not in notes[1]
