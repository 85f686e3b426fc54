"""`palaestra inspect`: failures grouped by category and outcome, counts, examples with hidden chars shown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic_data import load_split
from palaestra.evals.evaluate import evaluate_completions, select_best
from palaestra.evals.show import inspect_run, visible
from palaestra.trajectories.io import DataError


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


KINDS = [
    ("ok", "Final: {g}"),
    ("wrong", "Final: {w}"),
    ("zw", "Final: {g}\u200b"),
    ("fullwidth", "Final: \uff14\uff12"),
    ("empty", ""),
    ("lines", "Let me think.\nFinal: {g}"),
]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    examples = load_split("dev")[:24]
    rows = []
    for i, e in enumerate(examples):
        g = int(e["expected_answer"])
        kind, tmpl = KINDS[i % len(KINDS)] if i < 18 else KINDS[1]  # extra wrong answers: the top outcome
        rows.append({"id": e["id"], "completion": tmpl.format(g=g, w=g + 3), "kind": kind})
    d = write(tmp_path / "d.jsonl", examples)
    c = write(tmp_path / "c.jsonl", rows)
    evaluate_completions(d, c, tmp_path / "run")
    return tmp_path / "run"


def test_visible_makes_hidden_characters_readable() -> None:
    assert visible("Final: 42") == '"Final: 42"'
    assert visible("Final: 42 ") == '"Final: 42 "'  # trailing space is inside the quotes
    assert visible("a\nb\t\\") == '"a\\nb\\t\\\\"'
    assert visible("4\u200b2") == '"4\\u{200B ZERO WIDTH SPACE}2"'
    assert visible("\u202e") == '"\\u{202E RIGHT-TO-LEFT OVERRIDE}"'
    assert visible("\uff14") == '"\\u{FF14 FULLWIDTH DIGIT FOUR}"'
    assert visible("\x00") == '"\\u{0000}"'
    assert visible("x" * 10, limit=4) == '"xxxx"...(+6 chars)'


def test_inspect_groups_counts_and_examples(run: Path) -> None:
    text = inspect_run(run, top_k=3, show=1)
    lines = text.splitlines()
    assert lines[0].startswith(f"run {run}  (loop A, eval, scorer arith-strict@1.0.0, 24 results)")
    cat = {
        ln.split()[0]: int(ln.split()[1])
        for ln in lines[lines.index(next(x for x in lines if x.startswith("By category"))) + 1 :][:5]
    }
    # 3 ok, 3+6 wrong; zero-width and multi-line answers hold the right number (naive accepts: suspect)
    assert cat["ok"] == 3 and cat["model_math"] == 9 and cat["data_invalid"] == 0
    assert cat["verifier_suspect"] >= 6  # zero-width and multi-line answers contain the right number
    assert sum(cat.values()) == 24
    assert "By outcome (top 3 of 5; all results):" in text
    assert "  wrong_answer           9" in text
    assert "(2 more outcome(s), 6 result(s)" in text
    assert "\\u{200B ZERO WIDTH SPACE}" in text or "\\u{FF14 FULLWIDTH DIGIT FOUR}" in text
    assert "why: well-formed answer" in text
    # --show 1: one example per outcome group
    block = text.split("== wrong_answer (9) ==")[1].split("==")[0]
    assert block.count("completion:") == 1


def test_only_fails_and_show_zero(run: Path) -> None:
    text = inspect_run(run, only_fails=True, top_k=10, show=0)
    assert "  ok " not in text and "failures only" in text
    assert "Examples" not in text
    full = inspect_run(run, top_k=10, show=24)
    # 6 non_ascii rows listed under their outcome, then again under their categories (3 model_format: the
    # fullwidth digits are not the gold even for the naive verifier; 3 verifier_suspect: the zero-width ones)
    assert full.count("outcome non_ascii") == 12
    assert '"Final: \\u{FF14 FULLWIDTH DIGIT FOUR}\\u{FF12 FULLWIDTH DIGIT TWO}"' in full
    assert '"Let me think.\\nFinal:' in full


def test_inspect_select_run_and_cli(tmp_path: Path, capsys: Any) -> None:
    examples = load_split("dev")[:2]
    rows = [{"id": e["id"], "completion": c} for e in examples for c in ("Final: 0000", "nope")]
    d = write(tmp_path / "d.jsonl", examples)
    s = write(tmp_path / "s.jsonl", rows)
    select_best(d, s, tmp_path / "sel", n=2)
    assert main(["inspect", "--run", str(tmp_path / "sel"), "--only-fails"]) == 0
    out = capsys.readouterr().out
    assert "loop B, select" in out and "pass@1 0" in out
    assert f"{examples[0]['id']} #" in out
    assert main(["inspect", "--run", str(tmp_path / "nope")]) == 2
    assert "run folder not found" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "sel"), "--run", str(tmp_path / "other")]) == 2
    assert "two runs given" in capsys.readouterr().err
    (tmp_path / "sel" / "results.jsonl").unlink()  # a select run without its results: an error, not 0 rows
    assert main(["inspect", str(tmp_path / "sel")]) == 2
    assert "results.jsonl: file not found" in capsys.readouterr().err


def test_bad_results_file_names_line(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "results.jsonl").write_text('{"id": "a", "reward": 1, "outcome": "ok"}\n{"id": "b"}\n')
    with pytest.raises(DataError, match=r"results.jsonl:2: result row lacks field 'reward'"):
        inspect_run(tmp_path / "r")


class CodeOfItsOwn:
    """A scorer whose rejection code is missing from the taxonomy table."""

    name = "arith-new-code"
    version = "1"

    def score(self, example: dict[str, Any], completion: str) -> Any:
        from palaestra.envs.verifier import Score

        ok = completion == f"Final: {example['expected_answer']}"
        return Score(1.0 if ok else 0.0, "ok" if ok else "new_code", {"reason": "made up"})


def test_unmapped_outcome_codes_are_flagged_and_bad_counts_refused(
    run: Path, tmp_path: Path, capsys: Any
) -> None:
    examples = load_split("dev")[:3]
    rows = [{"id": e["id"], "completion": t} for e, t in zip(examples, ["Final: 1", "no", "Final: -1"])]
    d = write(tmp_path / "d.jsonl", examples)
    c = write(tmp_path / "c.jsonl", rows)
    evaluate_completions(d, c, tmp_path / "new", scorer="test_inspect:CodeOfItsOwn")
    text = inspect_run(tmp_path / "new")
    assert "  unmapped               3  100.0%  outcome code missing from the taxonomy table" in text
    assert "WARNING: 3 result(s) have outcome codes missing from the taxonomy table" in text
    assert "WARNING" not in inspect_run(run)
    assert main(["inspect", str(run), "--top-k", "0"]) == 2
    assert "error: top_k must be >= 1 and show >= 0" in capsys.readouterr().err
    assert main(["inspect", str(run), "--show", "-1"]) == 2
    assert "error: top_k must be >= 1 and show >= 0" in capsys.readouterr().err
